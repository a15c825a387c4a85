"""What LoRA trains, counted from a model config without building the model, for the planner.

`apply_lora` (erniekit/nn/lora.py) wraps the Linear and routed-experts modules whose names its
target patterns match and freezes every base parameter. A 21B model cannot be built to count
that, so this module lists the modules the model would have (`model_modules`: names and shapes
as `named_sublayers` gives them), matches them as `apply_lora` does (`adapted`), and sums what the
adapters add (`count_adapters`): their parameters (split as the planner splits the base: over
tp and pp, routed experts over ep), their tensors, and per decoder layer the forward FLOPs,
saved activations and op launches of their two small GEMMs. The planner turns that into
gradients, optimizer state and gradient traffic for the adapters only (planner.py).
tests/unit/distributed/test_lora_cost.py checks the list and the counts against built models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from erniekit.errors import ConfigError
from erniekit.nn.lora_targets import DEFAULT_TARGET_MODULES, TargetMatcher, hf_experts_name, module_sample


@dataclass(frozen=True)
class Module:
    """A module `apply_lora` may adapt: a Linear (one projection named "") or a routed-experts
    stack (three projections, `experts` of them from global index `offset`)."""

    name: str
    projs: tuple[tuple[str, int, int], ...]  # (projection, fan_in, fan_out)
    part: str  # attn | mlp (dense MLP, shared experts) | experts (routed) | head | other (MTP, vision)
    layer: int = -1  # the trunk's decoder layer; -1 outside it
    experts: int = 0
    offset: int = 0


def _linear(name: str, fan_in: int, fan_out: int, part: str, layer: int = -1) -> Module:
    return Module(name, (("", fan_in, fan_out),), part, layer)


def _decoder(prefix: str, c, moe: bool, layer: int) -> list[Module]:
    """The modules of one decoder layer, in the order the model registers them."""
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = [("q_proj", H, q), ("k_proj", H, kv), ("v_proj", H, kv), ("o_proj", q, H)]
    out = [_linear(f"{prefix}.self_attn.{n}", i, o, "attn", layer) for n, i, o in attn]
    if not moe:
        return out + _mlp(f"{prefix}.mlp", H, c.intermediate_size, layer)
    offset = 0
    for m, (n, size) in enumerate(zip(c.experts_per_modality, c.expert_sizes)):
        projs = (("gate_proj", H, size), ("up_proj", H, size), ("down_proj", size, H))
        name = f"{prefix}.mlp.experts" + (f"_{m}" if m else "")
        out.append(Module(name, projs, "experts", layer, n, offset))
        offset += n
    if c.moe_num_shared_experts:
        out += _mlp(f"{prefix}.mlp.shared_experts", H, c.expert_sizes[0] * c.moe_num_shared_experts, layer)
    return out


def _mlp(prefix: str, H: int, inter: int, layer: int) -> list[Module]:
    shapes = (("gate_proj", H, inter), ("up_proj", H, inter), ("down_proj", inter, H))
    return [_linear(f"{prefix}.{n}", i, o, "mlp", layer) for n, i, o in shapes]


def _vision(c) -> list[Module]:
    """The vision transformer's and the resampler's Linears (ERNIE-4.5-VL; none for a text model)."""
    v = getattr(c, "vision", None)
    if v is None:
        return []
    d, inner = v.hidden_size, v.intermediate_size
    out = [_linear("vision_model.patch_embed.proj", v.in_channels * v.patch_size**2, d, "other")]
    for j in range(v.depth):
        b = f"vision_model.blocks.{j}"
        out += [_linear(f"{b}.attn.qkv", d, 3 * d, "other"), _linear(f"{b}.attn.proj", d, d, "other")]
        out += [_linear(f"{b}.mlp.fc1", d, inner, "other"), _linear(f"{b}.mlp.fc2", inner, d, "other")]
    sp = d * v.spatial_merge_size**2
    shapes = [
        ("spatial_linear.fc1", sp, sp),
        ("spatial_linear.fc2", sp, sp),
        ("temporal_linear.fc1", sp * v.temporal_merge_size, sp),
        ("temporal_linear.fc2", sp, sp),
        ("mlp", sp, c.hidden_size),
    ]
    return out + [_linear(f"resampler_model.{n}", i, o, "other") for n, i, o in shapes]


def model_modules(c) -> list[Module]:
    """Every Linear and routed-experts module of the model config `c` (Ernie4_5Config or the VL
    one), as the built model names them: the trunk's layers, an untied head, the MTP blocks
    (dense, erniekit/nn/mtp.py), the vision transformer and resampler."""
    out = []
    for i in range(c.num_hidden_layers):
        out += _decoder(f"model.layers.{i}", c, c.is_moe and c.is_moe_layer(i), i)
    if not c.tie_word_embeddings:
        out.append(_linear("lm_head", c.hidden_size, c.vocab_size, "head"))
    depths = range(c.num_nextn_predict_layers)
    out += [_linear(f"mtp.mtp_linear_proj.{j}", 2 * c.hidden_size, c.hidden_size, "other") for j in depths]
    for j in depths:
        out += [replace(m, part="other") for m in _decoder(f"mtp.mtp_block.{j}", c, False, -1)]
    return out + _vision(c)


def adapted(c, patterns: list[str]) -> list[tuple[Module, tuple[tuple[str, int, int], ...]]]:
    """(module, its adapted projections) for every module the target `patterns` select, matched as
    erniekit/nn/lora.py `_plan` matches them (re.fullmatch; a routed-experts projection by the
    stack's name or by every per-expert name `...experts.<e>.<proj>`); the same errors."""
    match = TargetMatcher(patterns)
    modules = model_modules(c)
    out = []
    for m in modules:
        if not m.experts:
            if match(m.name):
                out.append((m, m.projs))
            continue
        whole = match(m.name) or match(hf_experts_name(m.name))
        projs = tuple(p for p in m.projs if _expert_proj_adapted(m, p[0], whole, match))
        if projs:
            out.append((m, projs))
    missing = match.unmatched()
    if missing:
        raise ConfigError(
            f"lora_target_modules: pattern {missing[0]!r} matches no module of the model (re.fullmatch on module "
            f"names: {module_sample([m.name for m in modules])}); fix the pattern"
        )
    return out


def _expert_proj_adapted(m: Module, proj: str, whole: bool, match) -> bool:
    hf = hf_experts_name(m.name)
    per = [match(f"{hf}.{m.offset + e}.{proj}") for e in range(m.experts)]
    if any(per) and not all(per) and not whole:
        raise ConfigError(
            f"lora_target_modules select only some experts of {m.name}.*.{proj}; adapters cover all experts "
            f"of a projection: match {m.name} or every {m.name}.<e>.{proj}"
        )
    return whole or all(per)


@dataclass(frozen=True)
class LayerAdapters:
    """What one decoder layer's adapters add per token to its LayerCost (planner.py)."""

    attn_flops: float = 0.0
    mlp_flops: float = 0.0  # dense MLP, shared experts, and k routed experts
    routed: float = 0.0  # of mlp_flops / 2: the routed experts' adapter weights one token multiplies
    attn_saved: float = 0.0  # float32 elements the backward keeps
    mlp_saved: float = 0.0
    attn_ops: int = 0  # op launches, forward
    mlp_ops: int = 0  # the dense MLP's and shared experts', and each routed group's fixed ones
    expert_ops: int = 0  # the routed experts' per-expert launches, of all experts: a rank runs its E / ep


@dataclass(frozen=True)
class Adapters:
    """What a LoRA run trains: the adapters (the base is frozen), with the counts the planner needs."""

    rank: int
    params_dense: int  # adapters of modules split over tp (everything but routed experts)
    params_experts: int  # adapters of routed experts (split over ep, whole on every tp rank)
    tensors: int  # adapter parameter tensors: A and B (and DoRA's magnitude) per adapted module
    layers: tuple[LayerAdapters, ...]  # per decoder layer of the trunk
    head_flops: float = 0.0  # an untied head's adapter, forward FLOPs per token

    @property
    def params(self) -> int:
        return self.params_dense + self.params_experts


def count_adapters(
    c, rank: int, patterns: list[str] | None = None, dora: bool = False, dropout: float = 0.0
) -> Adapters:
    """The adapters `apply_lora` would add to the model of config `c` for rank r, target patterns
    (None: erniekit/nn/lora.py's default), DoRA and adapter dropout."""
    layers = [_LayerSum() for _ in range(c.num_hidden_layers)]
    dense = experts = tensors = 0
    head = 0.0
    for m, projs in adapted(c, list(patterns or DEFAULT_TARGET_MODULES)):
        E = max(m.experts, 1)
        for _, fan_in, fan_out in projs:
            n = E * (rank * (fan_in + fan_out) + (fan_out if dora else 0))
            if m.experts:
                experts += n
            else:
                dense += n
            tensors += 3 if dora else 2
            if m.part == "head":
                head += 2.0 * rank * (fan_in + fan_out)
            elif m.layer >= 0:
                layers[m.layer].add(m, rank, fan_in, fan_out, c.moe_k, dropout)
    return Adapters(rank, dense, experts, tensors, tuple(s.done() for s in layers), head)


class _LayerSum:
    """One layer's adapter costs while they are summed; routed experts per modality group, of which
    a token runs k experts of its own (the largest group bounds it, as planner.layer_costs does)."""

    def __init__(self) -> None:
        self.attn = [0.0, 0.0, 0]  # flops, saved, ops
        self.mlp = [0.0, 0.0, 0]
        self.routed: dict[str, list] = {}  # stack name -> [weights per token, saved, ops, per-expert ops]

    def add(self, m: Module, r: int, fan_in: int, fan_out: int, k: int, dropout: float) -> None:
        # x A then (x A) B: the backward keeps x A ([r]); with dropout also the dropped copy of x
        # and its mask (1 byte an element: a quarter of a float32)
        saved = r + (1.25 * fan_in if dropout > 0 else 0.0)
        if m.experts:  # per expert group: two GEMMs and a scale each, and the split, unbind, concat, add
            acc = self.routed.setdefault(m.name, [0.0, 0.0, 0, 0])
            acc[0] += k * r * (fan_in + fan_out)
            acc[1] += k * saved
            acc[2] += 5
            acc[3] += (4 if dropout > 0 else 3) * m.experts  # a loop over the experts that got rows
            return
        acc = self.attn if m.part == "attn" else self.mlp
        acc[0] += 2.0 * r * (fan_in + fan_out)
        acc[1] += saved
        acc[2] += 5 if dropout > 0 else 4  # (dropout,) two GEMMs, the scale, the add

    def done(self) -> LayerAdapters:
        routed = max(self.routed.values(), key=lambda a: a[0], default=[0.0, 0.0, 0, 0])
        return LayerAdapters(
            attn_flops=self.attn[0],
            mlp_flops=self.mlp[0] + 2.0 * routed[0],
            routed=routed[0],
            attn_saved=self.attn[1],
            mlp_saved=self.mlp[1] + routed[1],
            attn_ops=self.attn[2],
            mlp_ops=self.mlp[2] + routed[2],
            expert_ops=routed[3],
        )


def trains_adapters(cfg) -> bool:
    """Whether a training config (normalised or as loaded: `lora` is a spelling of LoRA) trains LoRA adapters."""
    from erniekit.config.schema import FINE_TUNING

    return FINE_TUNING.get(str(cfg.fine_tuning).lower()) == "LoRA"


def adapters_from_config(cfg, c) -> Adapters:
    """The adapters a LoRA training config (lora_rank, lora_target_modules, use_dora, lora_dropout)
    adds to its model, of config `c`."""
    patterns = [cfg.lora_target_modules] if cfg.lora_target_modules else None
    return count_adapters(c, cfg.lora_rank, patterns, cfg.use_dora, cfg.lora_dropout)
