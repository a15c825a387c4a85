"""Running a MoE layer's expert function on this process's local tensors inside `dist.local_map`:
what expert parallelism (expert_exchange.py) and replicated experts (replicated_experts.py) share."""

from __future__ import annotations

from collections.abc import Callable

import paddle
import paddle.distributed as dist


def run_local(
    fn, mesh, x, topk_idx, topk_weight, keep, params: dict, on_weights: Callable[[list], None] | None = None
) -> paddle.Tensor:
    """fn(x, topk_idx, topk_weight, keep, params) on this process's shards of the (dist) tensors;
    the result is placed as x (its rows are this process's tokens). A partial x is summed first
    (the experts need the whole activations). on_weights(local weights) runs before fn."""
    if any(p.is_partial() for p in x.placements):
        x = dist.reshard(x, x.process_mesh, [dist.Replicate() if p.is_partial() else p for p in x.placements])
    names = list(params)
    lead = [x, topk_idx, topk_weight] + ([keep] if keep is not None else [])

    def local(*args):
        k = args[3] if keep is not None else None
        weights = list(args[len(lead) :])
        if on_weights is not None:
            on_weights(weights)
        return fn(args[0], args[1], args[2], k, dict(zip(names, weights)))

    args = lead + [params[n] for n in names]
    return dist.local_map(
        local,
        out_placements=[list(x.placements)],
        process_mesh=mesh,
        in_placements=[list(t.placements) for t in args],
    )(*args)
