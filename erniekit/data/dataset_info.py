"""LLaMA-Factory's dataset registry, `dataset_info.json` (its data/README.md): a dataset name maps to
a local file, its formatting (alpaca | sharegpt), which record keys hold which part (`columns`),
the role values of sharegpt messages (`tags`) and whether it holds preference pairs (`ranking`).

A dataset path entry `DIR/dataset_info.json:NAME` (or a bare NAME with the `dataset_dir: DIR` key,
as LLaMA-Factory's `dataset` + `dataset_dir`) reads that dataset: each record is mapped onto the
record our own alpaca / sharegpt / preference readers take, so the checks and the encoding are
theirs. Errors name the file and line, and the dataset_info.json key to fix. Entries that download
(hf_hub_url, ms_hub_url, script_url, ...) are refused: nothing is fetched from the network.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass

from erniekit.errors import DataError
from erniekit.utils.io import json_problem

DATASET_INFO_NAME = "dataset_info.json"
DATA_SUFFIXES = (".json", ".jsonl")

_REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_IGNORED_KEYS = ("file_sha1", "subset", "folder", "revision")  # a checksum, or hub-only settings
_KNOWN_KEYS = ("file_name", "formatting", "ranking", "columns", "tags", "split", "num_samples")
_COLUMNS = {
    "alpaca": ("prompt", "query", "response", "history"),
    "sharegpt": ("messages",),
    "both": ("system", "tools", "images", "videos", "audios", "chosen", "rejected", "kto_tag"),
}
_OPTIONAL_COLUMNS = ("query", "history", "system", "tools")
_COLUMN_DEFAULTS = {"prompt": "instruction", "query": "input", "response": "output", "messages": "conversations"}
_UNSUPPORTED_COLUMNS = {
    "images": "multimodal records: write them as messages records with image_url parts",
    "videos": "multimodal records: write them as messages records with video_url parts",
    "audios": "audio is not supported",
    "kto_tag": "KTO data is not supported: use ranking (chosen / rejected) data with stage DPO",
}
_TAG_DEFAULTS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
_ROLE_TAGS = ("user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
# our sharegpt reader's role names (erniekit/data/formats.py _from_sharegpt)
_SHAREGPT_ROLE = {
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
}


def parse_ref(entry: str) -> tuple[str, str] | None:
    """`DIR/dataset_info.json:NAME` -> (the dataset_info.json path, NAME); None for a plain path."""
    head, sep, name = entry.rpartition(":")
    if sep and os.path.basename(head) == DATASET_INFO_NAME:
        return head, name
    return None


def dataset_ref(dataset_dir: str, name: str) -> str:
    """The dataset path entry naming dataset `name` of `dataset_dir`/dataset_info.json."""
    return f"{os.path.join(dataset_dir, DATASET_INFO_NAME)}:{name}"


@dataclass
class DatasetEntry:
    """One checked dataset_info.json entry."""

    info: str  # the dataset_info.json path
    name: str
    files: list[str]
    formatting: str  # alpaca | sharegpt
    ranking: bool
    columns: dict[str, str | None]
    tags: dict[str, str | None]
    explicit_columns: bool  # dataset_info.json gave `columns` (else LLaMA-Factory's defaults)

    @property
    def where(self) -> str:
        return f"{self.info}: dataset '{self.name}'"

    def missing(self, col: str, where: str) -> DataError:
        return DataError(
            f"{where}: columns.{col} of dataset '{self.name}' names key '{self.columns[col]}', which this record "
            f"lacks; fix columns.{col} in {self.info} or the record"
        )

    def reader_format(self, ranking: bool) -> str:
        """Which of our readers takes the mapped records: SFT alpaca / sharegpt, preference alpaca / messages."""
        if self.formatting == "alpaca":
            return "alpaca"
        return "messages" if ranking else "sharegpt"

    def to_record(self, rec: dict, where: str) -> dict:
        """`rec` with our reader's keys (see reader_format)."""
        return self._alpaca(rec, where) if self.formatting == "alpaca" else self._sharegpt(rec, where)

    def text(self, rec: dict, where: str) -> str:
        """A pretraining document: the prompt column, as LLaMA-Factory's pretraining reads it."""
        return self._str(rec, "prompt", where)

    # -- columns
    def _get(self, rec: dict, col: str, where: str, required: bool):
        key = self.columns.get(col)
        if key is None:
            if required:
                raise DataError(f"{self.where}: columns.{col} is not set; name the record key that holds it")
            return None
        if key not in rec:
            if required:
                raise self.missing(col, where)
            return None
        return rec[key]

    def _str(self, rec: dict, col: str, where: str, required: bool = True) -> str | None:
        value = self._get(rec, col, where, required)
        if value is None and not required:
            return None
        if not isinstance(value, str):
            raise DataError(
                f"{where}: key '{self.columns[col]}' (columns.{col} of dataset '{self.name}') must be a string, "
                f"got {type(value).__name__}"
            )
        return value

    def _alpaca(self, rec: dict, where: str) -> dict:
        prompt = self._str(rec, "prompt", where)
        query = self._str(rec, "query", where, required=False)
        out: dict = {"instruction": "\n".join(q for q in (prompt, query) if q)}  # LLaMA-Factory's "prompt\nquery"
        if self.ranking:
            out["chosen"] = self._str(rec, "chosen", where)
            out["rejected"] = self._str(rec, "rejected", where)
        else:
            out["output"] = self._str(rec, "response", where)
        for col, ours in (("system", "system"), ("history", "history")):
            value = self._get(rec, col, where, required=False)
            if value is not None:
                out[ours] = value
        if self._get(rec, "tools", where, required=False):
            raise DataError(f"{where}: tools in alpaca data are not read; use formatting: sharegpt for tool calls")
        return out

    def _role(self, msg: object, where: str, field: str) -> tuple[str, str]:
        """(the tag name its role value is, its content) of one sharegpt message."""
        role_key, content_key = self.tags.get("role_tag"), self.tags.get("content_tag")
        if not isinstance(msg, dict) or role_key not in msg or not isinstance(msg.get(content_key), str):
            raise DataError(
                f"{where}: {field} must be {{'{role_key}': role, '{content_key}': str}} (tags.role_tag / "
                f"tags.content_tag of dataset '{self.name}' in {self.info})"
            )
        for tag in _ROLE_TAGS:
            if self.tags.get(tag) is not None and msg[role_key] == self.tags[tag]:
                return tag, msg[content_key]
        known = ", ".join(f"{t}={self.tags[t]!r}" for t in _ROLE_TAGS if self.tags.get(t) is not None)
        raise DataError(
            f"{where}: {field}.{role_key}={msg[role_key]!r} is none of dataset '{self.name}''s tags ({known}); "
            f"fix the record or tags in {self.info}"
        )

    def _sharegpt(self, rec: dict, where: str) -> dict:
        msgs = self._get(rec, "messages", where, required=True)
        key = self.columns["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(
                f"{where}: key '{key}' (columns.messages of dataset '{self.name}') must be a non-empty list"
            )
        roles = [self._role(m, where, f"{key}[{i}]") for i, m in enumerate(msgs)]
        system = self._str(rec, "system", where, required=False)
        if roles[0][0] == "system_tag":  # a leading system message wins over the system column
            system, roles = roles[0][1], roles[1:]
        for i, (tag, _) in enumerate(roles):
            if tag == "system_tag":
                raise DataError(f"{where}: {key}[{i + 1}] is a system message after the first; only the first may be")
        if self.ranking:
            return self._sharegpt_pair(rec, roles, system, where)
        out: dict = {"conversations": [{"from": _SHAREGPT_ROLE[t], "value": v} for t, v in roles]}
        if system is not None:
            out["system"] = system
        tools = self._get(rec, "tools", where, required=False)
        if tools is not None:
            out["tools"] = tools
        return out

    def _sharegpt_pair(self, rec: dict, roles: list[tuple[str, str]], system: str | None, where: str) -> dict:
        names = {"user_tag": "user", "assistant_tag": "assistant"}
        bad = next((t for t, _ in roles if t not in names), None)
        if bad:
            raise DataError(
                f"{where}: a preference record with a {bad[:-4]} turn; tool turns are not supported in DPO data"
            )
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": names[t], "content": v} for t, v in roles
        ]
        out: dict = {"messages": msgs}
        for col in ("chosen", "rejected"):
            value = self._get(rec, col, where, required=True)
            tag, content = self._role(value, where, self.columns[col])
            if tag != "assistant_tag":
                raise DataError(
                    f"{where}: key '{self.columns[col]}' must be an assistant message "
                    f"({self.tags['role_tag']}={self.tags['assistant_tag']!r})"
                )
            out[col] = content
        return out

    def check_columns_seen(self, seen: set[str], file: str) -> None:
        """An optional column dataset_info.json names that no record of `file` has is a typo there."""
        if not self.explicit_columns:
            return  # the defaults (input, ...) may well be absent
        for col in _OPTIONAL_COLUMNS:
            key = self.columns.get(col)
            if key is not None and key not in seen:
                raise DataError(
                    f"{file}: columns.{col} of dataset '{self.name}' names key '{key}', which no record has; "
                    f"fix columns.{col} in {self.info}"
                )


