"""Which modules LoRA adapts: the target patterns and how names match them, without Paddle.

apply_lora (erniekit/nn/lora.py) adapts the modules it builds; the planner
(erniekit/distributed/lora_cost.py) counts the same modules from a model config, for models too
large to build. Both match names here, so they agree on what a pattern selects and on its errors.
"""

from __future__ import annotations

import re

from erniekit.errors import ConfigError

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# One pattern, so the default fits dense and MoE models alike (each pattern must match something):
# attention, dense MLP, shared experts and routed experts (`mlp.experts`, all three projections).
DEFAULT_TARGET_MODULES = [r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|experts)"]


def hf_experts_name(name: str) -> str:
    """A modality's routed-experts module (`mlp.experts_1`) under the name checkpoints give every
    modality's experts (`mlp.experts`)."""
    return re.sub(r"\.experts_\d+$", ".experts", name)


def module_sample(names: list[str], n: int = 12) -> str:
    """One name per shape (layer indices collapsed), so the sample shows every kind of module."""
    seen: dict[str, str] = {}
    for name in names:
        seen.setdefault(re.sub(r"\.\d+(\.|$)", r".N\1", name), name)
    out = list(seen.values())
    return ", ".join(out[:n]) + (", ..." if len(out) > n else "")


def compile_target(pattern: str, where: str = "lora_target_modules") -> re.Pattern:
    """The compiled target pattern; one line naming it (and `where` it came from) when it is no regex."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{where}: pattern {pattern!r} is not a valid regex ({e}); fix the pattern") from None
    try:  # adapter_config.json joins the patterns into one: a global flag there is an error
        re.compile(f"(?:{pattern})")
    except re.error as e:
        raise ConfigError(
            f"{where}: pattern {pattern!r} cannot be combined with others ({e}); write a flag for a group, "
            "e.g. (?i:q_proj), not (?i) for the whole pattern"
        ) from None
    return compiled


class TargetMatcher:
    """re.fullmatch of module names against the target patterns, remembering which pattern matched
    something (a pattern that matches nothing is a mistake to name)."""

    def __init__(self, patterns: list[str], where: str = "lora_target_modules"):
        self.patterns = list(patterns)
        self._compiled = [compile_target(p, where) for p in self.patterns]
        self._hit = [False] * len(self.patterns)

    def __call__(self, name: str) -> bool:
        ok = [bool(p.fullmatch(name)) for p in self._compiled]
        self._hit = [h or o for h, o in zip(self._hit, ok)]
        return any(ok)

    def unmatched(self) -> list[str]:
        return [p for p, h in zip(self.patterns, self._hit) if not h]
