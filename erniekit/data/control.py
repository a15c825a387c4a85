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

What a model was trained on is recorded beside its weights (`control_attributes.json`: per key, the
values the training records had and how many; at most MAX_RECORDED_VALUES per key, a key with more is
"open"; at most MAX_RECORDED_KEYS keys, a record with more is "open_keys"), so `chat --control`, the
server and held-out evaluation refuse an attribute the model never saw (check_trained_control) instead
of rendering a prefix with no trained effect.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable

from erniekit.errors import CheckpointError, DataError

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


# ---- the record of the attributes a model was trained on (control_attributes.json) -------------------
CONTROL_RECORD_NAME = "control_attributes.json"
RECORD_VERSION = 1
# version 1 plus "open_keys": true, written only for a record past MAX_RECORDED_KEYS: an erniekit that
# reads version 1 alone then refuses the file (a one-line error) instead of refusing keys the model learnt
OPEN_KEYS_VERSION = 2
MAX_RECORDED_VALUES = 64  # per key; a key with more distinct values is "open": any value is accepted
# Keys recorded; with more the record is "open_keys": an unknown key is accepted. The check is there for
# a mistyped key among a model's few attributes (ERNIE 3.0 Titan's: genre, topic, keywords, sentiment,
# length); hundreds of distinct keys are data that uses keys as values (ids, free text), which no list
# guards. 256 is 32 times the 8 attributes one record may carry, and keeps the file that chat and the
# server read at start-up bounded (256 x 64 values, longest keys and values: 1.3 MB, read in 4 ms).
MAX_RECORDED_KEYS = 256
_SHOWN_VALUES = 16  # values (and keys) a refusal lists


def count_controls(controls: Iterable[dict[str, str]]) -> dict:
    """The record of training controls: per key, each value's number of records (controls as the data
    had them, before control_drop_prob: a dropped attribute is still trained on other records)."""
    counts: dict[str, Counter] = {}
    records = 0
    for control in controls:
        records += bool(control)
        for k, v in control.items():
            counts.setdefault(k, Counter())[v] += 1
    attrs = {k: _bounded(dict(c), False) for k, c in counts.items()}
    return _record(records, attrs, {k: c.total() for k, c in counts.items()}, False)


def _record(records: int, attrs: dict[str, dict], weights: dict[str, int], open_keys: bool) -> dict:
    """A record of at most MAX_RECORDED_KEYS keys, those most records had (`weights`; ties by key);
    more make it "open_keys" (written as OPEN_KEYS_VERSION): a key it does not list is accepted."""
    kept = sorted(attrs, key=lambda k: (-weights[k], k))[:MAX_RECORDED_KEYS]
    open_keys = open_keys or len(attrs) > MAX_RECORDED_KEYS
    record = {"version": OPEN_KEYS_VERSION if open_keys else RECORD_VERSION, "records": records}
    if open_keys:
        record["open_keys"] = True
    record["attributes"] = {k: attrs[k] for k in sorted(kept)}
    return record


def _bounded(values: dict[str, int], is_open: bool) -> dict:
    """At most MAX_RECORDED_VALUES values, the most frequent (ties by value); more make the key open."""
    kept = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_RECORDED_VALUES]
    return {"open": is_open or len(values) > MAX_RECORDED_VALUES, "values": dict(sorted(kept))}


def merge_records(a: dict | None, b: dict | None) -> dict | None:
    """The union of two records, counts added (a model trained on `a`'s data, then on `b`'s); None
    when both are None or empty."""
    parts = [r for r in (a, b) if r and r.get("attributes")]
    if not parts:
        return None
    attrs: dict[str, dict] = {}
    for r in parts:
        for k, entry in r["attributes"].items():
            was = attrs.setdefault(k, {"open": False, "values": Counter()})
            was["open"] = was["open"] or entry["open"]
            was["values"].update(entry["values"])
    for r in parts:  # a key an open_keys record left out may hold any values it had: open
        if r.get("open_keys", False):
            for k in attrs.keys() - r["attributes"].keys():
                attrs[k]["open"] = True
    merged = {k: _bounded(dict(e["values"]), e["open"]) for k, e in attrs.items()}
    weights = {k: e["values"].total() for k, e in attrs.items()}
    open_keys = any(r.get("open_keys", False) for r in parts)
    return _record(sum(r.get("records", 0) for r in parts), merged, weights, open_keys)


