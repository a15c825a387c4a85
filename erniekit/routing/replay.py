"""MoE routing replay for RL: make a training forward use (or just compare with) the experts
chosen while the rollout was sampled, so policy ratios measure the policy, not routing drift."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import paddle

from erniekit.nn.moe import RoutingReference


def _moe_layers(model) -> list:
    return model.moe_layers() if hasattr(model, "moe_layers") else []


@contextlib.contextmanager
def routing_reference(model, routing: list[np.ndarray] | None, mask: np.ndarray | None, force: bool) -> Iterator[None]:
    """Within the block, every MoE layer compares its routing of each masked token with the
    recorded one ([B, S, k] per layer, same token layout as the forward) and, with force, uses it."""
    layers = _moe_layers(model)
    if routing is None or not layers:
        yield
        return
    m = paddle.to_tensor(mask.reshape(-1).astype(bool))
    for layer, r in zip(layers, routing):
        layer.routing_reference = RoutingReference(paddle.to_tensor(r.reshape(-1, r.shape[-1])), m, force)
        layer.last_changed = None
    try:
        yield
    finally:
        for layer in layers:
            layer.routing_reference = None


def changed_counts(model) -> tuple[int, int]:
    """(token-layer pairs whose expert set differed from the recorded one, pairs compared) in the
    last forward run under `routing_reference`."""
    changed = total = 0
    for layer in _moe_layers(model):
        if layer.last_changed is not None:
            changed += layer.last_changed[0]
            total += layer.last_changed[1]
    return changed, total
