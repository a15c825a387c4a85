"""Sampling options, free of paddle so the CLI can validate them before importing it.

Every value is checked here too (finite, in range), not only at the HTTP edge: a NaN temperature
that slipped into the shared decode step would otherwise poison its neighbours' step."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


def _finite(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name}={v!r} must be a finite number")


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # OpenAI's penalties over the tokens generated so far, and additive logit biases by token id
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, numbers.Integral)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**63)")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                raise ValueError(f"logit_bias key {tok!r} must be a token id (an integer >= 0)")
            _finite(f"logit_bias[{tok}]", bias)
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{tok}]={bias} must be in [-100, 100]")

    @property
    def adjusts_logits(self) -> bool:
        """True when the row's logits need more than a plain argmax / softmax."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0
