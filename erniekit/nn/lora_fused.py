"""PEFT's fused-expert LoRA layout (transformers >= 5), as tensor conversions.

transformers 5 stores ERNIE 4.5 MoE experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] (gate rows first, then up) and `mlp.experts.down_proj` [E, H, I] (torch's [out, in]
per expert), and PEFT adapts them with `target_parameters` (peft/tuners/lora/layer.py
`ParamWrapper`): for rank R it holds `lora_A.weight` [E*R, in] and `lora_B.weight` [out, R*E] and
adds, per expert e, an independent rank-R update `s * B_e @ A_e` with

    A_e = lora_A.weight[e*R:(e+1)*R, :]                 (expert-major rows)
    B_e = lora_B.weight.reshape(out, R, E)[:, :, e]     (rank-major, expert-minor columns)

Our adapters hold per-expert, per-projection factors (A [E, in, r], B [E, r, out], Paddle's
orientation). gate and up adapted separately at rank r are exactly one rank-2r fused update
(A stacked, B block-diagonal; PEFT's own v4 -> v5 conversion does the same); a fused update of
rank R is exactly gate and up sharing A at rank R. No module here imports erniekit.nn.lora.
"""

from __future__ import annotations

import importlib.metadata
import re

import paddle

PEFT_LAYOUTS = ("auto", "fused", "per_expert")
# used when transformers is not installed: the layout of the transformers releases current now
DEFAULT_PEFT_LAYOUT = "fused"
# Names PEFT's v4 -> v5 conversion rewrites in `target_modules` of an ernie4_5_moe model
# (peft/utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING["qwen2_moe"]): a
# target_modules entry ending in one of them is turned into the expert parameter, so the dense and
# shared-expert Linears of that name can only be targeted as parameters (`...gate_proj.weight`).
PEFT_REMAPPED_LEAVES = ("gate", "gate_proj", "up_proj", "down_proj")
GATE_UP, DOWN = "gate_up_proj", "down_proj"
FUSED_PARAMS = (GATE_UP, DOWN)  # definition order in transformers' experts module = PEFT's nesting order
FUSED_PROJS = {GATE_UP: ("gate_proj", "up_proj"), DOWN: ("down_proj",)}  # our projections in each


def resolve_layout(layout: str) -> str:
    """'fused' or 'per_expert': `auto` follows the installed transformers (>= 5 fuses experts)."""
    if layout != "auto":
        return layout
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return DEFAULT_PEFT_LAYOUT
    major = re.match(r"\d+", version)
    return "fused" if major is None or int(major.group()) >= 5 else "per_expert"


def wrapper_prefixes(experts: str, params: list[str]) -> dict[str, str]:
    """Tensor-name prefix of each targeted fused parameter of the experts module `experts`: PEFT
    nests one ParamWrapper per parameter in definition order, the last one outermost, so the
    inner ones are reached through `.base_layer`."""
    ordered = [p for p in FUSED_PARAMS if p in params]
    return {p: experts + ".base_layer" * (len(ordered) - 1 - i) for i, p in enumerate(ordered)}


def pack(a_t: paddle.Tensor, b_t: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Per-expert torch-orientation factors A [E, R, in], B [E, out, R] -> ParamWrapper's
    lora_A.weight [E*R, in], lora_B.weight [out, R*E]."""
    E, R, fan_in = a_t.shape
    return a_t.reshape([E * R, fan_in]), b_t.transpose([1, 2, 0]).reshape([b_t.shape[1], R * E])


def unpack(lora_a: paddle.Tensor, lora_b: paddle.Tensor, num_experts: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Inverse of `pack`: A [E, R, in], B [E, out, R]."""
    R = lora_a.shape[0] // num_experts
    a_t = lora_a.reshape([num_experts, R, lora_a.shape[1]])
    return a_t, lora_b.reshape([lora_b.shape[0], R, num_experts]).transpose([2, 0, 1])


def fuse_gate_up(
    gate: tuple[paddle.Tensor, paddle.Tensor] | None, up: tuple[paddle.Tensor, paddle.Tensor] | None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(A [E, r, H], B [E, I, r]) of gate and/or up -> the fused (A [E, R, H], B [E, 2I, R]):
    both at rank r give R = 2r with B block-diagonal; one alone gives R = r, the other half of B zero."""
    if gate is not None and up is not None:
        (ag, bg), (au, bu) = gate, up
        zg = paddle.zeros([bg.shape[0], bg.shape[1], au.shape[1]], dtype=bg.dtype)
        zu = paddle.zeros([bu.shape[0], bu.shape[1], ag.shape[1]], dtype=bu.dtype)
        b = paddle.concat([paddle.concat([bg, zg], axis=2), paddle.concat([zu, bu], axis=2)], axis=1)
        return paddle.concat([ag, au], axis=1), b
    a, b = gate if gate is not None else up
    zero = paddle.zeros_like(b)
    return a, paddle.concat([b, zero] if gate is not None else [zero, b], axis=1)


def split_gate_up(
    a_t: paddle.Tensor, b_t: paddle.Tensor, r: int
) -> tuple[tuple[paddle.Tensor, paddle.Tensor], tuple[paddle.Tensor, paddle.Tensor]]:
    """A fused (A [E, R, H], B [E, 2I, R]) -> gate and up (A, B [E, I, rank]), exactly: a rank-2r
    update whose B is block-diagonal (what `fuse_gate_up` writes) splits back into two rank-r ones;
    any other is gate and up sharing A at rank R."""
    R, inter = a_t.shape[1], b_t.shape[1] // 2
    top, bottom = b_t[:, :inter], b_t[:, inter:]
    if R == 2 * r and not bool((top[:, :, r:] != 0).any()) and not bool((bottom[:, :, :r] != 0).any()):
        return (a_t[:, :r], top[:, :, :r]), (a_t[:, r:], bottom[:, :, r:])
    return (a_t, top), (a_t, bottom)


def pattern_regex(pat: str) -> re.Pattern:
    """A rank_pattern / alpha_pattern key as PEFT matches it: the end of a name at a '.' boundary
    (re.error for a key that is no regex: the adapter config's reader names it)."""
    return re.compile(rf"(.*\.)?({pat})$")


def pattern_value(patterns: dict | None, key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first
    pattern that matches the end of `key` at a '.' boundary, else the default."""
    for pat, value in (patterns or {}).items():
        if pattern_regex(pat).match(key):
            return value
    return default


def peft_list(known: list[str], adapted: set[str], parts: int) -> list[str]:
    """A PEFT target list (an entry selects a name equal to it or ending in '.' + it) that selects
    exactly `adapted` among `known`: the last `parts` dotted components when they do, else full names."""
    suffixes = list(dict.fromkeys(".".join(n.split(".")[-parts:]) for n in known if n in adapted))

    def hit(n: str) -> bool:
        return any(n == s or n.endswith("." + s) for s in suffixes)

    if {n for n in known if hit(n)} == adapted:
        return suffixes
    return [n for n in known if n in adapted]


def peft_selects(targets, key: str) -> bool:
    """Whether a PEFT `target_modules` / `target_parameters` value selects `key` (a string is a
    regex fullmatched against it, a list matches a name or a '.'-suffix)."""
    if not targets:
        return False
    if isinstance(targets, str):
        if targets == "all-linear":
            return key != "lm_head"
        return re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith("." + t) for t in targets)
