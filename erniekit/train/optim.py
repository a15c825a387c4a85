"""AdamW with decoupled weight decay on matrices only, and global-norm clipping we can log."""

from __future__ import annotations

import paddle


def build_optimizer(model: paddle.nn.Layer, cfg) -> paddle.optimizer.AdamW:
    params = [p for p in model.parameters() if not p.stop_gradient]
    no_decay = {p.name for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n or "embed_tokens" in n}
    return paddle.optimizer.AdamW(
        learning_rate=cfg.learning_rate,
        parameters=params,
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        epsilon=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        apply_decay_param_fun=lambda name: name not in no_decay,
    )


@paddle.no_grad()
def clip_grad_norm_(params: list[paddle.Tensor], max_norm: float) -> float:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; return the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = float(paddle.sqrt(paddle.add_n([paddle.sum(g.astype("float32") ** 2) for g in grads])))
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.scale_(coef)
    return norm
