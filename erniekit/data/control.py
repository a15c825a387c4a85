"""Control attributes (ERNIE 3.0 Titan's controllable language modelling): a record's
`"control": {"style": "words", "length": "short"}` is rendered as one prefix line the model learns to
follow, and the same line steers generation (`erniekit chat --control`, the server's
`extra_body.control`).

The prefix is `<control>length=short; style=words</control>`, attributes in sorted key order, put as
the first line of the system part (a system message is added when there is none), so a multi-turn
chat keeps it in one place and training and inference render the same text (docs/control.md).
Training drops attributes at random (`control_drop_prob`) so the model still answers without them;
which ones are dropped is a fixed function of (seed, example index, key): rebuilding the rows, as a
resumed run does, drops the same ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable

from erniekit.errors import DataError

OPEN, CLOSE = "<control>", "</control>"
MAX_ATTRIBUTES = 8
MAX_KEY_CHARS = 32
MAX_VALUE_CHARS = 64
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
# would make the prefix ambiguous, or break its one line (every line break str.splitlines knows)
_BAD_VALUE = re.compile("[;=<>\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def check_control(value: object, where: str, field: str = "control") -> dict[str, str]:
    """`value` as a {key: value} dict of short strings, or a one-line DataError naming `where` and `field`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(
            f'{where}: field \'{field}\' must be an object of attribute: value strings, e.g. {{"style": "words"}}'
        )
    if len(value) > MAX_ATTRIBUTES:
        raise DataError(f"{where}: field '{field}' has {len(value)} attributes; at most {MAX_ATTRIBUTES} are allowed")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not KEY.fullmatch(k) or len(k) > MAX_KEY_CHARS:
            raise DataError(
                f"{where}: {field} key {k!r:.60} must be 1-{MAX_KEY_CHARS} letters, digits, '_', '.' or '-' (a letter or '_' first)"
            )
        if not isinstance(v, str) or not v.strip() or len(v) > MAX_VALUE_CHARS or _BAD_VALUE.search(v):
            raise DataError(
                f"{where}: {field}.{k} must be a non-empty string of at most {MAX_VALUE_CHARS} characters "
                "without ; = < > or line breaks"
            )
        out[k] = v.strip()
    return out


def render_control(control: dict[str, str]) -> str:
    """The prefix line for `control` ("" for none): `<control>k1=v1; k2=v2</control>`, keys sorted."""
    if not control:
        return ""
    return OPEN + "; ".join(f"{k}={control[k]}" for k in sorted(control)) + CLOSE


def control_system(system: str | None, control: dict[str, str]) -> str | None:
    """The system text with the control prefix as its first line (None stays None without control)."""
    prefix = render_control(control)
    if not prefix:
        return system
    return prefix if not system else f"{prefix}\n{system}"


def with_control(messages: list[dict], control: dict[str, str]) -> list[dict]:
    """OpenAI-style messages with the control prefix in the system message (added first when missing)."""
    if not control:
        return messages
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": control_system(messages[0].get("content") or None, control)}, *messages[1:]]
    return [{"role": "system", "content": render_control(control)}, *messages]


def _unit(seed: int, index: int, key: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, index, key), the same in every process and run."""
    digest = hashlib.blake2b(f"control-drop/{seed}/{index}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def drop_control(control: dict[str, str], prob: float, seed: int, index: int) -> dict[str, str]:
    """`control` with each attribute removed with probability `prob`, decided by (seed, index, key)."""
    if prob <= 0 or not control:
        return dict(control)
    return {k: v for k, v in control.items() if _unit(seed, index, k) >= prob}


def drop_controls(convs: list, prob: float, seed: int) -> list:
    """Training conversations with their attributes dropped (drop_control, index = position in the data)."""
    if prob <= 0:
        return list(convs)
    return [dataclasses.replace(c, control=drop_control(c.control, prob, seed, i)) for i, c in enumerate(convs)]


def parse_control_args(items: list[str], where: str = "--control") -> dict[str, str]:
    """`["style=words", "length=short"]` (the CLI's repeatable --control) -> checked dict."""
    raw: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise DataError(f"{where} {item!r} must be KEY=VALUE, e.g. --control style=words")
        if key.strip() in raw:
            raise DataError(f"{where} gives {key.strip()!r} twice; give each attribute once")
        raw[key.strip()] = value
    return check_control(raw, where, "control")


# ---- following: does a reply do what its control asked? ------------------------------------------
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand minus"
).split()
_WORDS_RE = re.compile(r"(?:%s)(?:[ \-](?:%s))*" % ("|".join(_NUMBER_WORDS), "|".join(_NUMBER_WORDS)))
_DIGITS_RE = re.compile(r"-?\d+")

# (attribute, value) -> whether a reply follows it; the attributes erniekit can measure
FOLLOW_CHECKS: dict[tuple[str, str], Callable[[str], bool]] = {
    ("style", "digits"): lambda reply: bool(_DIGITS_RE.fullmatch(reply.strip())),
    ("style", "words"): lambda reply: bool(_WORDS_RE.fullmatch(reply.strip())),
}


def follows(control: dict[str, str], reply: str) -> dict[tuple[str, str], bool]:
    """For each attribute of `control` that has a check: whether `reply` follows it."""
    return {(k, v): FOLLOW_CHECKS[(k, v)](reply) for k, v in sorted(control.items()) if (k, v) in FOLLOW_CHECKS}