def read_control_record(model_dir: str | None) -> dict | None:
    """`model_dir`'s record, or None when it has none (a base model, an older checkpoint, a preset
    name); a damaged file is a one-line CheckpointError."""
    from erniekit.utils.io import read_json_object

    path = os.path.join(model_dir, CONTROL_RECORD_NAME) if model_dir else ""
    if not path or not os.path.isfile(path):
        return None
    hint = "delete it to skip the check of control attributes (docs/control.md)"
    record = read_json_object(path, hint)
    problem = _record_problem(record)
    if problem:
        raise CheckpointError(f"{path}: {problem}; {hint}")
    return record


def _record_problem(record: dict) -> str | None:
    """What is wrong with a record read from a file (None when it is well formed)."""
    if record.get("version") not in (RECORD_VERSION, OPEN_KEYS_VERSION):
        return f"version {record.get('version')!r} is not {RECORD_VERSION} or {OPEN_KEYS_VERSION}"
    if not isinstance(record.get("open_keys", False), bool):
        return "'open_keys' must be true or false"
    attrs = record.get("attributes")
    if not isinstance(attrs, dict):
        return "'attributes' must be an object of key: {open, values}"
    for k, entry in attrs.items():
        values = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(values, dict) or not isinstance(entry.get("open"), bool):
            return f'attributes.{k:.40} must be {{"open": true|false, "values": {{value: count}}}}'
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in values.values()):
            return f"attributes.{k:.40}.values must map each value to a record count"
    n = record.get("records")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return "'records' must be the number of training records (an integer >= 0)"
    return None


def write_control_record(model_dir: str, record: dict | None) -> None:
    """Write `record` into `model_dir` (atomically); no record removes a stale file an older run left
    there, since the weights beside it are no longer the ones it described."""
    from erniekit.utils.io import atomic_write_json

    path = os.path.join(model_dir, CONTROL_RECORD_NAME)
    if record:
        atomic_write_json(path, record)
    elif os.path.isfile(path):
        os.remove(path)


def check_trained_control(control: dict[str, str], record: dict | None, where: str, source: str = "") -> None:
    """Refuse an attribute (unless the record is open_keys), or a value of a closed key, that `record`
    says the model was not trained on (DataError: `where`KEY=VALUE, a did-you-mean and what it was
    trained on). No record: no check."""
    if not record or not control:
        return
    attrs = record["attributes"]
    tail = f" ({source}; docs/control.md)" if source else " (docs/control.md)"
    for k, v in sorted(control.items()):
        if k not in attrs and record.get("open_keys", False):  # trained on more keys than it lists
            continue
        if k not in attrs:
            raise DataError(
                f"{where}{k}={v}: this model was not trained with the attribute {k!r}{_did_you_mean(k, attrs)}; "
                f"its attributes: {_listed(attrs)}{tail}"
            )
        entry = attrs[k]
        if not entry["open"] and v not in entry["values"]:
            raise DataError(
                f"{where}{k}={v}: this model was trained on {k} = {_listed(entry['values'])} only"
                f"{_did_you_mean(v, entry['values'])}{tail}"
            )


def check_model_control(model_dir: str, control: dict[str, str], where: str = "--control ") -> None:
    """`control` against the attributes `model_dir` was trained on (its CONTROL_RECORD_NAME, read
    without the weights; none: no check). No control: the file is not read, so a damaged one stops
    only a request that needs it."""
    if control:
        source = os.path.join(model_dir, CONTROL_RECORD_NAME)
        check_trained_control(control, read_control_record(model_dir), where, source)


def check_conversation_controls(convs: Iterable, record: dict | None, data: str, source: str) -> None:
    """Each conversation's control against `record` (from `source`; None: no check), the error
    naming its file:line (or `data`, record N): held-out or evaluated data the model never saw the
    attributes of would measure a prefix it never learnt."""
    for i, c in enumerate(convs):
        where = c.source or f"{data}, record {i + 1}"
        check_trained_control(c.control, record, f"{where}: control ", source)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _listed(values: Iterable[str]) -> str:
    names = sorted(values)
    more = len(names) - _SHOWN_VALUES
    return ", ".join(names[:_SHOWN_VALUES]) + (f" and {more} more" if more > 0 else "")


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
