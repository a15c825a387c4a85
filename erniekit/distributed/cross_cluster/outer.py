"""The outer step of cross-cluster local SGD: exchange compressed deltas, average, move the anchor.

Every cluster trains alone for H steps; at a sync each rank sends delta = anchor - local (its
part of the model, flattened), compressed with error feedback. Every cluster decodes every
payload, its own included, and sums them in cluster order, so all clusters compute the same
average bit for bit and their anchors never drift apart. The outer optimizer turns the averaged
delta into the new anchor: `average` is parameter averaging; `nesterov` is DiLoCo's outer
Nesterov SGD (Douillard et al. 2023, lr 0.7, momentum 0.9). The exchange runs in a background
thread (`begin`) while local steps go on; `end` applies it as new_anchor + (local_now - snapshot).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from erniekit.distributed.cross_cluster.compress import FlatCompressor
from erniekit.errors import ErniekitError

AllGather = Callable[[str, bytes], "list[bytes]"]
METHODS = ("average", "nesterov")


class OuterOptimizer:
    """anchor, averaged delta -> new anchor (float32, the same operations in every cluster)."""

    def __init__(self, method: str = "average", lr: float = 1.0, momentum: float = 0.0):
        if method not in METHODS:
            raise ErniekitError(f"cross-cluster outer optimizer {method!r}: use one of {', '.join(METHODS)}")
        if lr <= 0 or not 0 <= momentum < 1:
            raise ErniekitError(f"cross-cluster outer lr={lr}, momentum={momentum}: need lr > 0 and 0 <= momentum < 1")
        self.method, self.lr, self.momentum = method, lr, momentum
        self.buf: np.ndarray | None = None

    def step(self, anchor: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """average: anchor - delta (lr and momentum unused). nesterov, as torch.optim.SGD(nesterov=True):
        buf = m*buf + delta; anchor - lr*(delta + m*buf)."""
        anchor = np.asarray(anchor, np.float32)
        delta = np.asarray(delta, np.float32)
        if self.method == "average":
            return anchor - delta
        m, lr = np.float32(self.momentum), np.float32(self.lr)
        if self.buf is None:
            self.buf = delta.copy()
        else:
            self.buf *= m
            self.buf += delta
        return anchor - lr * (delta + m * self.buf)

    def state_dict(self) -> dict:
        return {"method": self.method, "buf": None if self.buf is None else self.buf.copy()}

    def load_state_dict(self, state: dict) -> None:
        if state["method"] != self.method:
            raise ErniekitError(
                f"cross-cluster checkpoint was written with outer optimizer {state['method']}; this run uses "
                f"{self.method}: resume with the same cross_cluster_outer"
            )
        self.buf = None if state["buf"] is None else np.asarray(state["buf"], np.float32).copy()


def _gather(all_gather: AllGather, tag: str, payload: bytes, n_clusters: int) -> list[bytes]:
    got = all_gather(tag, payload)
    if len(got) != n_clusters:
        raise ErniekitError(f"cross-cluster all_gather {tag!r} returned {len(got)} payloads for {n_clusters} clusters")
    return list(got)


def gradient_sum(all_gather: AllGather, vec: np.ndarray, tag: str = "grad") -> np.ndarray:
    """`gradients` mode: the sum over clusters of an already intra-cluster-summed gradient,
    uncompressed, added in cluster order (every cluster gets the same bits)."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).reshape(-1)
    parts = all_gather(tag, vec.tobytes())
    for c, p in enumerate(parts):
        if len(p) != vec.nbytes:
            raise ErniekitError(
                f"cross-cluster gradient {tag!r}: cluster {c} sent {len(p)} bytes, expected {vec.nbytes} "
                "(every cluster must run the same layout)"
            )
    total = np.frombuffer(parts[0], np.float32).copy()
    for p in parts[1:]:
        total += np.frombuffer(p, np.float32)
    return total


@dataclass
class SyncStats:
    """One sync as the run logs it: bytes this rank sent, and where the seconds went."""

    step: int
    payload_bytes: int
    bytes_sent: int  # payload x (n_clusters - 1): an all_gather sends our payload to every other cluster
    bytes_received: int
    encode_s: float
    exchange_s: float  # the all_gather in the background thread
    wait_s: float  # how long `end` blocked on it (the part overlap did not hide)
    apply_s: float  # decode, average, outer step


