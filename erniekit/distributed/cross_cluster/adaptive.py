"""Adaptive cross-cluster sync: pick the interval and compression that keep the sync cheap.

The target is a fraction of step time: the part of a sync that overlap does not hide, spread
over the interval's steps, must stay under max_fraction x step time. Among the choices that meet
it, the smallest interval with a dense codec wins (the least drift between clusters), then the least
lossy one (none < int8); top-k only when no interval meets the target with a dense codec. The link's speed comes from `LinkMeter`, a least-squares fit of observed
exchanges, seconds = latency x round_trips + bytes / bandwidth, over a decaying window so a link
that changes speed is followed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from erniekit.distributed.cross_cluster.compress import payload_nbytes
from erniekit.distributed.ps.compression import KINDS
from erniekit.errors import ErniekitError

INTERVALS = tuple(2**i for i in range(9))  # 1 .. 256
# Codecs that send every value of the delta. Top-k sends a few and keeps the rest in the error feedback,
# so in local SGD each sync pulls every cluster back to an anchor that moved by a fraction of the
# clusters' progress (measured: a tiny run switched to top-k at interval 4 ended at a higher loss than
# int8 at interval 8); it is the last resort, after every interval with a dense codec.
DENSE = ("none", "int8")


@dataclass(frozen=True)
class Choice:
    interval: int
    kind: str
    sync_s: float  # predicted seconds of one sync's exchange
    fraction: float  # predicted visible sync seconds per step / step time
    payload_bytes: int
    meets: bool  # False: no choice met max_fraction; this is the one with the smallest fraction


def sync_seconds(
    nbytes: int, bandwidth_bytes_s: float, latency_s: float, n_clusters: int = 2, round_trips: int = 1
) -> float:
    """One all_gather between clusters: our payload goes to each of the n_clusters - 1 others over our link."""
    return round_trips * latency_s + (n_clusters - 1) * nbytes / bandwidth_bytes_s


def choose(
    step_time_s: float,
    n_elems: int,
    bandwidth_bytes_s: float,
    latency_s: float,
    max_fraction: float,
    overlap_steps: int,
    kinds: tuple[str, ...] = KINDS,
    intervals: tuple[int, ...] = INTERVALS,
    topk_ratio: float = 0.01,
    n_clusters: int = 2,
    round_trips: int = 1,
) -> Choice:
    """The smallest interval, then least lossy kind, whose visible sync time per step is at most
    max_fraction x step time. Overlap hides min(overlap_steps, interval) steps of the exchange (a sync
    must be applied before the next one starts)."""
    if step_time_s <= 0 or bandwidth_bytes_s <= 0 or latency_s < 0 or max_fraction <= 0 or overlap_steps < 0:
        raise ErniekitError(
            f"adaptive cross-cluster sync: step_time_s={step_time_s}, bandwidth={bandwidth_bytes_s} B/s, "
            f"latency={latency_s} s, max_fraction={max_fraction}, overlap_steps={overlap_steps}: need positive "
            "step time, bandwidth and fraction, non-negative latency and overlap"
        )
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or not intervals or min(intervals) < 1:
        raise ErniekitError(
            f"adaptive cross-cluster sync: kinds {kinds} (from {KINDS}) and intervals {intervals} (>= 1)"
        )
    ordered = sorted(set(kinds), key=KINDS.index)
    best: Choice | None = None
    for group in (DENSE, ("topk",)):  # top-k only when no interval meets the target with a dense codec
        for interval in sorted(set(intervals)):
            for kind in (k for k in ordered if k in group):
                nbytes = payload_nbytes(kind, n_elems, topk_ratio)
                sync_s = sync_seconds(nbytes, bandwidth_bytes_s, latency_s, n_clusters, round_trips)
                visible = max(0.0, sync_s - min(overlap_steps, interval) * step_time_s)
                fraction = visible / interval / step_time_s
                choice = Choice(interval, kind, sync_s, fraction, nbytes, fraction <= max_fraction)
                if choice.meets:
                    return choice
                if best is None or fraction < best.fraction:
                    best = choice
    return best


class LinkMeter:
    """Running weighted least squares of seconds = latency x round_trips + bytes / bandwidth.

    Each new observation multiplies the weight of the older ones by 0.5 ** (1 / half_life), so an
    observation half_life exchanges old counts half. Latency and 1/bandwidth are kept >= 0 (a
    two-variable non-negative fit). Separating the two needs exchanges of at least two different
    bytes-per-round-trip ratios (e.g. the link's small handshake and a payload).
    """

    def __init__(self, half_life: float = 16.0):
        if half_life <= 0:
            raise ErniekitError(f"link meter half_life={half_life}: use a positive number of observations")
        self.decay = 0.5 ** (1.0 / half_life)
        self.xtx = np.zeros((2, 2))  # sums of w x x^T, x = (round_trips, bytes)
        self.xty = np.zeros(2)  # sums of w x t
        self.tt = 0.0  # sum of w t^2
        self.count = 0

    def observe(self, nbytes: int, seconds: float, round_trips: int = 1) -> None:
        x = np.array([float(round_trips), float(nbytes)])
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.tt = self.decay * self.tt + seconds * seconds
        self.count += 1

    def _sse(self, coef: np.ndarray) -> float:
        return float(self.tt - 2 * coef @ self.xty + coef @ self.xtx @ coef)

    def estimate(self) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s); bandwidth is inf when bytes cost nothing measurable."""
        a = self.xtx
        if self.count < 2 or a[0, 0] <= 0 or a[1, 1] <= 0:
            raise ErniekitError(
                f"link meter has {self.count} exchanges: observe at least two of different sizes before estimating"
            )
        corr2 = a[0, 1] ** 2 / (a[0, 0] * a[1, 1])
        if 1.0 - corr2 < 1e-12:
            raise ErniekitError(
                "link meter: every observed exchange has the same bytes per round trip, so latency and bandwidth "
                "cannot be separated; observe an exchange of another size (e.g. the link handshake)"
            )
        d = 1.0 / np.sqrt(np.diag(a))  # scale columns: round trips ~1, bytes ~1e6
        coef = d * np.linalg.solve(a * np.outer(d, d), d * self.xty)
        if (coef < 0).any():
            candidates = [np.zeros(2)]
            for i in range(2):
                c = np.zeros(2)
                c[i] = max(0.0, self.xty[i] / a[i, i])
                candidates.append(c)
            coef = min(candidates, key=self._sse)
        latency, inv_bw = float(coef[0]), float(coef[1])
        return (math.inf if inv_bw == 0 else 1.0 / inv_bw), latency
