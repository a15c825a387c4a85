"""Float32 sums over data ranks that share one host, through a shared mapping instead of gloo.

Gloo moves every byte of a CPU job's all-reduce through loopback TCP: 1.2 ms for a 17-float sum
and 3.1 ms for the embedded dense model's 4.2 MB of gradients on a 2-core host, the main part of
what kept 2-process data parallelism at 0.76 of twice one process (docs/distributed.md "Weak
scaling"). Here each rank writes its values into its own slot of a file mapped by every rank (in
/dev/shm); kernels/host_sum.c sums a chunk per rank in rank order and writes it back into every
slot, with two flag waits per sum. Every rank gets the same bits; with two ranks they are also
gloo's (a + b == b + a), with more the order of the additions differs from gloo's ring.

Used when every rank of the group opens the file rank 0 created (the same host and /dev/shm) and
built the kernel; decided together at the first sum, so the ranks never disagree on the transport.
`ERNIEKIT_HOST_SUM=0` keeps gloo.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
import tempfile

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.errors import ErniekitError
from erniekit.nn import native

_LINE = 64  # bytes per flag: one cache line each
_TOKEN = 16  # random bytes rank 0 writes, so a rank that opens a same-named file elsewhere says no
_PATH = 256  # bytes of the broadcast path
_MIN_CAP = 1 << 16  # floats: the router losses' small sums and the first gradients fit without regrowing
# as NCCL's default: a rank that waits longer gives up with an error (a rank-0-only phase that runs
# longer, e.g. a huge export, needs ERNIEKIT_HOST_SUM_TIMEOUT)
TIMEOUT_S = float(os.environ.get("ERNIEKIT_HOST_SUM_TIMEOUT", "1800"))


class HostSumTimeout(ErniekitError):
    pass


class HostSumMismatch(ErniekitError):
    pass


def _kernel():
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn = native.function("host_sum", "erniekit_host_sum", [*args, ctypes.c_int64, ctypes.c_double])
    if fn is not None:
        fn.restype = ctypes.c_int64
    return fn


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class HostSum:
    """Sums over `size` ranks (this one `rank`) of `group` (None: the whole job), in place in
    `buffer(n)`. Collective: every rank calls `buffer` and `sum` with the same n, in the same order."""

    def __init__(self, size: int, rank: int, group=None, timeout_s: float = TIMEOUT_S):
        self.size, self.rank, self.group, self.timeout_s = size, rank, group, timeout_s
        self.cap = 0  # floats per slot of the current mapping
        self.why_not: str | None = None  # set once the ranks have agreed not to use it
        self._map: mmap.mmap | None = None
        self._header: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        self._seq = 0
        self._fn = None

    @property
    def header_bytes(self) -> int:
        return -(-(2 * self.size * _LINE + _TOKEN) // 4096) * 4096

    def buffer(self, n: int) -> np.ndarray | None:
        """This rank's slot (n float32 to fill before `sum`), or None when the ranks use gloo
        (`why_not` says why). Growing the mapping is collective; every rank asks for the same n."""
        if self.why_not is not None:
            return None
        if self._slots is None or n > self.cap:
            had = self.cap
            self._open(-(-max(n, _MIN_CAP) // 16) * 16)  # whole cache lines: chunks never share one
            if self.why_not is not None:
                if had and self.rank == 0:  # the run's log said shared memory: say it changed
                    print(f"data-parallel sums now go through gloo: {self.why_not}", file=sys.stderr, flush=True)
                return None
        return self._slots[self.rank, :n]

    def sum(self, n: int) -> None:
        """The first n floats of every rank's slot summed over the ranks, into every slot."""
        self._seq += 1
        err = self._fn(
            self._header.ctypes.data,
            self._slots.ctypes.data,
            self.rank,
            self.size,
            self.cap,
            n,
            self._seq,
            self.timeout_s,
        )
        if err == 2:
            raise HostSumMismatch(
                f"data rank {self.rank} summed {n} values while another rank summed a different count: "
                "the ranks' models or step values differ; check that every rank runs the same config"
            )
        if err:
            raise HostSumTimeout(
                f"data rank {self.rank} waited {self.timeout_s:.0f} s for the other ranks at a shared-memory "
                "sum: a rank died or stalled; read the other ranks' logs (ERNIEKIT_HOST_SUM=0 uses gloo)"
            )

    def close(self) -> None:
        """Drop the mapping (unmapped once no view of it is left; the file is already unlinked)."""
        self._header = self._slots = self._map = None

    # ---- the collective set-up: rank 0 creates, the others open, all agree ----
    def _open(self, cap: int) -> None:
        self.close()
        nbytes = self.header_bytes + self.size * cap * 4
        why, path, token, fd = self._own_reason(), "", secrets.token_bytes(_TOKEN), -1
        try:
            if self.rank == 0 and why is None:
                path, fd, why = self._create(nbytes, token)
            path, token = self._broadcast(path, token)
            if why is None and not path:
                why = "rank 0 could not create the shared file"
            if why is None and self.rank != 0:
                fd, why = self._attach(path, nbytes, token)
            agreed = self._all_ok(why is None)
            if agreed and fd >= 0:
                self._map = mmap.mmap(fd, nbytes)
                raw = np.frombuffer(self._map, dtype=np.uint8)
                self._header = raw[: self.header_bytes].view(np.int64)
                self._slots = raw[self.header_bytes :].view(np.float32).reshape(self.size, cap)
                self.cap, self._seq = cap, 0
        finally:  # also when a peer is gone and the collectives raise: no file outlives the set-up
            if self.rank == 0 and path:
                os.unlink(path)  # every rank has it open (or gave up)
            if fd >= 0:
                os.close(fd)
        if not agreed:
            self.why_not = why or "another rank could not use it (not on this host, or no kernel)"

    def _own_reason(self) -> str | None:
        if os.environ.get("ERNIEKIT_HOST_SUM", "1") == "0":
            return "ERNIEKIT_HOST_SUM=0"
        self._fn = self._fn or _kernel()
        return None if self._fn is not None else f"kernel not built: {native.why_not.get('host_sum', '')}"

    def _create(self, nbytes: int, token: bytes) -> tuple[str, int, str | None]:
        """(path, fd, None), or ("", -1, why): a failure here is a reason to use gloo, not an error."""
        where = _shm_dir()
        try:
            fd, path = tempfile.mkstemp(prefix="erniekit-sum-", dir=where)
        except OSError as e:
            return "", -1, f"{where}: {e.strerror}"
        try:
            if hasattr(os, "posix_fallocate"):  # fails now, not with SIGBUS later, when /dev/shm is small
                os.posix_fallocate(fd, 0, nbytes)
            else:  # no such call (macOS): a plain file of that size in the temporary directory
                os.ftruncate(fd, nbytes)
            os.pwrite(fd, token, 2 * self.size * _LINE)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            return "", -1, f"{nbytes / 2**20:.0f} MiB in {where}: {e.strerror}"
        return path, fd, None

    def _attach(self, path: str, nbytes: int, token: bytes) -> tuple[int, str | None]:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            return -1, f"{path}: {e.strerror} (ranks on different hosts?)"
        if os.fstat(fd).st_size != nbytes or os.pread(fd, _TOKEN, 2 * self.size * _LINE) != token:
            os.close(fd)
            return -1, f"{path} is another host's file"
        return fd, None

    def _src(self) -> int:
        return 0 if self.group is None else self.group.ranks[0]

    def _broadcast(self, path: str, token: bytes) -> tuple[str, bytes]:
        raw = path.encode()[:_PATH].ljust(_PATH, b"\0") + token
        t = paddle.to_tensor(np.frombuffer(raw, dtype=np.uint8).astype(np.int32))
        dist.broadcast(t, src=self._src(), group=self.group)
        got = bytes(t.numpy().astype(np.uint8))
        return got[:_PATH].rstrip(b"\0").decode(), got[_PATH:]

    def _all_ok(self, ok: bool) -> bool:
        flag = paddle.to_tensor([1 if ok else 0], dtype="int32")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.numpy()[0])
