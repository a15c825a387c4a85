"""Cross-cluster sync maths: payload sizes, compression with error feedback, outer optimizers, OuterSync."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from launched_jobs import concurrently

from erniekit.distributed.cross_cluster.compress import ROW, FlatCompressor, payload_nbytes
from erniekit.distributed.cross_cluster.outer import OuterOptimizer, OuterSync, gradient_sum
from erniekit.errors import ErniekitError


@pytest.mark.parametrize("kind", ["none", "int8", "topk"])
@pytest.mark.parametrize("n,row,ratio", [(1, ROW, 0.01), (1000, 64, 0.1), (4096, 1024, 0.01), (70001, 1024, 0.3)])
def test_payload_nbytes_is_the_encoded_length(kind, n, row, ratio):
    comp = FlatCompressor(kind, n, ratio, row)
    payload = comp.encode(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    assert len(payload) == payload_nbytes(kind, n, ratio, row)


def test_payload_nbytes_formula():
    # 13-byte header; int8: 1 byte per element + a float32 scale per row; topk: k float32 + k uint16 per row.
    assert payload_nbytes("none", 3000, 0.1, 1024) == 13 + 4 * 3000
    assert payload_nbytes("int8", 3000, 0.1, 1024) == 13 + 3000 + 4 * 3
    assert payload_nbytes("topk", 3000, 0.1, 1024) == 13 + 3 * 103 * (4 + 2)
    assert payload_nbytes("topk", 10, 0.5, 1 << 17) == 13 + 1 * (1 << 16) * (4 + 4)  # int32 indices past 65536
    with pytest.raises(ErniekitError, match="use one of"):
        payload_nbytes("fp8", 10, 0.1)


def _naive_int8(x: np.ndarray, row: int) -> np.ndarray:
    out = np.zeros_like(x)
    for s in range(0, x.size, row):
        r = x[s : s + row].astype(np.float32)
        scale = np.float32(np.abs(r).max() / np.float32(127.0))
        out[s : s + row] = np.clip(np.rint(r / scale), -127, 127).astype(np.float32) * scale if scale > 0 else 0
    return out


def _naive_topk(x: np.ndarray, row: int, k: int) -> np.ndarray:
    out = np.zeros_like(x)
    for s in range(0, x.size, row):
        r = x[s : s + row]
        keep = sorted(range(r.size), key=lambda i: -abs(r[i]))[:k]
        out[s + np.array(keep)] = r[keep]
    return out


def test_int8_and_topk_decode_match_naive_per_row_codecs():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)  # 3 full rows of 256 + one of 232
    x[256:512] = 0  # an all-zero row must decode to zeros (scale 0)
    np.testing.assert_allclose(FlatCompressor("int8", 1000, row=256).decode(FlatCompressor("int8", 1000, row=256).encode(x)), _naive_int8(x, 256), rtol=1e-6, atol=1e-7)  # fmt: skip
    c = FlatCompressor("topk", 1000, 0.05, row=256)  # k = 13
    assert c.k == 13
    np.testing.assert_array_equal(c.decode(c.encode(x)), _naive_topk(x, 256, 13))
    n = FlatCompressor("none", 1000)
    np.testing.assert_array_equal(n.decode(n.encode(x)), x)


@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_error_feedback_sum_of_decoded_tracks_sum_of_true_within_final_residual(kind):
    rng = np.random.default_rng(1)
    comp = FlatCompressor(kind, 3000, 0.05, row=512)
    true_sum = np.zeros(3000, np.float64)
    dec_sum = np.zeros(3000, np.float64)
    for _ in range(50):
        d = rng.standard_normal(3000).astype(np.float32)
        dec_sum += comp.decode(comp.encode(d))
        true_sum += d
    assert np.abs(comp.residual).max() > 1e-3  # compression really lost something this round
    # sum(decoded) = sum(true) - final residual; without feedback the gap would be the sum of 50 residuals.
    np.testing.assert_allclose(dec_sum + comp.residual, true_sum, atol=1e-4)
    state = comp.state_dict()
    fresh = FlatCompressor(kind, 3000, 0.05, row=512)
    fresh.load_state_dict(state)
    d = rng.standard_normal(3000).astype(np.float32)
    assert fresh.encode(d) == comp.encode(d)


def test_decode_rejects_a_payload_of_another_layout_or_kind():
    a = FlatCompressor("int8", 100).encode(np.ones(100, np.float32))
    with pytest.raises(ErniekitError, match="expected 217 for int8 of 200"):
        FlatCompressor("int8", 200).decode(a)
    same_length = FlatCompressor("none", 100).encode(np.ones(100, np.float32))  # 13 + 400 = 13 + 396 + 4 bytes
    with pytest.raises(ErniekitError, match="payload is none of n=100.*expects int8 of n=396"):
        FlatCompressor("int8", 396).decode(same_length)
    with pytest.raises(ErniekitError, match="non-finite"):
        FlatCompressor("int8", 2).encode(np.array([1.0, np.nan], np.float32))


class ThreadExchange:
    """A real all_gather of bytes between threads (one thread per cluster), in cluster order."""

    def __init__(self, n: int):
        self.n, self.barrier, self.lock, self.slots = n, threading.Barrier(n), threading.Lock(), {}

    def link(self, cluster: int):
        def all_gather(tag: str, payload: bytes) -> list[bytes]:
            with self.lock:
                self.slots[(tag, cluster)] = bytes(payload)
            self.barrier.wait(timeout=10)
            with self.lock:
                out = [self.slots[(tag, c)] for c in range(self.n)]
            self.barrier.wait(timeout=10)
            return out

        return all_gather


def _run_clusters(n: int, body) -> list:
    """body(cluster_id, all_gather) in one thread per cluster; returns their results, re-raising errors."""
    ex = ThreadExchange(n)
    return concurrently(*(lambda c=c: body(c, ex.link(c)) for c in range(n)))


def test_outer_nesterov_matches_torch_sgd_formula_in_float64():
    rng = np.random.default_rng(2)
    lr, m = 0.7, 0.9
    anchor = rng.standard_normal(500).astype(np.float32)
    opt = OuterOptimizer("nesterov", lr, m)
    ref, buf = anchor.astype(np.float64), np.zeros(500)
    a = anchor
    deltas = [rng.standard_normal(500).astype(np.float32) for _ in range(6)]
    # first step by hand: buf = d, step = d + m*d
    np.testing.assert_allclose(opt.step(a, deltas[0]), anchor - lr * (1 + m) * deltas[0].astype(np.float64), rtol=1e-5, atol=1e-6)  # fmt: skip
    opt = OuterOptimizer("nesterov", lr, m)
    for d in deltas:
        a = opt.step(a, d)
        buf = m * buf + d
        ref = ref - lr * (d + m * buf)
    np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(OuterOptimizer("average").step(anchor, deltas[0]), anchor - deltas[0])
    with pytest.raises(ErniekitError, match="outer optimizer 'adam'"):
        OuterOptimizer("adam")


def test_two_clusters_average_without_compression_end_at_the_mean_exactly():
    rng = np.random.default_rng(3)
    anchor = rng.integers(-512, 512, 3000).astype(np.float32) / 64  # dyadic: every float32 op below is exact
    locals_ = [anchor + rng.integers(-64, 64, 3000).astype(np.float32) / 64 for _ in range(2)]

    def body(c, ag):
        return OuterSync(anchor, ag, 2, c).sync(10, locals_[c])

    out = _run_clusters(2, body)
    np.testing.assert_array_equal(out[0], (locals_[0] + locals_[1]) / 2)
    np.testing.assert_array_equal(out[0], out[1])


def test_three_clusters_random_values_average_to_the_float64_mean():
    rng = np.random.default_rng(4)
    anchor = rng.standard_normal(2000).astype(np.float32)
    locals_ = [anchor + 0.1 * rng.standard_normal(2000).astype(np.float32) for _ in range(3)]
    out = _run_clusters(3, lambda c, ag: OuterSync(anchor, ag, 3, c).sync(1, locals_[c]))
    np.testing.assert_allclose(out[0], np.mean(np.array(locals_, np.float64), axis=0), rtol=0, atol=1e-6)
    assert all(np.array_equal(out[0], o) for o in out[1:])


@pytest.mark.parametrize("kind,outer", [("int8", "average"), ("topk", "nesterov"), ("int8", "nesterov")])
def test_compressed_clusters_stay_bit_identical_across_overlapped_syncs(kind, outer):
    anchor = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    H, overlap = 4, 2

    def body(c, ag):
        rng = np.random.default_rng(100 + c)  # each cluster trains on its own data
        sync = OuterSync(anchor, ag, 2, c, compress=kind, topk_ratio=0.05, outer=outer, outer_lr=0.7, outer_momentum=0.9)  # fmt: skip
        local, anchors = anchor.copy(), []
        for step in range(1, 5 * H + 1):
            local = local - 0.01 * rng.standard_normal(5000).astype(np.float32)  # a local step
            if sync.pending and step % H == overlap:
                local = sync.end(local)
                anchors.append(sync.anchor.copy())
            if step % H == 0:
                sync.begin(step, local)
        return anchors, sync.history

    (a0, h0), (a1, h1) = _run_clusters(2, body)
    assert len(a0) == 4
    for x, y in zip(a0, a1):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a0[0], a0[1])  # the anchor really moved
    assert h0[0].payload_bytes == payload_nbytes(kind, 5000, 0.05) == h0[0].bytes_sent
    assert h0[0].step == 4 and h1[-1].step == 16


def test_overlap_applies_the_local_steps_taken_since_the_snapshot():
    anchor = np.zeros(8, np.float32)
    locals_ = [np.full(8, 1.0, np.float32), np.full(8, 3.0, np.float32)]

    def body(c, ag):
        sync = OuterSync(anchor, ag, 2, c)
        sync.begin(5, locals_[c])
        later = locals_[c] + np.arange(8, dtype=np.float32)  # two more local steps ran meanwhile
        return sync.end(later)

    out = _run_clusters(2, body)
    np.testing.assert_array_equal(out[0], 2.0 + np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(out[1], 2.0 + np.arange(8, dtype=np.float32))


def test_error_feedback_through_outer_sync_anchor_moves_by_true_deltas_minus_residual():
    rng = np.random.default_rng(6)
    anchor0 = rng.standard_normal(3000).astype(np.float32)
    sync = OuterSync(anchor0, lambda tag, p: [p], 1, 0, compress="topk", topk_ratio=0.02)
    true_sum = np.zeros(3000)
    for step in range(30):
        local = sync.anchor + 0.1 * rng.standard_normal(3000).astype(np.float32)
        true_sum += sync.anchor.astype(np.float64) - local
        sync.sync(step, local)
    moved = anchor0.astype(np.float64) - sync.anchor
    assert np.abs(sync.compressor.residual).max() > 0.01
    np.testing.assert_allclose(moved + sync.compressor.residual, true_sum, atol=1e-4)


def test_checkpoint_resume_continues_bit_identically():
    rng = np.random.default_rng(7)
    anchor = rng.standard_normal(1500).astype(np.float32)
    steps = [anchor + 0.1 * rng.standard_normal(1500).astype(np.float32) for _ in range(4)]

    def make():
        return OuterSync(anchor, lambda tag, p: [p, p], 2, 0, compress="int8", outer="nesterov", outer_lr=0.7, outer_momentum=0.9)  # fmt: skip

    whole = make()
    ref = [whole.sync(i, s) for i, s in enumerate(steps)]
    first = make()
    for i, s in enumerate(steps[:2]):
        first.sync(i, s)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for i, s in enumerate(steps[2:], start=2):
        np.testing.assert_array_equal(resumed.sync(i, s), ref[i])


def test_exchange_failure_is_raised_in_the_caller_and_misuse_is_refused():
    def lost(tag, payload):
        raise ErniekitError("cross-cluster link: peer 10.0.0.2:29600 (cluster 1, rank 0) closed the connection")

    sync = OuterSync(np.zeros(4, np.float32), lost, 2, 0)
    sync.begin(3, np.ones(4, np.float32))
    with pytest.raises(ErniekitError, match="still pending"):
        sync.begin(4, np.ones(4, np.float32))
    with pytest.raises(ErniekitError, match="in flight"):
        sync.state_dict()
    with pytest.raises(ErniekitError, match="peer 10.0.0.2:29600"):
        sync.end(np.ones(4, np.float32))
    with pytest.raises(ErniekitError, match="call begin"):
        sync.end(np.ones(4, np.float32))

    release = threading.Event()
    stuck = OuterSync(np.zeros(4, np.float32), lambda tag, p: [p, p] if release.wait(10) else [], 2, 0, timeout_s=0.05)
    stuck.begin(1, np.ones(4, np.float32))
    with pytest.raises(ErniekitError, match="no answer .* within 0.05 s"):
        stuck.end(np.ones(4, np.float32))
    release.set()


def test_gradient_sum_adds_every_cluster_in_order():
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(777).astype(np.float32) for _ in range(3)]
    out = _run_clusters(3, lambda c, ag: gradient_sum(ag, grads[c], tag="grad/5"))
    np.testing.assert_array_equal(out[0], (grads[0] + grads[1]) + grads[2])
    assert all(np.array_equal(out[0], o) for o in out[1:])
    with pytest.raises(ErniekitError, match="cluster 1 sent 8 bytes, expected 12"):
        gradient_sum(lambda tag, p: [p, b"12345678"], np.ones(3, np.float32))


@pytest.mark.parametrize("kind", ["none", "int8", "topk"])
def test_decode_refuses_a_broken_peers_payload(kind):
    """A payload of the right length and header from a broken peer: a topk column past the row, or a
    NaN / inf value, is one ErniekitError, not an IndexError or a poisoned anchor."""
    comp = FlatCompressor(kind, 3000, topk_ratio=0.1)
    good = bytearray(comp.encode(np.linspace(-1, 1, 3000, dtype=np.float32)))
    assert np.isfinite(comp.decode(bytes(good))).all()
    bad = bytearray(good)
    nan = np.array([np.nan], np.float32).tobytes()
    if kind == "none":
        bad[13 + 4 * 7 : 13 + 4 * 8] = nan
    elif kind == "int8":  # the first row's scale, after the int8 values
        bad[13 + 3000 : 13 + 3004] = np.array([np.inf], np.float32).tobytes()
    else:  # the first column index, after the float32 values
        count = comp.rows * comp.k
        bad[13 + 4 * count : 13 + 4 * count + 2] = (ROW + 5).to_bytes(2, "little")
    with pytest.raises(ErniekitError, match="cross-cluster .*payload .*(non-finite|column index outside)"):
        comp.decode(bytes(bad))


@pytest.mark.parametrize("kind,outer", [("none", "average"), ("int8", "nesterov"), ("topk", "average")])
def test_a_rank_with_nothing_to_train_takes_part_in_every_sync_with_an_empty_payload(kind, outer):
    """A pipeline stage that no LoRA target reaches has an empty vector: it still exchanges a header-only
    payload at every sync (so the link stays in step), in the local, overlapped, gradients and adaptive paths,
    and its state saves and loads."""
    from erniekit.distributed.cross_cluster.adaptive import choose

    empty = np.zeros(0, np.float32)

    def body(c, ag):
        sync = OuterSync(empty, ag, 2, c, compress=kind, topk_ratio=0.1, outer=outer, outer_lr=0.7, outer_momentum=0.9)  # fmt: skip
        got = [sync.sync(2, empty)]
        sync.begin(4, empty)  # overlapped: applied a step later
        got.append(sync.end(empty))
        total = gradient_sum(ag, np.array([1.0 + c, 2.0], np.float32), tag="grad/5")  # only the two loss sums
        return got, sync.history, sync.state_dict(), total

    out = _run_clusters(2, body)
    for got, history, _state, total in out:
        assert [g.shape for g in got] == [(0,), (0,)]
        assert [h.payload_bytes for h in history] == [13, 13] == [h.bytes_received for h in history]
        np.testing.assert_array_equal(total, [3.0, 4.0])
    resumed = OuterSync(empty, lambda tag, p: [p, p], 2, 0, compress=kind, outer=outer, outer_momentum=0.9)
    resumed.load_state_dict(out[0][2])
    assert resumed.sync(6, empty).shape == (0,)
    assert payload_nbytes(kind, 0, 0.1) == 13
    pick = choose(0.1, 0, 12.5e6, 0.05, max_fraction=0.1, overlap_steps=0)  # the adaptive choice of such a rank
    assert pick.payload_bytes == 13 and pick.kind in ("none", "int8")
    with pytest.raises(ErniekitError, match="need n >= 0"):
        FlatCompressor(kind, -1)
