"""The shared-memory sum over the ranks of one host (erniekit/distributed/collective/host_sum.py and
kernels/host_sum.c), with threads standing in for ranks: the kernel releases the GIL, and the
set-up's two gloo collectives are replaced by a barrier."""

import os
import threading

import numpy as np
import pytest
from launched_jobs import concurrently

from erniekit.distributed.collective import host_sum as H

pytestmark = pytest.mark.skipif(H._kernel() is None, reason="no C compiler to build kernels/host_sum.c")


class _Job:
    """What gloo does for the set-up: rank 0's broadcast and an all-reduce MIN, over threads."""

    def __init__(self, size):
        self.barrier, self.box, self.oks = threading.Barrier(size, timeout=30), {}, []

    def patch(self, hs: H.HostSum, fail_attach: bool = False):
        def broadcast(path, token):
            if hs.rank == 0:
                self.box["b"] = (path, token)
            self.barrier.wait()
            got = self.box["b"]
            self.barrier.wait()
            return got

        def all_ok(ok):
            self.oks.append(ok)
            self.barrier.wait()
            agreed = all(self.oks)
            self.barrier.wait()
            return agreed

        hs._broadcast, hs._all_ok = broadcast, all_ok
        if fail_attach:
            hs._attach = lambda path, nbytes, token: (-1, "not on this host")
        return hs


def _run(size, work, fail_attach_rank=None):
    """work(HostSum of rank r) in one thread per rank; their results in rank order (an error is
    raised). A kernel wait gives up after 60 s, so a failing rank cannot hang the others."""
    job = _Job(size)
    return concurrently(
        *(
            lambda r=r: work(job.patch(H.HostSum(size, r, timeout_s=60), fail_attach=r == fail_attach_rank))
            for r in range(size)
        )
    )


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit_call_after_call(size):
    rng = np.random.default_rng(0)
    n = 70_001  # not a multiple of the 16-float lines: the last chunk is short
    calls = [
        [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype("float32") for _ in range(size)]
        for _ in range(3)
    ]
    want = []
    for values in calls:
        acc = values[0].copy()
        for v in values[1:]:
            acc = acc + v  # float32, in rank order
        want.append(acc)

    def work(hs):
        got = []
        for values in calls:
            buf = hs.buffer(n)
            buf[:] = values[hs.rank]
            hs.sum(n)
            got.append(hs.buffer(n).copy())
        return got, hs.why_not

    for got, why_not in _run(size, work):
        assert why_not is None
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_growing_the_buffer_sets_up_a_new_mapping_and_leaves_no_file():
    before = set(os.listdir(H._shm_dir()))

    def work(hs):
        sums = []
        for n in (5, H._MIN_CAP + 3):  # the second outgrows the first mapping
            buf = hs.buffer(n)
            buf[:] = np.arange(n, dtype="float32") + hs.rank
            hs.sum(n)
            sums.append(hs.buffer(n)[-2:].tolist())
        return sums, hs.cap

    out = _run(2, work)
    n = H._MIN_CAP + 3
    for sums, cap in out:
        assert sums == [[7.0, 9.0], [2.0 * (n - 2) + 1, 2.0 * (n - 1) + 1]]
        assert cap == H._MIN_CAP + 16  # the count asked for, in whole cache lines
    assert {f for f in os.listdir(H._shm_dir()) if f.startswith("erniekit-sum-")} <= before


def test_a_rank_that_cannot_open_the_file_makes_every_rank_use_gloo():
    res = _run(2, lambda hs: (hs.buffer(10), hs.why_not), fail_attach_rank=1)
    assert res[0][0] is None and res[1][0] is None  # both fall back, neither alone
    assert res[1][1] == "not on this host" and res[0][1].startswith("another rank could not use it")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ERNIEKIT_HOST_SUM", "0")
    out = _run(2, lambda hs: (hs.buffer(4), hs.why_not))
    assert out == [(None, "ERNIEKIT_HOST_SUM=0"), (None, "ERNIEKIT_HOST_SUM=0")]


def test_a_missing_rank_times_out_with_a_one_line_error():
    def work(hs):
        buf = hs.buffer(8)
        buf[:] = 1.0
        if hs.rank == 1:
            return "absent"  # never sums
        hs.timeout_s = 0.2
        with pytest.raises(H.HostSumTimeout, match="data rank 0 waited 0 s for the other ranks"):
            hs.sum(8)
        return "timed out"

    assert _run(2, work) == ["timed out", "absent"]


def test_ranks_that_sum_different_counts_get_an_error_not_garbage():
    def work(hs):
        n = 32 if hs.rank == 0 else 48
        hs.buffer(64)[:] = 1.0
        with pytest.raises(H.HostSumMismatch, match=f"data rank {hs.rank} summed {n} values"):
            hs.sum(n)
        return "refused"

    assert _run(2, work) == ["refused", "refused"]


def test_a_set_up_that_fails_midway_leaves_no_file(monkeypatch):
    made = []
    create = H.HostSum._create

    def spy(self, nbytes, token):
        out = create(self, nbytes, token)
        made.append(out[0])
        return out

    def gone(self, path, token):
        raise RuntimeError("the other rank is gone")

    monkeypatch.setattr(H.HostSum, "_create", spy)
    monkeypatch.setattr(H.HostSum, "_broadcast", gone)
    with pytest.raises(RuntimeError, match="gone"):
        H.HostSum(2, 0).buffer(4)
    assert made and made[0] and not os.path.exists(made[0])


def test_a_full_dev_shm_is_a_reason_to_use_gloo_said_at_set_up(monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(H.os, "posix_fallocate", full, raising=False)
    out = _run(2, lambda hs: (hs.buffer(4), hs.why_not))
    assert out[0][0] is None and out[1][0] is None
    assert out[0][1].endswith(f"MiB in {H._shm_dir()}: {os.strerror(errno.ENOSPC)}")
    assert out[1][1] == "rank 0 could not create the shared file"
