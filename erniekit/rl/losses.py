"""Policy-gradient losses on per-token log-probabilities (formulas in docs/rl.md)."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F


@paddle.no_grad()
def token_entropy(logits: paddle.Tensor, temperature: float = 1.0) -> paddle.Tensor:
    """H(softmax(logits / T)) per position [B, S], for logging."""
    x = logits.astype("float32") / temperature
    logp = F.log_softmax(x, axis=-1)
    return -(paddle.exp(logp) * logp).sum(-1)


def k3_kl(logp: paddle.Tensor, ref_logp: paddle.Tensor) -> paddle.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman): unbiased,
    always >= 0, evaluated on tokens sampled from pi."""
    d = ref_logp - logp
    return paddle.exp(d) - d - 1.0


def clipped_surrogate(
    logp: paddle.Tensor, old_logp: paddle.Tensor, adv: paddle.Tensor, eps_low: float, eps_high: float
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """PPO/GRPO clipped objective per token, as a loss (to minimise):

        ratio = exp(logp - old_logp)
        loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

    eps_high > eps_low is DAPO's clip-higher. Returns (loss, ratio, clipped) where clipped marks
    tokens whose gradient the clip removed (ratio beyond the bound on the side A pushes it)."""
    ratio = paddle.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped_obj = paddle.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -paddle.minimum(unclipped, clipped_obj)
    was_clipped = (clipped_obj < unclipped).astype("float32")
    return loss, ratio, was_clipped


def clipped_value_loss(
    values: paddle.Tensor, old_values: paddle.Tensor, returns: paddle.Tensor, clip: float
) -> paddle.Tensor:
    """0.5 * max((V - R)^2, (old_V + clip(V - old_V, -c, c) - R)^2) per token (PPO value clipping)."""
    v_clipped = old_values + paddle.clip(values - old_values, -clip, clip)
    a, b = values - returns, v_clipped - returns
    return 0.5 * paddle.maximum(a * a, b * b)


def aggregate(per_token: paddle.Tensor, mask: paddle.Tensor, mode: str) -> paddle.Tensor:
    """Summed loss for the loop to divide by `units(mask, mode)`:
    token: sum over every completion token (DAPO; divided by the step's token count);
    sequence: each sequence's mean over its tokens, summed over sequences (GRPO paper)."""
    if mode == "token":
        return (per_token * mask).sum()
    n = paddle.clip(mask.sum(-1), min=1.0)
    return ((per_token * mask).sum(-1) / n).sum()


def units(mask: np.ndarray, mode: str) -> int:
    """Normaliser of `aggregate`: trained tokens (token) or sequences with a trained token (sequence)."""
    return int(mask.sum()) if mode == "token" else int((mask.sum(-1) > 0).sum())
