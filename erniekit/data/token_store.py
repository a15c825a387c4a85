"""A tokenized pretraining corpus on disk (`tokenized_path`), memory-mapped by every later run.

The first run tokenizes the corpus once into a directory holding

  tokens.bin       int32 little-endian: every document's ids (its eos included), back to back
  doc_offsets.bin  int64 little-endian [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
  store.json       format version, the fingerprint it was built from, the counts

and later runs, resumes and the other processes of a job map those files (np.memmap: pages come from
the page cache, shared by every process of the machine, and are never copied into the heap). The
fingerprint names the source files by path, size and modification time and hashes the tokenizer (its
sentencepiece model and special / added tokens): a store built from anything else is rebuilt, with a
one-line note, never silently reused. Rows are packed at load (max_seq_len is not part of the store).

A build writes a temporary directory beside the store and renames it into place (utils.io.replace_dir),
so a store is whole or absent. Processes that start together agree through a lock file beside it,
created with O_EXCL: one builds, the others wait for the lock to go. The lock holds the builder's host
and pid and its modification time is touched every HEARTBEAT_S while it builds; a lock whose pid is
gone (same host) or whose time has not moved for STALE_S is stale and taken over, so a killed build
never blocks a later run. A wait longer than WAIT_S is a one-line error naming the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import stat
import threading
import time
import uuid
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from erniekit.data.dataset_info import load_entry, parse_ref
from erniekit.data.encode import PRETRAIN_PIECE_CHARS
from erniekit.data.formats import split_paths
from erniekit.errors import DataError, ErniekitError
from erniekit.utils import run_control  # read at call time: a test may replace stop_signal
from erniekit.utils.io import atomic_write_json, replace_dir, write_errors

if TYPE_CHECKING:  # importing the model package would pull in paddle
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

FORMAT = 1  # bump when the files or what goes into them change: older stores are then rebuilt
STORE_JSON, TOKENS, OFFSETS = "store.json", "tokens.bin", "doc_offsets.bin"
TOKEN_DTYPE, OFFSET_DTYPE = np.dtype("<i4"), np.dtype("<i8")
WAIT_S = 6 * 3600.0  # how long a process waits for another's build before giving up
STALE_S = 300.0  # a lock whose time has not moved for this long (as the waiter sees it) is stale
HEARTBEAT_S = 10.0  # how often the builder touches its lock
POLL_S = 0.2
_HELD: set[str] = set()  # tokens of the locks this process holds (its threads may build side by side)


@dataclass
class TokenStore:
    """A built store, memory-mapped: `tokens` int32 and `doc_offsets` int64, read-only."""

    directory: str
    tokens: np.ndarray
    doc_offsets: np.ndarray


# ---- fingerprint -----------------------------------------------------------------------------------
def corpus_fingerprint(path: str, tokenizer: ErnieTokenizer) -> dict:
    """What a store of the corpus at `path` (comma-separated, dataset_info.json entries allowed) must
    have been built from: format, source files (path, size, mtime), tokenizer, piece size."""
    return {
        "format": FORMAT,
        "sources": source_files(path),
        "tokenizer": tokenizer_digest(tokenizer),
        "piece_chars": PRETRAIN_PIECE_CHARS,
    }


def source_files(path: str) -> list[list]:
    """[absolute path, size, mtime_ns] of every file the corpus reads, in reading order; a
    dataset_info.json entry adds the json (its columns choose what is read) and the entry's name."""
    out = []
    for p in split_paths(path):
        ref = parse_ref(p)
        files = [p] if ref is None else [ref[0], *load_entry(*ref).files]
        if ref is not None:
            out.append(["dataset", ref[1]])
        for f in files:
            st = os.stat(f)
            if not stat.S_ISREG(st.st_mode):  # a pipe's size and name say nothing of what it carries
                raise DataError(
                    f"tokenized_path: {f} is not a regular file (a pipe or device); its tokens cannot be "
                    "matched to a later run: write the stream to a file, or drop tokenized_path"
                )
            out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


def tokenizer_digest(tokenizer: ErnieTokenizer) -> str:
    """sha256 of what decides the ids of a text: the sentencepiece model and the special and added
    tokens (a chat_template: ernie_thinking run adds its tags as tokens: another digest)."""
    h = hashlib.sha256(tokenizer.sp.serialized_model_proto())
    tables = {
        "special": tokenizer.special_tokens,
        "additional": tokenizer.additional_special_tokens,
        "added": tokenizer.added_tokens,
        "eos": tokenizer.eos_token_id,
    }
    h.update(json.dumps(tables, sort_keys=True).encode())
    return h.hexdigest()