def _read_info(file: str) -> dict:
    if not os.path.isfile(file):
        raise DataError(f"{file}: not found; put LLaMA-Factory's dataset_info.json there or fix dataset_dir")
    try:
        with open(file, encoding="utf-8") as f:
            info = json.load(f)
    except UnicodeDecodeError:
        raise DataError(f"{file}: not UTF-8; re-save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{file}:{e.lineno}: invalid JSON ({e.msg}); fix the file") from None
    except (ValueError, RecursionError) as e:  # nesting or an integer Python's decoder cannot hold
        raise DataError(f"{file}: invalid JSON ({json_problem(e)}); fix the file") from None
    if not isinstance(info, dict):
        raise DataError(f"{file}: expected a JSON object of dataset name -> description")
    return info


def _mapping(value: object, key: str, where: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(value, dict) or not all(isinstance(v, str) or v is None for v in value.values()):
        raise DataError(f"{where}: '{key}' must be an object of name -> string")
    for k in value:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(allowed)}"
            raise DataError(f"{where}: {key}.{k} is not a LLaMA-Factory {key[:-1]}; {hint}")
    return value


def _files(info: str, file_name: object, where: str) -> list[str]:
    if not isinstance(file_name, str) or not file_name:
        raise DataError(f"{where}: 'file_name' missing; name the data file (relative to {os.path.dirname(info)})")
    path = os.path.join(os.path.dirname(info), file_name)
    if os.path.isdir(path):  # LLaMA-Factory reads every file of a folder
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(DATA_SUFFIXES))
        if not files:
            raise DataError(f"{where}: file_name {file_name} is a directory without .json / .jsonl files")
        return files
    if not os.path.isfile(path):
        raise DataError(f"{where}: file_name {file_name} not found ({os.path.abspath(path)}); fix file_name")
    if not path.endswith(DATA_SUFFIXES):
        raise DataError(f"{where}: file_name {file_name}: erniekit reads .json / .jsonl data; convert the file")
    return [path]


