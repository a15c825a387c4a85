"""Running a MoE layer's expert function on this process's local tensors inside `dist.local_map`:
what expert parallelism (expert_exchange.py) and replicated experts (replicated_experts.py) share.

Under tensor parallelism each tp rank holds a slice of every expert's width (gate/up split by
output columns, down by input rows, as the dense MLP) and computes on the same tokens, so its
output is a partial sum. `local_map` knows nothing of that: it wraps the local output with the
placements given and hands back the gradients of the local inputs as they are. So the tp ranks'
outputs are summed on the way out, and the gradients of the tokens and of the gate weights (each
rank's share, through its slice of the experts) on the way back in, as Megatron's f/g operators
do; so are the gradients of the expert tensors whole on every tp rank (LoRA factors beside a split
base). Without the backward sum each tp rank updated its (replicated) router from its own half of
the gradient, the routers drifted apart after the first step and the ranks routed the same
tokens to different experts.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer


class _IntoTensorParallel(PyLayer):
    """Identity forward; the gradient is summed over the tp ranks (each has its slice's share)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad


class _OutOfTensorParallel(PyLayer):
    """The tp ranks' partial sums added up; the gradient passes unchanged to every rank."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallelExperts:
    """The tp ranks that split the routed experts' width (group None: the whole job); axis: the
    tp dim of the mesh."""

    def __init__(self, group, axis: int):
        self.group, self.axis = group, axis

    def _sum_grad(self, grad: paddle.Tensor) -> paddle.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=self.group)
        return grad

    def hook_whole_weights(self, weights: list[paddle.Tensor], placements: list[list]) -> None:
        """A weight whole on every tp rank (a LoRA factor or DoRA magnitude beside a split base)
        gets each rank's share of its gradient, through that rank's slice: summed over the tp ranks."""
        for w, pl in zip(weights, placements):
            if not w.stop_gradient and pl[self.axis].is_replicated():
                w.register_hook(self._sum_grad)

    def into(self, x: paddle.Tensor) -> paddle.Tensor:
        return _IntoTensorParallel.apply(x, self.group) if not x.stop_gradient else x

    def out_of(self, y: paddle.Tensor) -> paddle.Tensor:
        return _OutOfTensorParallel.apply(y, self.group)

    @paddle.no_grad()
    def sum(self, t: paddle.Tensor) -> paddle.Tensor:
        """A non-differentiable sum over the tp ranks (DoRA's column norms of a row-split weight)."""
        t = t.contiguous().clone()
        dist.all_reduce(t, group=self.group)
        return t


def run_local(
    fn,
    mesh,
    x,
    topk_idx,
    topk_weight,
    keep,
    params: dict,
    on_weights: Callable[[list], None] | None = None,
    tensor: TensorParallelExperts | None = None,
) -> paddle.Tensor:
    """fn(x, topk_idx, topk_weight, keep, params) on this process's shards of the (dist) tensors;
    the result is placed as x (its rows are this process's tokens). A partial x is summed first
    (the experts need the whole activations). on_weights(local weights) runs before fn. tensor:
    the experts are split over these tp ranks (see the module docstring)."""
    if any(p.is_partial() for p in x.placements):
        x = dist.reshard(x, x.process_mesh, [dist.Replicate() if p.is_partial() else p for p in x.placements])
    names = list(params)
    lead = [x, topk_idx, topk_weight] + ([keep] if keep is not None else [])

    def local(*args):
        k = args[3] if keep is not None else None
        weights = list(args[len(lead) :])
        if on_weights is not None:
            on_weights(weights)
        if tensor is None:
            return fn(args[0], args[1], args[2], k, dict(zip(names, weights)))
        tensor.hook_whole_weights(weights, [params[n].placements for n in names])
        y = fn(tensor.into(args[0]), args[1], tensor.into(args[2]), k, dict(zip(names, weights)))
        return tensor.out_of(y)

    args = lead + [params[n] for n in names]
    return dist.local_map(
        local,
        out_placements=[list(x.placements)],
        process_mesh=mesh,
        in_placements=[list(t.placements) for t in args],
    )(*args)
