"""Adaptive interval/compression choice and the link meter, against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from erniekit.distributed.cross_cluster.adaptive import LinkMeter, choose
from erniekit.errors import ErniekitError

BW = 12.5e6  # 100 Mbit/s
LAT = 0.05
N = 1_000_000  # 977 rows of 1024
NONE_B, INT8_B, TOPK_B = 13 + 4 * N, 13 + N + 4 * 977, 13 + 977 * 11 * 6  # topk 0.01: k = 11, float32 + uint16


def test_choose_hand_computed_cases():
    # interval 1: none 0.05 + 4e6/12.5e6 = 0.37 s, int8 0.05 + 0.0803 = 0.130 s, topk 0.05 + 0.00516 = 0.0552 s
    # a dense codec at any interval comes before top-k: interval 1 int8 13% misses 10%, interval 2 int8 6.5% meets
    c = choose(1.0, N, BW, LAT, max_fraction=0.1, overlap_steps=0)
    assert (c.interval, c.kind, c.payload_bytes, c.meets) == (2, "int8", INT8_B, True)
    assert c.sync_s == pytest.approx(LAT + INT8_B / BW, rel=1e-12)
    assert c.fraction == pytest.approx((LAT + INT8_B / BW) / 2, rel=1e-12)
    # top-k only as the last resort: with top-k alone, interval 1 (5.5%) meets 10%
    c = choose(1.0, N, BW, LAT, max_fraction=0.1, overlap_steps=0, kinds=("topk",))
    assert (c.interval, c.kind, c.payload_bytes) == (1, "topk", TOPK_B)
    assert c.fraction == pytest.approx(LAT + TOPK_B / BW, rel=1e-12)
    # no interval up to 4 meets 0.5% densely (int8 at 4: 3.3%); top-k at interval 4 does (1.4%)
    c = choose(1.0, N, BW, LAT, max_fraction=0.015, overlap_steps=0, intervals=(1, 2, 4))
    assert (c.interval, c.kind) == (4, "topk")
    # a 5% target: int8 at interval 4 (3.3%) before top-k at interval 2 (2.76%)
    c = choose(1.0, N, BW, LAT, max_fraction=0.05, overlap_steps=0)
    assert (c.interval, c.kind) == (4, "int8")
    # without topk the same target needs int8 at interval 4: 0.1303 / 4 = 3.3% (interval 2: 6.5%)
    c = choose(1.0, N, BW, LAT, max_fraction=0.05, overlap_steps=0, kinds=("int8", "none"))
    assert (c.interval, c.kind) == (4, "int8")
    # one step of overlap hides 0.3 s of a 0.3 s step: none at interval 1 leaves 0.07 s visible = 23%;
    # interval 2 hides 0.3 s too (overlap 1 step) -> 0.07 / 2 / 0.3 = 11.7%; interval 4 -> 5.8% <= 10%
    c = choose(0.3, N, BW, LAT, max_fraction=0.1, overlap_steps=1, kinds=("none",))
    assert (c.interval, c.kind) == (4, "none")
    assert c.fraction == pytest.approx((LAT + NONE_B / BW - 0.3) / 4 / 0.3, rel=1e-12)
    # overlap of 2 steps at interval 1 hides only 1 step (the sync must land before the next starts)
    c = choose(0.3, N, BW, LAT, max_fraction=0.1, overlap_steps=2, kinds=("none",), intervals=(1, 2))
    assert (c.interval, c.meets) == (2, True) and c.fraction == 0.0


def test_choose_reports_when_nothing_meets_the_target():
    c = choose(0.01, N, BW, LAT, max_fraction=0.01, overlap_steps=0, intervals=(1, 2, 4))
    assert not c.meets and (c.interval, c.kind) == (4, "topk")
    assert c.fraction == pytest.approx((LAT + TOPK_B / BW) / 4 / 0.01, rel=1e-12)
    # three clusters: our payload crosses our link twice
    c3 = choose(1.0, N, BW, LAT, max_fraction=1.0, overlap_steps=0, kinds=("none",), n_clusters=3)
    assert c3.sync_s == pytest.approx(LAT + 2 * NONE_B / BW, rel=1e-12)
    with pytest.raises(ErniekitError, match="kinds"):
        choose(1.0, N, BW, LAT, 0.1, 0, kinds=("fp8",))


def test_link_meter_recovers_an_exact_link():
    m = LinkMeter()
    for nbytes, rt in [(100, 1), (4_000_000, 1), (1_000_000, 2), (64_000, 3)]:
        m.observe(nbytes, LAT * rt + nbytes / BW, rt)
    bw, lat = m.estimate()
    assert bw == pytest.approx(BW, rel=1e-9) and lat == pytest.approx(LAT, rel=1e-9)


def test_link_meter_is_weighted_least_squares_with_decay():
    rng = np.random.default_rng(0)
    half_life, obs = 4.0, []
    m = LinkMeter(half_life)
    for i in range(20):
        bw = BW if i < 10 else BW / 2  # the link slows down halfway
        nbytes, rt = int(rng.integers(1_000, 5_000_000)), int(rng.integers(1, 3))
        t = LAT * rt + nbytes / bw + rng.normal(0, 0.002)
        m.observe(nbytes, t, rt)
        obs.append((rt, nbytes, t))
    w = np.sqrt(0.5 ** (np.arange(len(obs))[::-1] / half_life))  # the newest has weight 1
    x = np.array([[rt, b] for rt, b, _ in obs], float) * w[:, None]
    y = np.array([t for *_, t in obs]) * w
    lat_ref, inv_bw_ref = np.linalg.lstsq(x, y, rcond=None)[0]
    bw, lat = m.estimate()
    assert lat == pytest.approx(lat_ref, rel=1e-6) and bw == pytest.approx(1 / inv_bw_ref, rel=1e-6)
    assert abs(bw - BW / 2) < abs(bw - BW)  # it follows the slower link


def test_link_meter_keeps_latency_non_negative_and_refuses_what_it_cannot_separate():
    m = LinkMeter()
    m.observe(1_000_000, 0.08, 1)
    m.observe(2_000_000, 0.17, 1)  # unconstrained fit: latency -0.01 s
    bw, lat = m.estimate()
    # latency clamped to 0; 1/bw through the origin: (1e6*0.08 + 2e6*0.17 * decay^0) / (1e12 + 4e12), decayed
    d = m.decay
    assert lat == 0.0
    assert 1 / bw == pytest.approx((d * 1e6 * 0.08 + 2e6 * 0.17) / (d * 1e12 + 4e12), rel=1e-12)
    same = LinkMeter()
    for _ in range(3):
        same.observe(1_000_000, 0.13, 1)
    with pytest.raises(ErniekitError, match="same bytes per round trip"):
        same.estimate()
    flat = LinkMeter()
    flat.observe(10, 0.05, 1)
    flat.observe(10_000_000, 0.05, 1)
    bw, lat = flat.estimate()  # bytes cost nothing: bandwidth unbounded (inf, or ~1e23 after rounding)
    assert bw > 1e15 and lat == pytest.approx(0.05, rel=1e-9)
    slower_with_more_bytes = LinkMeter()
    slower_with_more_bytes.observe(10, 0.06, 1)
    slower_with_more_bytes.observe(10_000_000, 0.05, 1)  # 1/bandwidth < 0 unconstrained: clamped to 0
    assert slower_with_more_bytes.estimate()[0] == math.inf
