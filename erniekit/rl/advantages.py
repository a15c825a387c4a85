"""Advantages: group-relative (GRPO) and generalised advantage estimation (PPO), in numpy.

Both run once per rollout batch on small arrays; GAE is vectorised with a discount matrix
instead of a Python loop over time steps.
"""

from __future__ import annotations

import numpy as np


def group_advantages(
    rewards: np.ndarray, num_generations: int, scale: bool = True, eps: float = 1e-4
) -> tuple[np.ndarray, np.ndarray]:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps), or r_i - mean(group) with scale=False
    (Dr. GRPO). rewards [B] with the G samples of a prompt adjacent; std is the sample std
    (ddof=1, as TRL). Returns (advantages [B], group std broadcast to [B])."""
    r = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    centred = r - r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, ddof=1, keepdims=True) if num_generations > 1 else np.zeros_like(r[:, :1])
    adv = centred / (std + eps) if scale else centred
    return adv.reshape(-1), np.broadcast_to(std, r.shape).reshape(-1)


def gae(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over completion tokens.

    rewards, values, mask: [B, N]; mask is a prefix of ones (the tokens of each completion).
    delta_t = r_t + gamma * V_{t+1} - V_t (V past the last token = 0: the episode ends there),
    A_t = sum_{l>=0} (gamma * lam)^l delta_{t+l}, returns R_t = A_t + V_t. Masked positions get 0.
    """
    m = mask.astype(np.float64)
    v = values.astype(np.float64) * m
    nxt = np.concatenate([v[:, 1:], np.zeros_like(v[:, :1])], axis=1)  # V_{t+1}, 0 after the last token
    delta = (rewards * m + gamma * nxt - v) * m
    n = delta.shape[1]
    s, t = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    discount = np.where(s >= t, (gamma * lam) ** np.maximum(s - t, 0), 0.0)  # D[s, t] = (gl)^(s-t), s >= t
    adv = (delta @ discount) * m
    return adv, (adv + v) * m
