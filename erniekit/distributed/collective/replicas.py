"""Plain data parallelism as whole-model replicas on ordinary tensors (no DistTensors).

When a job only splits the batch (every degree but dp is 1, no sharding), each rank holds the
whole model anyway. Running it as DistTensors still pays Paddle's SPMD bookkeeping on every op of
the forward and the backward: the tiny MoE's backward took 66 ms a step on 2 ranks against 33 ms
in one process (measured, docs/performance.md), which capped weak scaling at ~0.5. Here each rank
runs the model on its own rows of the global batch as a single process would, and the gradients
are summed over the ranks. Losses are this rank's share of the whole batch's (the loop's
normaliser counts the global batch; router losses see whole-batch statistics through
`data_sum`), so the summed gradients are those of the global loss, as with DistTensors.

The gradients go in one flat buffer per dtype with the step's loss sums and stop votes, so a
step waits for the other ranks once. Ranks on one host sum through shared memory (host_sum.py;
weak scaling 0.82 / 0.74 dense / MoE through gloo -> 0.93 / 0.90 on 2 cores, docs/distributed.md),
others through gloo, where the buffer is numpy, filled from and emptied into views of the gradients (cheaper than
Paddle's concat / split / assign). Overlapping the sum with the backward did not pay here: buckets
reduced by a background thread as the backward completed them gave weak scaling 0.76 (1 MiB
buckets) and 0.67 (256 KiB) against 0.87-0.89 for one gloo sum after the backward (tiny-dense, 2
processes on 2 cores, tools/bench_scaling.py): gloo's "asynchronous" all-reduce runs in the
calling thread, and the thread doing it takes a core the other process's backward needs.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.distributed.collective.host_sum import HostSum
from erniekit.distributed.collective.pipeline import data_rank_rows
from erniekit.utils.dtensor import host_view

_VALUES = 1024  # room for a step's loss sums, metrics and stop votes beside the gradients


def host_floats(params) -> int:
    """Floats a step's shared-memory sum carries: the trainable CPU float32 parameters' gradients
    (the ones it sums; others go through the process group) and room for the step's values."""
    n = sum(int(p.size) for p in params if not p.stop_gradient and p.dtype == paddle.float32 and p.place.is_cpu_place())
    return n + _VALUES if n else 0


class DataReplicas:
    def __init__(self, size: int, rank: int, group=None):
        """size data ranks, this one is `rank`; group: their process group (None: the whole job)."""
        self.size, self.rank, self.group = size, rank, group
        self._flat: np.ndarray | None = None  # the CPU sum's buffer for gloo, kept between steps
        # ranks on one host sum through shared memory (decided together at the first sum)
        self.host = HostSum(size, rank, group) if size > 1 else None

    def attach(self, model) -> None:
        """MoE router losses and load counts over the whole global batch."""
        for m in model.moe_layers() if hasattr(model, "moe_layers") else []:
            m.data_sum, m.data_ranks = self.data_sum, self.size

    def local_rows(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        return data_rank_rows(batch, self.size, self.rank)

    def data_sum(self, t: paddle.Tensor) -> paddle.Tensor:
        """t summed over the data ranks (a copy; no gradient flows through it)."""
        n = int(np.prod(t.shape))
        buf = self._host_buffer(n) if t.dtype == paddle.float32 and t.place.is_cpu_place() else None
        if buf is None:
            out = t.detach().clone()
            dist.all_reduce(out, group=self.group)
            return out
        buf[:] = t.detach().numpy().reshape(-1)
        self.host.sum(n)
        return paddle.to_tensor(buf.reshape(t.shape))

    def _host_buffer(self, n: int) -> np.ndarray | None:
        return None if self.host is None else self.host.buffer(n)

    def choose_transport(self, floats: int) -> str:
        """Decide (collectively: every rank calls it) how the sums travel, with room for `floats`
        (the CPU float32 gradients and the step's values) so a small /dev/shm shows now; returns it
        for the log. Without CPU float32 gradients (a GPU job) the process group sums them."""
        if self.host is not None and not floats:  # the same model on every rank: the same answer
            self.host = None
            return "the process group's all-reduce"
        if self.host is None:
            return "gloo"
        if self.host.buffer(floats) is None:
            return f"gloo; shared memory not used: {self.host.why_not}"
        return "shared memory on this host"

    @paddle.no_grad()
    def all_reduce(self, params: list[paddle.Tensor], values: list[float]) -> list[float]:
        """Every parameter's .grad summed over the ranks in place (zeros first where this rank has
        none, so every rank sends the same sizes) and `values` summed in the same all-reduce, one
        per gradient dtype. Returns the summed values."""
        by_dtype: dict = {}
        for p in params:
            if p.grad is None:
                p.grad = paddle.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        carrier = paddle.float32 if paddle.float32 in by_dtype or not by_dtype else next(iter(by_dtype))
        by_dtype.setdefault(carrier, [])
        out = values
        for dtype, grads in by_dtype.items():
            extra = values if dtype == carrier else []
            views = [host_view(g) for g in grads]
            if all(v is not None for v in views):
                summed = self._sum_views(views, extra)
            else:
                summed = self._sum_tensors(grads, extra)
            if dtype == carrier:
                out = summed
        return out

    def _sum_views(self, views: list[np.ndarray], values: list[float]) -> list[float]:
        """CPU float32: through a numpy buffer (kept between steps)."""
        n = sum(v.size for v in views)
        shared = self._host_buffer(n + len(values))  # None: the sum goes through gloo
        if shared is None and (self._flat is None or self._flat.size != n + len(values)):
            self._flat = np.empty(n + len(values), dtype=np.float32)
        flat, start = (self._flat if shared is None else shared), 0
        for v in views:
            flat[start : start + v.size] = v.reshape(-1)
            start += v.size
        flat[n:] = values
        if shared is not None:
            self.host.sum(n + len(values))
        else:
            dist.all_reduce(paddle.from_dlpack(flat), group=self.group)
        start = 0
        for v in views:
            v.reshape(-1)[:] = flat[start : start + v.size]
            start += v.size
        return flat[n:].astype(np.float64).tolist()

    def _sum_tensors(self, grads: list[paddle.Tensor], values: list[float]) -> list[float]:
        parts = [g.reshape([-1]) for g in grads]
        if values:
            parts.append(paddle.to_tensor(values, dtype=grads[0].dtype if grads else "float32"))
        flat = paddle.concat(parts) if len(parts) > 1 else parts[0].clone()
        dist.all_reduce(flat, group=self.group)
        pieces = paddle.split(flat, [int(t.shape[0]) for t in parts])
        for g, part in zip(grads, pieces):
            paddle.assign(part.reshape(g.shape), output=g)
        return pieces[-1].astype("float64").numpy().tolist() if values else []