# ---- open ------------------------------------------------------------------------------------------
def _read_store(directory: str, want: dict) -> tuple[TokenStore | None, str]:
    """(the store, "") when `directory` holds one built from `want`; else (None, why not)."""
    if not os.path.isfile(os.path.join(directory, STORE_JSON)):
        if not os.path.exists(directory):  # (or moved aside this moment by a rebuild: replace_dir)
            return None, "missing"
        raise DataError(
            f"tokenized_path: {directory} exists but is not a token store (no {STORE_JSON}); "
            "move it away or set tokenized_path to another directory"
        )
    try:
        with open(os.path.join(directory, STORE_JSON), encoding="utf-8") as f:
            meta = json.load(f)
        have = dict(meta["fingerprint"])
        sizes = (int(meta["num_tokens"]) * TOKEN_DTYPE.itemsize, (int(meta["num_docs"]) + 1) * OFFSET_DTYPE.itemsize)
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"its {STORE_JSON} is unreadable"
    diff = [k for k in sorted(set(want) | set(have)) if have.get(k) != want.get(k)]
    if diff:
        return None, f"built from other {', '.join(diff)}"
    files = (os.path.join(directory, TOKENS), os.path.join(directory, OFFSETS))
    if [os.path.getsize(f) if os.path.isfile(f) else -1 for f in files] != list(sizes):
        return None, f"its {TOKENS} or {OFFSETS} is missing or of the wrong size"
    return TokenStore(directory, _map(files[0], TOKEN_DTYPE), _map(files[1], OFFSET_DTYPE)), ""


def _map(path: str, dtype: np.dtype) -> np.ndarray:
    if os.path.getsize(path) == 0:  # mmap refuses an empty file
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# ---- build -----------------------------------------------------------------------------------------
def build_store(
    directory: str, want: dict, docs: Iterable[np.ndarray], publish_if: Callable[[], bool] = lambda: True
) -> bool:
    """Write the documents' ids into a new store at `directory`, atomically (a temporary directory
    beside it, renamed into place); whether it was published: not when `publish_if()` says no at the
    end (the lock was taken over meanwhile: that process's store stands). Memory holds one document
    and a block of offsets, not the corpus."""
    parent = os.path.dirname(os.path.abspath(directory))
    tmp = f"{directory}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with write_errors("the token store", parent, 0, partial=tmp, hint=" (tokenized_path)"):
        os.makedirs(tmp)
        counts = _write_arrays(tmp, docs)
        atomic_write_json(os.path.join(tmp, STORE_JSON), {"format": FORMAT, "fingerprint": want, **counts})
        if not publish_if():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        replace_dir(tmp, directory)
    return True


def _write_arrays(tmp: str, docs: Iterable[np.ndarray], block: int = 1 << 16) -> dict:
    offsets, end, num_docs = array("q", [0]), 0, 0
    with open(os.path.join(tmp, TOKENS), "wb") as tf, open(os.path.join(tmp, OFFSETS), "wb") as of:
        for doc in docs:
            ids = np.asarray(doc, dtype=TOKEN_DTYPE)
            tf.write(ids.tobytes())
            end, num_docs = end + len(ids), num_docs + 1
            offsets.append(end)
            if len(offsets) >= block:
                of.write(np.asarray(offsets, dtype=OFFSET_DTYPE).tobytes())
                offsets = array("q")
        of.write(np.asarray(offsets, dtype=OFFSET_DTYPE).tobytes())
    return {"num_docs": num_docs, "num_tokens": end}


# ---- one builder among many ------------------------------------------------------------------------
def open_or_build(directory: str, want: dict, docs: Callable[[], Iterable[np.ndarray]]) -> TokenStore:
    """The store at `directory` built from `want`: opened if it is there, else built from `docs()` by
    this process or, when another holds the lock, waited for. A store built from something else is
    rebuilt with a one-line note."""
    lock, deadline = f"{directory}.lock", time.monotonic() + WAIT_S
    while True:
        store, why = _read_store(directory, want)
        if store is not None:
            return store
        token = _try_lock(lock)
        if token is None:
            _wait_for_lock(lock, directory, deadline)
            continue
        try:
            store, why = _read_store(directory, want)  # built by the lock's last holder meanwhile
            if store is not None:
                return store
            if why != "missing":
                warnings.warn(f"tokenized_path: rebuilding {directory} ({why})", stacklevel=2)
            _remove_leftovers(directory)
            with _heartbeat(lock):
                ours = build_store(directory, want, docs(), lambda t=token: _lock_owner(lock).get("token") == t)
            if not ours:  # judged stale and taken over while it built: the new holder's store stands
                deadline = time.monotonic() + WAIT_S  # a full wait for it, not what this build left
                continue
            store, why = _read_store(directory, want)
            if store is None:
                raise DataError(
                    f"tokenized_path: {directory} does not read back after its build ({why}); check the disk, "
                    "remove the directory and run again"
                )
            return store
        finally:
            _unlock(lock, token)


