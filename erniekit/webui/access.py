"""Who may reach the WebUI and which files it may touch (gradio-free, so it is tested cheaply).

The WebUI trains, loads and writes models on the machine it runs on, for whoever can reach its
port. Three guards follow from that:
* a loud warning when it listens on more than loopback (or opens a --share link), louder still
  without a login;
* an optional login (`--auth USER:PASSWORD`, `--auth-file FILE`, or ERNIEKIT_WEBUI_AUTH), handed
  to gradio's own auth, which compares passwords in constant time; the password is never printed;
* every filesystem path a page (or its HTTP API) hands in is confined to the working directory
  and the directories the user allowed with `--allow-path`, after symlinks and `..` are resolved,
  so a visitor cannot export into /etc or read a model from a home directory.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from erniekit.errors import ErniekitError

AUTH_ENV = "ERNIEKIT_WEBUI_AUTH"


def is_loopback(host: str) -> bool:
    """True when `host` is reachable only from this machine: 127.0.0.0/8, ::1, localhost, or a
    name that resolves to loopback addresses only. 0.0.0.0 / :: (every interface) and names that
    do not resolve count as exposed: a false alarm is cheaper than a silent exposure."""
    h = (host or "").strip().strip("[]")
    if not h:
        return False
    if h.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except (OSError, UnicodeError):
        return False
    addrs = {i[4][0].split("%")[0] for i in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def exposure_warning(host: str, share: bool, has_auth: bool) -> str | None:
    """The warning for a WebUI others can reach, or None when it listens on loopback only."""
    where = []
    if not is_loopback(host):
        where.append(f"--host {host} (other machines on the network can connect)")
    if share:
        where.append("--share (a public gradio.live link: anyone on the internet who has it)")
    if not where:
        return None
    head = "WARNING: the erniekit WebUI is reachable beyond this machine: " + "; ".join(where) + "."
    if has_auth:
        return (
            head + " A login is required (--auth), but traffic is plain HTTP: use it only on a network "
            "you trust, or put it behind HTTPS."
        )
    return (
        head + " NO LOGIN IS SET: anyone who can connect can train, load and export models and write "
        "files under the allowed directories. Set a login (--auth-file FILE or the environment variable "
        f"{AUTH_ENV}=USER:PASSWORD), or bind 127.0.0.1 and use an SSH tunnel."
    )


def banner(text: str) -> str:
    """The warning framed for a terminal, so it is not lost among gradio's own lines."""
    bar = "!" * 78
    return f"\n{bar}\n{text}\n{bar}\n"


def parse_auth(spec: str, source: str) -> tuple[str, str]:
    """USER:PASSWORD -> (user, password). The error names where the value came from but never
    repeats it (it holds a password)."""
    user, sep, password = (spec or "").strip("\r\n").partition(":")
    if not sep or not user or not password:
        raise ErniekitError(
            f"webui: {source} must be USER:PASSWORD with both parts non-empty (the value is not "
            "shown: it holds a password)"
        )
    if user != user.strip():
        raise ErniekitError(f"webui: {source}: the user name has leading or trailing spaces; remove them")
    return user, password


def read_auth_file(path: str) -> list[tuple[str, str]]:
    """One USER:PASSWORD per line (several users allowed; blank lines and # comments skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ErniekitError(
            f"webui: --auth-file {path}: cannot read it ({type(e).__name__}: "
            f"{getattr(e, 'strerror', None) or 'not UTF-8'}); give a readable text file with "
            "USER:PASSWORD lines"
        ) from None
    users = [
        parse_auth(line, f"--auth-file {path} line {i}")
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not users:
        raise ErniekitError(f"webui: --auth-file {path} has no USER:PASSWORD line; add one")
    return users


def resolve_auth(
    arg: str | None = None, file: str | None = None, environ: dict | None = None
) -> list[tuple[str, str]] | None:
    """The login accounts for gradio's `launch(auth=...)`, from --auth, else --auth-file, else the
    environment variable ERNIEKIT_WEBUI_AUTH; None when none is set (no login)."""
    if arg is not None and file is not None:
        raise ErniekitError("webui: give --auth or --auth-file, not both")
    if arg is not None:
        return [parse_auth(arg, "--auth")]
    if file is not None:
        return read_auth_file(file)
    env = os.environ if environ is None else environ
    if env.get(AUTH_ENV):
        return [parse_auth(env[AUTH_ENV], f"the environment variable {AUTH_ENV}")]
    return None


class PathPolicy:
    """The directories the WebUI may read and write: the working directory plus --allow-path DIRs.

    A path is resolved the way the process that uses it will see it (relative to the current
    directory, symlinks and `..` followed with os.path.realpath) and must then lie inside one of
    the roots. The guard is against visitors of the page, who cannot create symlinks; a local user
    who can is already past it."""

    def __init__(self, workdir: str | None = None, allow: list[str] | tuple[str, ...] = ()):
        self.workdir = os.path.realpath(workdir or os.getcwd())
        roots = [self.workdir]
        for d in allow:
            r = os.path.realpath(os.path.expanduser(d))
            if not os.path.isdir(r):
                raise ErniekitError(f"webui: --allow-path {d}: not a directory; give an existing directory")
            roots.append(r)
        self.roots = list(dict.fromkeys(roots))

    def allowed(self, path: str) -> bool:
        real = os.path.realpath(os.path.expanduser(path))
        return any(os.path.commonpath([real, r]) == r for r in self.roots)

    def check(self, path: str, what: str) -> str:
        """`path` if it lies inside an allowed directory, else a one-line error saying how to allow it."""
        path = (path or "").strip()
        if not path:
            raise ErniekitError(f"the {what} is empty")
        if not self.allowed(path):
            real = os.path.realpath(os.path.expanduser(path))
            via = "" if real == os.path.abspath(path) else f" (it resolves to {real})"
            where = self.workdir if len(self.roots) == 1 else ", ".join(self.roots)
            widen = real if os.path.isdir(real) else os.path.dirname(real)
            raise ErniekitError(
                f"{what} {path}{via} is outside the directories this WebUI may use ({where}); "
                f"choose a path inside them, or restart erniekit webui with --allow-path {widen}"
            )
        return path
