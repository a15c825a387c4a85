"""Atomic file writes: a crash never leaves a half-written config, checkpoint or log index.

The pattern everywhere: write beside the target (a temp file or directory in the same parent, so
the rename stays on one filesystem), fsync the data, rename into place, fsync the parent so the
rename itself survives a power cut. Old data is removed only after the new is in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterator

from erniekit.errors import CheckpointError

# errno values that mean "the disk (or quota) is full", for the one-line message that says so
NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def fsync_file(path: str) -> None:
    """Flush one file's data to disk (a rename of an unflushed file can survive a crash empty)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (so renames and new names in it are on disk)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some filesystems cannot fsync a directory; nothing to flush there
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under root (a finished checkpoint before it is published)."""
    for d, _, files in os.walk(root):
        for f in files:
            fsync_file(os.path.join(d, f))
        fsync_dir(d)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask would, for a moment,
    for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)`, fsync, then rename over `path` (same directory, so the rename is atomic).
    The file gets the mode an ordinary open() would give it (mkstemp's 0600 would hide a deployed
    model from a server running as another user)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(d)
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


def json_problem(e: Exception) -> str:
    """Why JSON text did not load, in a few words: a decode error, nesting Python's decoder cannot
    hold (RecursionError), or an integer past its digit limit (ValueError)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    if isinstance(e, RecursionError):
        return "arrays or objects nested too deeply to read"
    return str(e).split(";")[0]


def read_json_object(path: str, hint: str = "fix or regenerate the file") -> dict:
    """A JSON object from `path`; malformed JSON or a non-object is a one-line CheckpointError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); {hint}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}); {hint}") from None
    except (ValueError, RecursionError) as e:  # a huge integer, or nesting the decoder cannot hold
        raise CheckpointError(f"{path}: invalid JSON ({json_problem(e)}); {hint}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at top level; {hint}")
    return data


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


@contextlib.contextmanager
def strided_views() -> Iterator[None]:
    """Paddle's stride kernels on for the block: safetensors' paddle backend reinterprets buffers
    with `Tensor.view(dtype)`, which only has a strided kernel, and erniekit turns them off for
    speed (erniekit/utils/paddle_import.py: contiguous_cpu_kernels)."""
    import paddle

    if paddle.get_flags("FLAGS_use_stride_kernel")["FLAGS_use_stride_kernel"]:
        yield
        return
    paddle.set_flags({"FLAGS_use_stride_kernel": True})
    try:
        yield
    finally:
        paddle.set_flags({"FLAGS_use_stride_kernel": False})


class _PaddleSafetensors:
    """A safe_open handle whose tensors are read with stride kernels on and returned contiguous."""

    def __init__(self, handle):
        self._h = handle

    def get_tensor(self, name: str):
        with strided_views():
            return self._h.get_tensor(name).contiguous()

    def __getattr__(self, name: str):
        return getattr(self._h, name)

    def __enter__(self):
        self._h.__enter__()
        return self

    def __exit__(self, *exc):
        return self._h.__exit__(*exc)


def load_safetensors(file: str) -> dict:
    """safetensors.paddle.load_file (dtype views need the stride kernels)."""
    from safetensors.paddle import load_file

    with strided_views():
        return {k: v.contiguous() for k, v in load_file(file).items()}


def open_safetensors(file: str, framework: str = "paddle"):
    """safe_open, with a missing, truncated, empty or non-safetensors file as one CheckpointError
    (not the Rust library's exception and a traceback). Usable as a context manager, as safe_open."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(file, framework=framework)
        return _PaddleSafetensors(handle) if framework == "paddle" else handle
    except (SafetensorError, OSError) as e:
        size = os.path.getsize(file) if os.path.isfile(file) else 0
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({e}; {size} bytes); it is truncated or "
            "corrupt: copy or re-save it (training checkpoints: resume from an earlier one)"
        ) from None


def replace_dir(tmp_dir: str, final_dir: str) -> None:
    """Publish a fully written directory under its final name: fsync it, then rename (or, when the
    final name exists, swap it in atomically and delete the old one afterwards). The old directory
    is never deleted before the new one holds its name; only where the kernel cannot swap is there a
    moment with the old one at `final_dir.old` and the new one at `tmp_dir`."""
    fsync_tree(tmp_dir)
    parent = os.path.dirname(os.path.abspath(final_dir))
    if not os.path.exists(final_dir):
        os.rename(tmp_dir, final_dir)
    elif _exchange(tmp_dir, final_dir):
        shutil.rmtree(tmp_dir)  # now the old one
    else:
        old = final_dir + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old)
    fsync_dir(parent)


def free_bytes(path: str) -> int:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


class WriteFailed(CheckpointError):
    """A write that failed for lack of space or permission; an enclosing write_errors rewords it."""

    def __init__(self, message: str, errno_: int | None, strerror: str, filename: str | None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno_, strerror, filename


@contextlib.contextmanager
def write_errors(what: str, where: str, needed: int, partial: str | None = None, hint: str = "") -> Iterator[None]:
    """Turn an OSError while writing `what` into one CheckpointError saying how much was about to be
    written (`needed` bytes), where, and how much is free; `partial` (a temp file or directory) is
    removed on any failure, so nothing half-written is left for a later load or resume to find. A
    shortfall already visible (needed > free) is refused before anything is written."""
    if needed > free_bytes(where):
        raise WriteFailed(
            _space_message(what, where, needed, "not enough space", hint), errno.ENOSPC, "not enough space", where
        )
    try:
        yield
    except BaseException as e:
        if partial and os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
        elif partial and os.path.lexists(partial):
            os.remove(partial)
        code, strerror, filename = _os_error(e)
        if code is None:
            raise
        if code in NO_SPACE:
            raise WriteFailed(_space_message(what, where, needed, strerror, hint), code, strerror, filename) from None
        raise WriteFailed(
            f"cannot write {what} in {where} ({strerror}: {filename or where}); make {where} writable "
            f"or choose another directory{hint}",
            code,
            strerror,
            filename,
        ) from None


def _os_error(e: BaseException) -> tuple[int | None, str, str | None]:
    """(errno, text, file) of an OS-level write failure, else (None, ...). safetensors reports the
    kernel's error inside its own exception ("I/O error: No space left on device (os error 28)")."""
    if isinstance(e, (OSError, WriteFailed)):
        return e.errno, e.strerror, e.filename
    if type(e).__name__ == "SafetensorError":
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m:
            return int(m[1]), os.strerror(int(m[1])), None
    return None, "", None


def _space_message(what: str, where: str, needed: int, why: str, hint: str) -> str:
    return (
        f"{why} for {what} in {where}: about {needed / 2**20:.1f} MiB ({needed} bytes) to write, "
        f"{free_bytes(where) / 2**20:.1f} MiB free; free space or write to a larger disk{hint}"
    )