def _try_lock(lock: str) -> str | None:
    """Create the lock (O_EXCL: one process wins) holding host, pid and a token; the token, or None
    when another process holds it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    except OSError as e:
        raise DataError(
            f"tokenized_path: cannot create the lock {lock} ({e.strerror}); make its directory writable "
            "or set tokenized_path to a writable directory"
        ) from None
    token = uuid.uuid4().hex
    with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": token}, f)
    _HELD.add(token)
    return token


def _unlock(lock: str, token: str) -> None:
    """Remove the lock if it is still ours (a waiter that judged it stale may have taken it over)."""
    _HELD.discard(token)
    if _lock_owner(lock).get("token") == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def _lock_owner(lock: str) -> dict:
    """The lock's JSON ({} when gone, or still being written by its creator)."""
    try:
        with open(lock, encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _owner_gone(owner: dict) -> bool:
    """Whether the lock's process is known dead: same host, and no process with its pid (or this very
    process, which holds no lock of that token)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return owner.get("token") not in _HELD
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _wait_for_lock(lock: str, directory: str, deadline: float) -> None:
    """Return once the lock is gone (released, or stale and removed here); a DataError naming it
    after WAIT_S."""
    seen, since = None, time.monotonic()
    while True:
        try:
            state = os.stat(lock).st_mtime_ns
        except FileNotFoundError:
            return
        owner = _lock_owner(lock)
        now = time.monotonic()
        if (state, owner) != seen:
            seen, since = (state, owner), now
        if _owner_gone(owner) or now - since > STALE_S:
            _break_lock(lock, owner)
            return
        if run_control.stop_signal():  # a stop request (SIGTERM) ends the wait; the builder stops on its own
            raise ErniekitError(f"tokenized_path: stopped while waiting for {directory} (locked by {lock})")
        if now > deadline:
            raise DataError(
                f"tokenized_path: waited {WAIT_S:.0f} s for {directory}, still locked by {lock} "
                f"(host {owner.get('host', '?')}, pid {owner.get('pid', '?')}); check that process, "
                "or delete the lock if nothing is building"
            )
        time.sleep(POLL_S)


def _break_lock(lock: str, owner: dict) -> None:
    """Remove a stale lock: moved aside first (one waiter wins the rename); a lock that turns out to
    be another, live one (taken between our look and the rename) is put back."""
    aside = f"{lock}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    taken = _lock_owner(aside) != owner
    if taken:
        with contextlib.suppress(FileExistsError):
            os.link(aside, lock)
    os.unlink(aside)
    if not taken:
        warnings.warn(
            f"tokenized_path: removed the stale lock {lock} (host {owner.get('host', '?')}, pid "
            f"{owner.get('pid', '?')}: gone, or silent for {STALE_S:.0f} s)",
            stacklevel=3,
        )


@contextlib.contextmanager
def _heartbeat(lock: str) -> Iterator[None]:
    """Touch the lock every HEARTBEAT_S while the block runs, so that waiters see a live build."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=beat, name="token-store-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _remove_leftovers(directory: str) -> None:
    """Temporary directories of builds that died: one whose process is gone (same host) or that has
    not changed for STALE_S. A live build's (a holder whose lock was wrongly judged stale) is left
    alone; that holder sees the lock is no longer its own and does not publish (build_store)."""
    parent, base = os.path.split(os.path.abspath(directory))
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name == f"{base}.old":
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f"{base}.tmp-") and _leftover_dead(name[len(base) + 5 :], path):
            shutil.rmtree(path, ignore_errors=True)


def _leftover_dead(tail: str, path: str) -> bool:
    """Whether the build that writes `path` (named ...tmp-HOST-PID-HEX) is over: its process is gone
    (same host), or none of its files has changed for STALE_S."""
    parts = tail.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and _owner_gone({"host": parts[0], "pid": int(parts[1])}):
        return True
    try:
        newest = max([os.stat(path).st_mtime] + [e.stat().st_mtime for e in os.scandir(path)])
    except FileNotFoundError:
        return False
    return time.time() - newest > STALE_S
