"""Expert parallelism's token exchange: dispatch and combine by all-to-all.

The routed experts of every MoE layer are split over all the data ranks (expert_parallel_degree
= data_parallel_degree x sharding_parallel_degree): exchange rank r holds experts
[r*E/n, (r+1)*E/n) as its slice of a `Shard(0)` parameter. A layer sends each of its tokens to
the ranks holding the experts it routed to, those run their experts on what they received,
and the results come back the same way (erniekit/nn/moe.py, StackedExperts).

The all-to-all is built from point-to-point sends: Gloo has no all_to_all (measured:
"ProcessGroupGLOO does not support all_to_all"). Ranks meet in pairs, n-1 rounds of a
round-robin tournament, and in each pair the lower rank sends first: Gloo's send blocks until
the peer receives, so both ends must agree on the order. Row counts travel first (a small
all-to-all), so every receiver knows its buffer sizes and no empty message is sent. Each pair
talks over a process group of its own: Paddle's gloo tags a message with its group's running
operation count, so two ranks that skipped different empty messages, or sat out different
rounds, would disagree on the tag over a shared group and wait forever (measured in the
parameter-server mode, erniekit/distributed/ps/topology.py).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from erniekit.distributed.collective.local_experts import TensorParallelExperts, run_local


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Round-robin tournament (circle method): n-1 rounds (n odd: n) in which every pair of the n
    ranks meets exactly once and no rank is in two pairs of one round."""
    m = n + n % 2  # an odd count gets a bye: its partner n is nobody
    ids = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(min(ids[i], ids[m - 1 - i]), max(ids[i], ids[m - 1 - i])) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if b < n])
        ids = [ids[0], ids[-1]] + ids[1:-1]
    return rounds


class _AllToAll(PyLayer):
    """Rows of x, in consecutive blocks of send[r] rows for rank r -> the rows every rank sent
    here, in blocks of recv[r] from rank r; its gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(ctx, x, ex, send, recv):
        ctx.ex, ctx.counts = ex, (send, recv)
        return ex.exchange(x, send, recv)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.counts
        return ctx.ex.exchange(grad, recv, send)


class ExpertExchange:
    """One process's side of the exchange among the `ranks` (global ranks, in expert-slice order)
    that split the experts: they are the data ranks with this process's pipeline and tensor
    coordinates. Injected into each StackedExperts as `expert_parallel`."""

    def __init__(
        self,
        ranks: list[int],
        me: int,
        mesh,
        pair_groups: dict | None = None,
        tensor: TensorParallelExperts | None = None,
    ):
        """pair_groups: (lower, higher) exchange index -> the pair's process group (`make_pair_groups`);
        tensor: the tp ranks that split the experts' width (None: no tensor parallelism)."""
        self.ranks, self.mesh, self.tensor = list(ranks), mesh, tensor
        self.rank, self.size = self.ranks.index(me), len(self.ranks)
        self.pair_groups = pair_groups or {}
        # this rank's partner in each round (None: a bye)
        self.partners = [
            next((b if a == self.rank else a for a, b in r if self.rank in (a, b)), None)
            for r in pair_rounds(self.size)
        ]

    def run(self, fn, x, topk_idx, topk_weight, keep, params: dict) -> paddle.Tensor:
        """fn(x, topk_idx, topk_weight, keep, params) on this process's shards of the (dist)
        tensors; the result is placed as x (its rows are this process's tokens)."""
        return run_local(fn, self.mesh, x, topk_idx, topk_weight, keep, params, tensor=self.tensor)

    def exchange_counts(self, counts: np.ndarray) -> np.ndarray:
        """counts [n, ...] (row r: what this rank sends to rank r) -> [n, ...] (row r: what rank r
        sends here)."""
        got = self.exchange(paddle.to_tensor(counts), [1] * self.size, [1] * self.size)
        return got.numpy()

    def all_to_all(self, x: paddle.Tensor, send: list[int], recv: list[int]) -> paddle.Tensor:
        """Differentiable all-to-all of rows (see _AllToAll)."""
        return _AllToAll.apply(x, self, send, recv)

    def exchange(self, x: paddle.Tensor, send: list[int], recv: list[int]) -> paddle.Tensor:
        starts = np.cumsum([0] + list(send))
        if starts[-1] != x.shape[0]:
            raise ValueError(f"expert exchange: send counts {send} add up to {starts[-1]}, not the {x.shape[0]} rows")
        width, me = list(x.shape[1:]), self.rank
        out: list[paddle.Tensor | None] = [None] * self.size
        if send[me]:
            out[me] = x[int(starts[me]) : int(starts[me + 1])]
        for peer in self.partners:
            if peer is None:
                continue
            buf = paddle.empty([recv[peer]] + width, dtype=x.dtype)
            part = x[int(starts[peer]) : int(starts[peer + 1])].contiguous()
            group = self.pair_groups.get((min(me, peer), max(me, peer)))
            for step in ("send", "recv") if me < peer else ("recv", "send"):
                if step == "send" and send[peer]:
                    dist.send(part, dst=self.ranks[peer], group=group)
                elif step == "recv" and recv[peer]:
                    dist.recv(buf, src=self.ranks[peer], group=group)
            out[peer] = buf
        kept = [t for t in out if t is not None and t.shape[0]]
        if not kept:
            return paddle.empty([0] + width, dtype=x.dtype)
        return paddle.concat(kept, axis=0) if len(kept) > 1 else kept[0]


def make_pair_groups(exchanges: list[list[int]], me: int) -> dict[tuple[int, int], object]:
    """A process group for every pair of every exchange (lists of global ranks), created by every
    rank of the job in one order (group creation is collective), a barrier after each (gloo groups
    created back to back failed to connect with 4 processes, erniekit/distributed/collective/pipeline.py).
    Returns this rank's: (lower, higher) index in its exchange -> group."""
    from erniekit.distributed.collective.pipeline import new_group

    mine = {}
    for ranks in exchanges:
        for a in range(len(ranks)):
            for b in range(a + 1, len(ranks)):
                g = new_group([ranks[a], ranks[b]])
                if me in (ranks[a], ranks[b]):
                    mine[(a, b)] = g
    return mine
