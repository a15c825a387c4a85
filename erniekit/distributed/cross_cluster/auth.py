"""The shared key of the cross-cluster link and the HMAC-SHA256 helpers that use it.

Every cluster holds the same secret (a file or the ERNIEKIT_CROSS_CLUSTER_KEY environment variable);
it authenticates traffic, it does not encrypt it (docs/cross_cluster.md: use a WireGuard or SSH tunnel
for confidentiality). The key never appears in an error, a warning or a log line."""

import hashlib
import hmac
import os
import stat
import warnings

from erniekit.errors import ConfigError

KEY_ENV = "ERNIEKIT_CROSS_CLUSTER_KEY"
MIN_KEY_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size  # 32

_MAKE_ONE = "e.g. `head -c 32 /dev/urandom | base64 > cc.key && chmod 600 cc.key`, copied to every cluster"


def load_key(key_file: str | None) -> bytes:
    """The key from `key_file` if given, else from $ERNIEKIT_CROSS_CLUSTER_KEY; trailing newlines are
    dropped so `echo`-written files and env values agree. Warns when the file is readable by others."""
    if key_file:
        try:
            mode = os.stat(key_file).st_mode
            with open(key_file, "rb") as f:
                key = f.read().rstrip(b"\r\n")
        except OSError as e:
            raise ConfigError(
                f"cross_cluster_key_file={key_file}: cannot read it ({e.strerror}); {_MAKE_ONE}"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(
                f"cross_cluster_key_file={key_file} is readable by group/others (mode {stat.S_IMODE(mode):o}); "
                f"run `chmod 600 {key_file}`",
                stacklevel=2,
            )
        where = f"cross_cluster_key_file={key_file}"
    else:
        value = os.environ.get(KEY_ENV)
        if value is None:
            raise ConfigError(
                f"no cross-cluster key: set cross_cluster_key_file or the {KEY_ENV} variable ({_MAKE_ONE})"
            )
        key = value.encode("utf-8").rstrip(b"\r\n")
        where = f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the key has {len(key)} bytes, at least {MIN_KEY_BYTES} are needed ({_MAKE_ONE})")
    return key


def mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenation of `parts` (fed piecewise: a large payload is never copied)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def verify(key: bytes, tag: bytes | bytearray | memoryview, *parts: bytes | bytearray | memoryview) -> bool:
    """True when `tag` is the HMAC of `parts`; constant-time, so timing tells nothing about the key."""
    return hmac.compare_digest(mac(key, *parts), bytes(tag))


def session_key(key: bytes, context: bytes, nonce_low: bytes, nonce_high: bytes) -> bytes:
    """A per-connection key derived from both sides' fresh nonces: traffic recorded in one session
    fails every check in another, so it cannot be replayed into it."""
    return mac(key, b"erniekit-cross-cluster-session\0", context, nonce_low, nonce_high)
