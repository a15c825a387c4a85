"""Publishing a Hugging Face layout directory safely, whatever the model family: a save is staged
inside the target and moved in by renames, so the directory always loads as old or new."""

from __future__ import annotations

import json
import os
import re
import shutil

from erniekit.utils.io import atomic_write_json, fsync_dir, fsync_tree

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STAGING_NAME = ".erniekit-save.tmp"
_PREV_PREFIX = ".prev-"  # hard links that keep an old shard readable while a new one takes its name
_SHARD_RE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def start_staging(path: str) -> str:
    """A fresh staging directory inside `path` (what a crashed save left there is dropped first).
    A chat_template.jinja already in `path` is carried in, as the tokenizer rewrites only an existing one."""
    os.makedirs(path, exist_ok=True)
    staging = os.path.join(path, STAGING_NAME)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    for leftover in os.listdir(path):
        if leftover.startswith(_PREV_PREFIX) and not _index_names(os.path.join(path, INDEX_NAME)) & {leftover}:
            os.remove(os.path.join(path, leftover))
    os.makedirs(staging)
    template = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template):
        shutil.copyfile(template, os.path.join(staging, "chat_template.jinja"))
    return staging


def _read_index(index: str) -> dict | None:
    """An index file as {"weight_map": {tensor: file}, ...}; None when missing or unreadable."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("weight_map"), dict)
    return data if ok and all(isinstance(v, str) for v in data["weight_map"].values()) else None


def _index_names(index: str) -> set[str]:
    """File names an index's weight_map points at (empty without a readable index)."""
    data = _read_index(index)
    return set(data["weight_map"].values()) if data else set()


def publish_model_files(staging: str, path: str) -> None:
    """Move a complete model (or adapter) from `staging` into `path` so that at every moment `path`
    loads as the old model or the new one (here and in transformers):

    1. fsync the staged files; move the files that are the same within a run (config, tokenizer).
    2. Single file: one os.replace of model.safetensors switches the weights; an old index (which our
       loader prefers) is removed after it, then its shards.
    3. Sharded: old shards whose names the new ones take are first hard-linked to `.prev-NAME` and
       the old index pointed at the links; then the new shards take their names and the new index
       switches the weights in one os.replace; the links and an old model.safetensors go last.
    4. An adapter's adapter_config.json (what makes a directory an adapter) moves after its weights;
       a full model's save removes a stale adapter only once the new weights are in place.
    Nothing old is deleted before the new weights are in place; the staging directory goes last."""
    fsync_tree(staging)
    names = sorted(os.listdir(staging))
    shards = [n for n in names if _SHARD_RE.fullmatch(n)]
    weights = set(shards) | {INDEX_NAME, *ADAPTER_FILES}
    for n in names:
        if n not in weights:
            os.replace(os.path.join(staging, n), os.path.join(path, n))
    old_index = os.path.join(path, INDEX_NAME)
    if INDEX_NAME in names:
        old = _read_index(old_index)
        taken = set(old["weight_map"].values()) & set(shards) if old else set()
        if taken:
            for n in taken:
                prev = os.path.join(path, _PREV_PREFIX + n)
                if os.path.exists(prev):
                    os.remove(prev)
                os.link(os.path.join(path, n), prev)
            old["weight_map"] = {k: (_PREV_PREFIX + v if v in taken else v) for k, v in old["weight_map"].items()}
            atomic_write_json(old_index, old)
        for n in shards:
            os.replace(os.path.join(staging, n), os.path.join(path, n))
        fsync_dir(path)
        os.replace(os.path.join(staging, INDEX_NAME), old_index)  # the switch
    elif shards:
        os.replace(os.path.join(staging, WEIGHTS_NAME), os.path.join(path, WEIGHTS_NAME))  # the switch
        if os.path.exists(old_index):
            os.remove(old_index)
    for n in ADAPTER_FILES:  # weights first, then the config that makes the directory an adapter
        if n in names:
            os.replace(os.path.join(staging, n), os.path.join(path, n))
    fsync_dir(path)
    if shards:  # a full model: old weight files and a stale adapter (which loaders prefer) go now
        for n in reversed(ADAPTER_FILES):  # the config first: without it the directory is no adapter
            if os.path.exists(os.path.join(path, n)):
                os.remove(os.path.join(path, n))
        keep = set(names) | _index_names(old_index)
        for n in os.listdir(path):
            if (_SHARD_RE.fullmatch(n) or n.startswith(_PREV_PREFIX)) and n not in keep:
                os.remove(os.path.join(path, n))
    shutil.rmtree(staging)
    fsync_dir(path)


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*")


def shard_size_bytes(size: int | str, what: str = "max_shard_size") -> int:
    """Bytes of a shard-size limit (an int, or '5GB', '200KB', '1.5MB'); `what` names the setting
    in the error, e.g. the command-line flag it came from."""
    if isinstance(size, int):
        return size
    m = _SIZE_RE.fullmatch(size.upper())
    if not m:
        from erniekit.errors import CheckpointError

        raise CheckpointError(f"{what} {size!r} is not a size; use bytes or a size like '5GB'")
    return int(float(m[1]) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[m[2]])


# safetensors' names of the float dtypes, narrowest (fewest mantissa bits) first
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def stored_float_dtype(path: str) -> str:
    """The narrowest float dtype among the weights of a Hugging Face-layout directory, read from the
    safetensors headers (no tensor is read): what decides how far its logits may be from float32's."""
    import struct

    from erniekit.errors import CheckpointError

    names = sorted(_index_names(os.path.join(path, INDEX_NAME))) or [WEIGHTS_NAME]
    found: set[str] = set()
    for name in names:
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100_000_000:  # safetensors' own limit on a header
                    raise ValueError(f"a header of {n} bytes")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{file}: cannot read its safetensors header ({e}); re-run erniekit export") from None
        found |= {v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    for key, name in _FLOAT_DTYPES.items():
        if key in found:
            return name
    raise CheckpointError(
        f"{path}: no float32, float16 or bfloat16 weights in {', '.join(names)}; re-run erniekit export"
    )
