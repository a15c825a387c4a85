"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math


def lr_at(
    step: int, total: int, peak: float, kind: str, warmup: int, min_lr: float = 0.0, decay_ratio: float = 0.1
) -> float:
    """LR for optimizer step `step` (0-based) of `total`.

    - cosine: linear warmup, then half-cosine from peak to min_lr.
    - linear: linear warmup, then linear decay to min_lr.
    - constant: linear warmup, then peak.
    - wsd (warmup-stable-decay): warmup, constant peak, then a linear decay to min_lr over the
      last `decay_ratio` of the steps.
    """
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    if kind == "wsd":
        decay_steps = max(1, int(round(total * decay_ratio)))
        start = total - decay_steps
        if step < start:
            return peak
        frac = min(1.0, (step - start + 1) / decay_steps)
        return peak + (min_lr - peak) * frac
    span = max(1, total - warmup)
    frac = min(1.0, (step - warmup) / span)
    if kind == "linear":
        return peak + (min_lr - peak) * frac
    if kind == "cosine":
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")
