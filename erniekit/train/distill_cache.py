"""The teacher's top-k log-probabilities on the training data, on disk (`teacher_topk_cache`).

A big teacher need not stay in memory or run every step: its k most likely next tokens and their
log-probabilities (temperature-softened, erniekit/train/distill_losses.py `top_k`) at every
trained position of every training row are computed once and read back, row by row, for each
batch. The directory holds

  manifest.json   what the cache was built from (`fingerprint`) and its shape
  offsets.npy     [rows + 1] int64: row r's positions are entries offsets[r]:offsets[r + 1]
  ids.npy         [positions, k] int32 token ids
  logp.npy        [positions, k] float32 log-probabilities

A cache built from another teacher, other data rows, another k or temperature is refused, never
silently reused: the fingerprint names the teacher's files by size and modification time (a
retrained teacher in the same directory counts as another) and hashes the rows' tokens.
Rank 0 of a launched job builds it, the teacher in memory for the build only, outside the job's
batch placement (plain tensors, no collective), and every other rank waits for the finished
directory (`wait_for_cache`); the directory must be one every process of the job sees.
Disk: positions x k x 8 bytes (the tiny default: 20000 rows x ~4 positions x 64 -> ~40 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence

import numpy as np

from erniekit.errors import ConfigError
from erniekit.train.distill_losses import TopK
from erniekit.train.losses import shifted_valid

FORMAT = 1
MANIFEST = "manifest.json"
WAIT_S = 6 * 3600.0  # how long the other ranks wait for rank 0's build of a cache


def teacher_files(path: str) -> list[list]:
    """[name, size, mtime_ns] of every file in the teacher's directory (sorted)."""
    out = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            st = os.stat(full)
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def rows_digest(rows: Sequence[dict[str, np.ndarray]]) -> str:
    """sha256 over the rows' input_ids and labels, in order."""
    h = hashlib.sha256()
    for r in rows:
        for key in ("input_ids", "labels"):
            a = np.ascontiguousarray(r[key], dtype=np.int64)
            h.update(len(a).to_bytes(8, "little"))
            h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(teacher_path: str, rows: Sequence[dict[str, np.ndarray]], k: int, temperature: float) -> dict:
    return {
        "format": FORMAT,
        "teacher_files": hashlib.sha256(json.dumps(teacher_files(teacher_path)).encode()).hexdigest(),
        "rows": rows_digest(rows),
        "num_rows": len(rows),
        "k": int(k),
        "temperature": float(temperature),
    }


def row_positions(labels: np.ndarray) -> int:
    """Trained positions of one unpadded row (as `distill_losses.trained_positions` counts them)."""
    return int(shifted_valid(np.asarray(labels)[None, :]).sum())


class TopKCache:
    """A built cache, memory-mapped: `batch(row_index)` is the TopK of those rows, in order."""

    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, MANIFEST)) as f:
            self.manifest = json.load(f)
        self.offsets = np.load(os.path.join(directory, "offsets.npy"))
        self.ids = np.load(os.path.join(directory, "ids.npy"), mmap_mode="r")
        self.logp = np.load(os.path.join(directory, "logp.npy"), mmap_mode="r")

    def batch(self, row_index: np.ndarray) -> TopK:
        parts = [slice(int(self.offsets[r]), int(self.offsets[r + 1])) for r in np.asarray(row_index).tolist()]
        return TopK(
            np.concatenate([self.ids[s] for s in parts]).astype(np.int64),
            np.concatenate([self.logp[s] for s in parts]).astype(np.float32),
        )


def _stale(directory: str, want: dict) -> str | None:
    """Which fingerprint fields differ from the cache in `directory` (None: it matches)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            have = json.load(f).get("fingerprint", {})
    except (OSError, ValueError):
        return "its manifest.json is missing or unreadable"
    diff = [key for key in want if have.get(key) != want[key]]
    return None if not diff else "built for another " + ", ".join(diff)


def open_cache(directory: str, want: dict) -> TopKCache | None:
    """The cache in `directory` if it exists and matches `want`; None if there is none; a
    ConfigError if it was built from something else."""
    if not os.path.exists(directory):
        return None
    why = _stale(directory, want)
    if why:
        raise ConfigError(
            f"teacher_topk_cache: {directory} is stale ({why}: teacher files, data rows, k or temperature); "
            "delete it to rebuild, or point teacher_topk_cache at a new directory"
        )
    return TopKCache(directory)


def wait_for_cache(directory: str, want: dict, timeout_s: float = WAIT_S, poll_s: float = 0.2) -> TopKCache:
    """The cache another process of the job is building (rank 0), once it is in place: the build
    renames a finished directory into `directory`, so its appearance means complete. No collective:
    the processes that wait may be any subset of the job (parameter-server workers without the
    servers), and a long build meets no collective's timeout."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(directory):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"teacher_topk_cache: {directory} did not appear within {timeout_s:.0f} s of waiting for rank 0 "
                "to build it; check rank 0's log (launch_logs/ in output_dir), or build the cache first with a "
                "1-process run of this config (max_steps=1)"
            )
        time.sleep(poll_s)
    cache = open_cache(directory, want)
    assert cache is not None  # it exists
    return cache


def build_cache(
    directory: str,
    want: dict,
    rows: Sequence[dict[str, np.ndarray]],
    batch_topk: Callable[[list[dict[str, np.ndarray]]], TopK],
    batch_size: int,
) -> TopKCache:
    """Compute the teacher's top-k over `rows` (batch_topk: rows -> TopK at their trained positions,
    in order) and write the cache atomically (a temporary directory renamed into place)."""
    counts = np.array([row_positions(r["labels"]) for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    k = want["k"]
    tmp = directory.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ids = np.lib.format.open_memmap(os.path.join(tmp, "ids.npy"), "w+", np.int32, (int(offsets[-1]), k))
    logp = np.lib.format.open_memmap(os.path.join(tmp, "logp.npy"), "w+", np.float32, (int(offsets[-1]), k))
    for i in range(0, len(rows), batch_size):
        top = batch_topk(list(rows[i : i + batch_size]))
        a, b = int(offsets[i]), int(offsets[min(i + batch_size, len(rows))])
        if top.ids.shape != (b - a, k):
            raise ValueError(f"teacher top-k of rows {i}..: shape {top.ids.shape}, expected {(b - a, k)}")
        ids[a:b], logp[a:b] = top.ids, top.logp
    ids.flush()
    logp.flush()
    del ids, logp
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"fingerprint": want, "positions": int(offsets[-1])}, f, indent=1)
    try:
        os.replace(tmp, directory)
    except OSError:  # another job built the same cache meanwhile (clusters of one machine): keep theirs
        if not os.path.isdir(directory):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        cache = open_cache(directory, want)  # a ConfigError if theirs was built from something else
        assert cache is not None
        return cache
    return TopKCache(directory)