def load_entry(info: str, name: str) -> DatasetEntry:
    """The checked entry `name` of dataset_info.json `info`; one-line DataError naming the key to fix."""
    registry = _read_info(info)
    if name not in registry:
        close = difflib.get_close_matches(name, list(registry), n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else f"it has {len(registry)} datasets"
        raise DataError(f"{info}: no dataset named '{name}'; {hint}")
    entry, where = registry[name], f"{info}: dataset '{name}'"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected an object with file_name, formatting, columns ...")
    remote = [k for k in _REMOTE_KEYS if entry.get(k)]
    if remote:
        raise DataError(
            f"{where}: {remote[0]}={entry[remote[0]]!r} is fetched from the network; erniekit reads local "
            "files only: download the data and give its file_name"
        )
    for k in entry:
        if k not in _KNOWN_KEYS + _IGNORED_KEYS:
            raise DataError(f"{where}: key '{k}' is not a LLaMA-Factory dataset key; remove it")
    if entry.get("num_samples") is not None:
        raise DataError(f"{where}: num_samples is not supported; cut the file to the examples to train on")
    if entry.get("split", "train") != "train":
        raise DataError(f"{where}: split={entry['split']!r}; a local file has only the 'train' split")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise DataError(f"{where}: formatting={formatting!r}; use alpaca or sharegpt")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise DataError(f"{where}: ranking={ranking!r} must be true or false")
    known = _COLUMNS[formatting] + _COLUMNS["both"]
    if "columns" in entry:  # as LLaMA-Factory: given columns replace all defaults
        given = _mapping(entry["columns"], "columns", where, _COLUMNS["alpaca"] + _COLUMNS["sharegpt"] + known)
        columns = {c: given.get(c) for c in known}
    else:
        columns = {c: _COLUMN_DEFAULTS.get(c) for c in known}
    for col, why in _UNSUPPORTED_COLUMNS.items():
        if columns.get(col):
            raise DataError(f"{where}: columns.{col}: {why}")
    if "tags" in entry and formatting == "sharegpt":
        given = _mapping(entry["tags"], "tags", where, tuple(_TAG_DEFAULTS))
        tags = {t: given.get(t) for t in _TAG_DEFAULTS}
    else:
        tags = dict(_TAG_DEFAULTS)
    files = _files(info, entry.get("file_name"), where)
    return DatasetEntry(info, name, files, formatting, ranking, columns, tags, "columns" in entry)
