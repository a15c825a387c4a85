"""Atomic file writes: a crash never leaves a half-written config, checkpoint or log index."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` then rename over `path` (same directory, so the rename is atomic)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    def _w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, _w)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json_object(path: str, hint: str = "fix or regenerate the file") -> dict:
    """A JSON object from `path`; malformed JSON or a non-object is a one-line CheckpointError."""
    from erniekit.errors import CheckpointError

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); {hint}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at top level; {hint}")
    return data


def replace_dir(tmp_dir: str, final_dir: str) -> None:
    """Publish a fully written directory under its final name (old one removed after the swap)."""
    old = None
    if os.path.exists(final_dir):
        old = final_dir + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old:
        shutil.rmtree(old)
