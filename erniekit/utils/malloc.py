"""glibc malloc settings that make Paddle's CPU kernels several times faster."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

from erniekit.errors import ErniekitError

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP = 1 << 30  # 1 GiB: bigger blocks than any activation of the models we train on CPU
MMAP_ENV = "ERNIEKIT_MALLOC_MMAP_MB"


def mmap_threshold(env=os.environ) -> int:
    """Bytes from which a block is mapped on its own and returned to the OS when freed
    ($ERNIEKIT_MALLOC_MMAP_MB, default 1 GiB: everything is kept).

    Why a knob: the kept heap fragments. A training step allocates and frees its few largest
    buffers (the head's logits chunk and dW, the embedding's dense gradient) between smaller ones,
    which split the freed holes, so the heap grows past the peak of live memory. 64 gave back
    48 MiB for 5% more step time on dense-1024 and 368 MiB for 27% more on ERNIE-4.5-0.3B's shapes
    (each such block then pays its page faults every step): docs/performance.md, thirteenth round."""
    raw = env.get(MMAP_ENV, "").strip()
    if not raw:
        return _KEEP
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ErniekitError(
            f"{MMAP_ENV}={raw!r}: give a whole number of MiB >= 1 (blocks at least this big go back "
            "to the OS when freed), or unset it"
        )
    return min(mb << 20, _KEEP)


class MallInfo(ctypes.Structure):
    """glibc's struct mallinfo2: uordblks = bytes in use in the arenas, hblkhd = bytes in blocks
    mapped on their own (the rest is what the allocator keeps)."""

    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def _mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # glibc before 2.33, musl, other platforms
        return None
    fn.restype = MallInfo
    return fn


def mallinfo() -> MallInfo | None:
    """The allocator's counters now (glibc's mallinfo2, every arena), or None without it."""
    fn = _mallinfo2()
    return fn() if fn is not None else None


def live_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (tools/bench_heap.py, the memory tests)."""
    m = mallinfo()
    return m.uordblks + m.hblkhd if m is not None else None


def keep_freed_memory() -> bool:
    """Stop glibc from returning each freed tensor buffer to the OS. True if applied.

    Paddle's CPU allocator hands every tensor buffer to malloc. glibc serves blocks above its
    mmap threshold (128 KiB to 32 MiB) with a fresh mmap and unmaps them on free, so every
    op result pays one page fault per 4 KiB: an elementwise op on a [3072, 128] float32 tensor
    took 660 us instead of 35 us (measured, docs/fp8.md). Raising the mmap and trim thresholds
    keeps freed blocks in the heap for reuse. Same effect as MALLOC_MMAP_THRESHOLD_ in the
    environment, but applied at run time. Other platforms and C libraries are left alone.
    """
    mallopt = _linux_libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold())) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))


def _linux_libc(symbol: str):
    """The C library's function `symbol` on Linux; None elsewhere, or where the library lacks it (musl
    has no mallopt or malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), symbol)
    except (OSError, AttributeError):
        return None


def release_freed_heap() -> bool:
    """Give the pages of freed heap blocks back to the OS once (glibc's malloc_trim). True if applied.

    keep_freed_memory keeps every freed block for reuse, so what the start-up freed stays resident
    through the run: the float32 weights a model built in float32 drops when its LoRA base is cast to
    bf16, the parts of the model a rank does not hold once it is placed. Called once before the
    first step; the step's own blocks are then allocated again and kept as before."""
    trim = _linux_libc("malloc_trim")
    if trim is None:
        return False
    trim(0)  # its result says whether pages were released, not whether it ran
    return True