class OuterSync:
    """One rank's cross-cluster local-SGD state across syncs: anchor, compressor, outer optimizer."""

    def __init__(
        self,
        anchor: np.ndarray,
        all_gather: AllGather,
        n_clusters: int,
        cluster_id: int,
        compress: str = "none",
        topk_ratio: float = 0.01,
        outer: str = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        timeout_s: float | None = None,
    ):
        if not 0 <= cluster_id < n_clusters:
            raise ErniekitError(f"cross-cluster id {cluster_id}: need 0 <= id < {n_clusters} clusters")
        self.anchor = np.array(anchor, np.float32).reshape(-1)
        self.all_gather, self.n_clusters, self.cluster_id = all_gather, n_clusters, cluster_id
        self.compressor = FlatCompressor(compress, self.anchor.size, topk_ratio)
        self.outer = OuterOptimizer(outer, outer_lr, outer_momentum)
        self.timeout_s = timeout_s
        self.history: list[SyncStats] = []
        self._pending: dict | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def begin(self, step: int, local: np.ndarray) -> None:
        """Snapshot local, encode anchor - local and start the exchange in a background thread."""
        if self._pending is not None:
            raise ErniekitError(
                f"cross-cluster sync at step {step} started while the one from step {self._pending['step']} "
                "is still pending: cross_cluster_overlap_steps must not exceed cross_cluster_sync_every"
            )
        t0 = time.perf_counter()
        snapshot = np.array(local, np.float32).reshape(-1)
        if snapshot.size != self.anchor.size:
            raise ErniekitError(
                f"cross-cluster sync: local vector has {snapshot.size} elements, anchor {self.anchor.size}"
            )
        payload = self.compressor.encode(self.anchor - snapshot)
        job = {"step": step, "snapshot": snapshot, "payload": payload, "encode_s": time.perf_counter() - t0}

        def exchange() -> None:
            t = time.perf_counter()
            try:
                job["result"] = _gather(self.all_gather, f"outer/{step}", payload, self.n_clusters)
            except BaseException as e:  # re-raised in the caller by end()
                job["error"] = e
            job["exchange_s"] = time.perf_counter() - t

        job["thread"] = threading.Thread(target=exchange, name=f"cross-cluster-sync-{step}", daemon=True)
        self._pending = job
        job["thread"].start()

    def end(self, local_now: np.ndarray) -> np.ndarray:
        """Wait for the exchange, apply the outer step; returns new_anchor + (local_now - snapshot)."""
        job = self._pending
        if job is None:
            raise ErniekitError("cross-cluster sync: end() called with no sync in flight (call begin() first)")
        t0 = time.perf_counter()
        job["thread"].join(self.timeout_s)
        if job["thread"].is_alive():
            raise ErniekitError(
                f"cross-cluster sync of step {job['step']}: no answer from the other clusters within {self.timeout_s} s; "
                "check the link and that every cluster is running"
            )
        self._pending = None
        if "error" in job:
            raise job["error"]
        wait_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        payloads = job["result"]
        payloads[self.cluster_id] = job["payload"]  # our own bytes, as sent
        total = self.compressor.decode(payloads[0])
        for p in payloads[1:]:
            total += self.compressor.decode(p)
        mean = total / np.float32(self.n_clusters)
        self.anchor = self.outer.step(self.anchor, mean)
        local_now = np.asarray(local_now, np.float32).reshape(-1)
        out = self.anchor + (local_now - job["snapshot"])
        self.history.append(
            SyncStats(
                step=job["step"],
                payload_bytes=len(job["payload"]),
                bytes_sent=len(job["payload"]) * (self.n_clusters - 1),
                bytes_received=sum(len(p) for i, p in enumerate(payloads) if i != self.cluster_id),
                encode_s=job["encode_s"],
                exchange_s=job["exchange_s"],
                wait_s=wait_s,
                apply_s=time.perf_counter() - t1,
            )
        )
        return out

    def sync(self, step: int, local: np.ndarray) -> np.ndarray:
        """A sync with no overlap: begin and end at the same step (returns the new anchor)."""
        self.begin(step, local)
        return self.end(local)

    def state_dict(self) -> dict:
        """Anchor, compression residual and outer momentum; only at a synchronised point."""
        if self._pending is not None:
            raise ErniekitError(
                f"cross-cluster state requested while the sync of step {self._pending['step']} is in flight: "
                "checkpoint only after it is applied"
            )
        return {
            "anchor": self.anchor.copy(),
            "compressor": self.compressor.state_dict(),
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        anchor = np.asarray(state["anchor"], np.float32).reshape(-1)
        if anchor.size != self.anchor.size:
            raise ErniekitError(
                f"cross-cluster checkpoint anchor has {anchor.size} elements, this rank {self.anchor.size}: "
                "resume with the same layout"
            )
        self.compressor.load_state_dict(state["compressor"])
        self.outer.load_state_dict(state["outer"])
        self.anchor = anchor.copy()
