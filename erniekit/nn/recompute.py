"""Activation recompute (gradient checkpointing) for parts of a decoder layer.

Paddle's non-reentrant recompute (`fleet.utils.recompute(..., use_reentrant=False)`) runs the
forward normally, keeps only the inputs of the wrapped part, and runs the part a second time in
the backward to rebuild what autograd needs. The forward running with gradients matters here:
outputs a layer leaves on itself (the MoE router loss) keep their graph, which the reentrant
PyLayer version would cut. The second run must not repeat side effects that count (the MoE
load counts of the aux-loss-free bias update), so it is flagged: `recomputing()`.

Granularities (PaddleFormers' `recompute_granularity` names, plus `mlp`):
  full       the whole decoder layer
  full_attn  input norm + attention (projections, RoPE, attention core)
  core_attn  the attention core only: softmax(q k^T + mask) v
  mlp        post-attention norm + MLP or MoE block (router, experts, shared experts)
"""

from __future__ import annotations

from typing import Any, Callable

GRANULARITIES = ("full", "full_attn", "core_attn", "mlp")

_second_run = False
_inside = 0  # wrapped parts running now, first or second run


def recomputing() -> bool:
    """True while a wrapped part runs again in the backward pass."""
    return _second_run


def in_checkpoint() -> bool:
    """True while a wrapped part runs, in the forward or again in the backward: what it saves for
    the backward comes back from Paddle's recompute as new tensors over the second run's memory."""
    return _inside > 0


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), its activations recomputed in the backward instead of kept (args: tensors or None;
    at least one tensor must need a gradient)."""
    from paddle.distributed.fleet.utils import recompute

    calls = 0

    def run(*a):
        global _second_run, _inside
        nonlocal calls
        calls += 1
        prev, _second_run = _second_run, calls > 1
        _inside += 1
        try:
            return fn(*a)
        finally:
            _second_run = prev
            _inside -= 1

    return recompute(run, *args, use_reentrant=False)
