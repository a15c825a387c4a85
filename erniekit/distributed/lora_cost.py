"""What LoRA trains, counted from a model config without building the model, for the planner.

`apply_lora` (erniekit/nn/lora.py) wraps the Linear and routed-experts modules whose names its
target patterns match and freezes every base parameter. A 21B model cannot be built to count
that, so this module lists the modules the model would have (`model_modules`: names and shapes
as `named_sublayers` gives them), matches them as `apply_lora` does (`adapted`), and sums what the
adapters add (`count_adapters`): their parameters (split as the planner splits the base: over
tp and pp, routed experts over ep, and over tp as runtime.py places them beside their base), their
tensors, the adapted base weights (held in `lora_base_dtype`), and per decoder layer, MTP token and image token the forward FLOPs, saved
activations and op launches of their two small GEMMs (with DoRA: its column scale and norms).
The planner turns that into gradients, optimizer state and gradient traffic for the adapters
only (planner.py).
tests/unit/distributed/test_lora_cost.py checks the list and the counts against built models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from erniekit.distributed.collective.layout import COLUMN_PARALLEL, ROW_PARALLEL, whole_over_tp
from erniekit.errors import ConfigError
from erniekit.nn.lora_targets import DEFAULT_TARGET_MODULES, TargetMatcher, hf_experts_name, module_sample


@dataclass(frozen=True)
class Module:
    """A module `apply_lora` may adapt: a Linear (one projection named "") or a routed-experts
    stack (three projections, `experts` of them from global index `offset`)."""

    name: str
    projs: tuple[tuple[str, int, int], ...]  # (projection, fan_in, fan_out)
    part: str  # attn | mlp (dense MLP, shared experts) | experts (routed) | head | mtp | vision
    layer: int = -1  # the trunk's decoder layer; -1 outside it
    experts: int = 0
    offset: int = 0
    rows: int = 1  # rows it runs per token (vision: per image token, the patches merged into it)


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
    out = [_linear("vision_model.patch_embed.proj", v.in_channels * v.patch_size**2, d, "vision")]
    for j in range(v.depth):
        b = f"vision_model.blocks.{j}"
        out += [_linear(f"{b}.attn.qkv", d, 3 * d, "vision"), _linear(f"{b}.attn.proj", d, d, "vision")]
        out += [_linear(f"{b}.mlp.fc1", d, inner, "vision"), _linear(f"{b}.mlp.fc2", inner, d, "vision")]
    # an image token is spatial_merge_size^2 patches of one frame (the resampler pairs the frame with
    # itself): the transformer runs that many rows for it, the resampler one
    out = [replace(m, rows=v.spatial_merge_size**2) for m in out]
    sp = d * v.spatial_merge_size**2
    shapes = [
        ("spatial_linear.fc1", sp, sp),
        ("spatial_linear.fc2", sp, sp),
        ("temporal_linear.fc1", sp * v.temporal_merge_size, sp),
        ("temporal_linear.fc2", sp, sp),
        ("mlp", sp, c.hidden_size),
    ]
    return out + [_linear(f"resampler_model.{n}", i, o, "vision") for n, i, o in shapes]


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
    out += [_linear(f"mtp.mtp_linear_proj.{j}", 2 * c.hidden_size, c.hidden_size, "mtp") for j in depths]
    for j in depths:
        out += [replace(m, part="mtp") for m in _decoder(f"mtp.mtp_block.{j}", c, False, -1)]
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


BASE_DTYPE_BYTES = {None: 4, "float32": 4, "bfloat16": 2, "float16": 2}  # lora_base_dtype -> bytes an element

# Routed experts split over tp by width (erniekit/distributed/collective/runtime.py `_EXPERT_TP_DIM`):
# gate/up by output columns, down by input rows. An adapter follows its base: of gate/up, B and
# DoRA's magnitude are split and A is whole on every tp rank; of down, A is split, B and the
# magnitude whole. (Not imported from runtime.py: planning imports no paddle.)
EXPERT_ROW_PROJS = ("down_proj",)
# Linears over tp (layout.py COLUMN_PARALLEL, ROW_PARALLEL and the head, by name): a column-parallel
# one's A, B and DoRA magnitude are split; a row-parallel one's and the head's A and B split, the
# magnitude ([out], one dim) whole; any other Linear (the vision model's, the MTP input projections) whole
TP_COLUMN = COLUMN_PARALLEL
TP_ROW = (*ROW_PARALLEL, "lm_head")


def linear_tp_kind(name: str) -> str:
    """How runtime.py places a Linear over tp: "column" (output split), "row" (input split) or "whole"."""
    if whole_over_tp(name):  # the vision model's, whatever its layers are called
        return "whole"
    if "lm_head" not in name and any(k in name for k in TP_COLUMN):
        return "column"
    return "row" if any(k in name for k in TP_ROW) else "whole"


def linear_whole_over_tp(name: str, r: int, fan_in: int, fan_out: int, dora: bool) -> tuple[int, int]:
    """(adapter elements, base elements) of a Linear that are whole on every tp rank."""
    kind = linear_tp_kind(name)
    if kind == "column":
        return 0, 0
    if kind == "row":
        return (fan_out if dora else 0), 0
    return r * (fan_in + fan_out) + (fan_out if dora else 0), fan_in * fan_out


def saved_whole_over_tp(kind: str, expert: bool, r: int, fan_in: int, fan_out: int, how: _How) -> tuple[float, float]:
    """(saved, GPU cast saved) float32 elements per row of one adapted projection that every tp rank
    keeps whole (the rest of `_LayerSum.add`'s count is split), as runtime.py places it (`kind`
    "column", "row" or "whole"; a routed expert's by its projection). Eager auto-parallel keeps an
    op's inputs as given, before its reshard (tools/measure_saved_activations.py --list): x A [r] is
    split beside a column-parallel Linear (A split by its r columns: measured at tp=2), whole beside a
    row-parallel one (a partial sum [T, r]) and in routed experts (gate/up A whole; down a partial
    sum); the dropped copy of the input and its mask, and a 16-bit base's cast input, whole where the
    input is (column: measured); DoRA's pre-scale output (and an expert's row scales) whole where the
    output is a partial sum of width H (row)."""
    whole_in = kind != "row"  # the input is whole on every tp rank (column-parallel, or no split)
    whole_out = kind != "column"  # the output is whole, or a partial sum of its full width
    saved = r if expert or whole_out else 0
    saved += 1.25 * fan_in if how.dropout > 0 and whole_in else 0.0
    saved += (2 if expert else 1) * fan_out if how.dora and whole_out else 0
    return saved, (0.5 * fan_in if how.half and whole_in else 0.0)


def expert_adapter_split(proj: str, r: int, fan_in: int, fan_out: int, dora: bool) -> tuple[int, int]:
    """(elements split over tp, elements whole on every tp rank) of one expert's adapter of `proj`."""
    a, b = r * fan_in, r * fan_out + (fan_out if dora else 0)  # A; B and the magnitude
    return (a, b) if proj in EXPERT_ROW_PROJS else (b, a)


@dataclass(frozen=True)
class LayerAdapters:
    """What one decoder layer's adapters add per token to its LayerCost (planner.py); also what one
    MTP token (`Adapters.mtp`) or image token (`Adapters.vision`) adds (attention parts and MLP
    parts summed as one there)."""

    attn_flops: float = 0.0
    mlp_flops: float = 0.0  # dense MLP, shared experts, and k routed experts
    routed: float = 0.0  # of mlp_flops / 2: the routed experts' adapter weights one token multiplies
    # of routed: those of tensors whole on every tp rank (gate/up A, down B), which each tp rank
    # multiplies in full (the rest is split over tp with the experts' width)
    routed_whole: float = 0.0
    attn_saved: float = 0.0  # float32 elements the backward keeps
    mlp_saved: float = 0.0
    attn_ops: int = 0  # op launches, forward
    mlp_ops: int = 0  # the dense MLP's and shared experts', and each routed group's fixed ones
    expert_ops: int = 0  # the routed experts' per-expert launches, of all experts: a rank runs its E / ep
    # a 16-bit base (lora_base_dtype): on GPU the base GEMM keeps its input cast to that dtype
    # (float32 elements: half the input); on CPU each call upcasts the weight to float32, in the
    # forward and again in the backward (erniekit/nn/lora.py `_UpcastMatmul`, which keeps the 16-bit
    # weight only): elements upcast per pass of a micro-batch, of modules split over tp / routed experts
    attn_cast_saved: float = 0.0
    mlp_cast_saved: float = 0.0
    # of attn_saved, mlp_saved, attn_cast_saved and mlp_cast_saved: what every tp rank keeps whole
    # (`saved_whole_over_tp`); the rest is split over tp
    attn_saved_whole: float = 0.0
    mlp_saved_whole: float = 0.0
    attn_cast_saved_whole: float = 0.0
    mlp_cast_saved_whole: float = 0.0
    attn_upcast: int = 0
    mlp_upcast: int = 0
    expert_upcast: int = 0


@dataclass(frozen=True)
class Adapters:
    """What a LoRA run trains: the adapters (the base is frozen), with the counts the planner needs."""

    rank: int
    params_dense: int  # adapters of modules split over tp (everything but routed experts)
    params_experts: int  # adapters of routed experts (split over ep; over tp: params_experts_split)
    tensors: int  # adapter parameter tensors: A and B (and DoRA's magnitude) per adapted module
    layers: tuple[LayerAdapters, ...]  # per decoder layer of the trunk
    head_flops: float = 0.0  # an untied head's adapter, forward FLOPs per token
    # the adapted base weights (the base held in `base_bytes` a element; the rest of the model and
    # the adapters in float32): elements of modules split over tp, and of routed experts
    base_bytes: int = 4
    base_dense: int = 0
    base_experts: int = 0
    mtp: LayerAdapters = LayerAdapters()  # all MTP blocks' adapters, per token
    vision: LayerAdapters = LayerAdapters()  # the vision transformer's and resampler's, per image token
    head_upcast: int = 0  # the head's (CPU, 16-bit base): elements per micro-batch, as layers' upcast
    # the largest single adapted base weight, whose float32 upcast the CPU's one reused buffer is
    # sized to (erniekit/nn/lora.py `_upcast`): of a Linear split over tp, of a Linear whole on every
    # tp rank, of one routed expert's projection (split over tp by width)
    base_largest: int = 0
    base_largest_whole: int = 0
    base_largest_expert: int = 0
    # DoRA: forward FLOPs per micro-batch of the column norms ||W + s A B|| (no gradient), and the
    # bytes the largest module's norm holds while it is computed (s A B, W + s A B and its square,
    # float32; a routed-experts projection: all its experts at once)
    dora_flops: float = 0.0
    dora_transient: float = 0.0  # of a Linear (split over tp)
    dora_transient_experts: float = 0.0  # of a routed-experts projection (split over ep and tp)
    # of params_experts: split over tp as well (gate/up: B and the magnitude; down: A); and the
    # routed-expert adapter tensors whole on every tp rank, whose gradients a hook sums over tp
    params_experts_split: int = 0
    tensors_experts_whole: int = 0
    # of params_dense and base_dense: whole on every tp rank (linear_whole_over_tp)
    params_dense_whole: int = 0
    base_dense_whole: int = 0

    @property
    def params(self) -> int:
        return self.params_dense + self.params_experts


def count_adapters(
    c,
    rank: int,
    patterns: list[str] | None = None,
    dora: bool = False,
    dropout: float = 0.0,
    base_dtype: str | None = None,
) -> Adapters:
    """The adapters `apply_lora` would add to the model of config `c` for rank r, target patterns
    (None: erniekit/nn/lora.py's default), DoRA, adapter dropout and the base's dtype
    (lora_base_dtype: None or float32, bfloat16, float16)."""
    if base_dtype not in BASE_DTYPE_BYTES:
        raise ConfigError(f"lora_base_dtype={base_dtype!r}: use null, bfloat16, float16 or float32")
    how = _How(rank, c.moe_k, dora, dropout, BASE_DTYPE_BYTES[base_dtype] < 4)
    layers = [_LayerSum(how) for _ in range(c.num_hidden_layers)]
    outside = {"mtp": _LayerSum(how), "vision": _LayerSum(how), "head": _LayerSum(how)}
    total = _Totals()
    for m, projs in adapted(c, list(patterns or DEFAULT_TARGET_MODULES)):
        for proj, fan_in, fan_out in projs:
            total.add(m, proj, rank, fan_in, fan_out, dora)
            sums = layers[m.layer] if m.layer >= 0 else outside.get(m.part)
            if sums is not None:
                sums.add(m, proj, fan_in, fan_out)
    head = outside["head"].done()
    return Adapters(
        rank,
        total.dense,
        total.experts,
        total.tensors,
        tuple(s.done() for s in layers),
        head_flops=head.attn_flops + head.mlp_flops,
        base_bytes=BASE_DTYPE_BYTES[base_dtype],
        base_dense=total.base_dense,
        base_experts=total.base_experts,
        mtp=outside["mtp"].done(),
        vision=outside["vision"].done(),
        head_upcast=head.attn_upcast + head.mlp_upcast,
        dora_flops=total.dora_flops,
        dora_transient=total.dora_transient[0],
        dora_transient_experts=total.dora_transient[1],
        params_experts_split=total.experts_split,
        tensors_experts_whole=total.experts_whole_tensors,
        params_dense_whole=total.dense_whole[0],
        base_dense_whole=total.dense_whole[1],
        base_largest=total.largest[0],
        base_largest_whole=total.largest[1],
        base_largest_expert=total.largest[2],
    )


class _Totals:
    """The model-wide sums: parameters and tensors of the adapters, the adapted base, DoRA's norms."""

    def __init__(self) -> None:
        self.dense = self.experts = self.tensors = self.base_dense = self.base_experts = 0
        self.experts_split = self.experts_whole_tensors = 0
        self.dense_whole = [0, 0]  # adapter and base elements of Linears whole on every tp rank
        self.dora_flops = 0.0
        self.dora_transient = [0.0, 0.0]  # a Linear's, a routed-experts projection's
        self.largest = [0, 0, 0]  # one adapted base weight's elements: Linear split over tp, whole, an expert's

    def add(self, m: Module, proj: str, r: int, fan_in: int, fan_out: int, dora: bool) -> None:
        E = max(m.experts, 1)
        n = E * (r * (fan_in + fan_out) + (fan_out if dora else 0))
        if m.experts:
            self.experts += n
            self.experts_split += E * expert_adapter_split(proj, r, fan_in, fan_out, dora)[0]
            # whole on every tp rank: gate/up A; down B (and the magnitude)
            self.experts_whole_tensors += 2 if dora and proj in EXPERT_ROW_PROJS else 1
            self.base_experts += E * fan_in * fan_out
            self.largest[2] = max(self.largest[2], fan_in * fan_out)
        else:
            self.dense += n
            self.base_dense += fan_in * fan_out
            whole = linear_whole_over_tp(m.name, r, fan_in, fan_out, dora)
            self.dense_whole = [self.dense_whole[0] + whole[0], self.dense_whole[1] + whole[1]]
            i = 1 if whole[1] else 0
            self.largest[i] = max(self.largest[i], fan_in * fan_out)
        self.tensors += 3 if dora else 2
        if dora:  # s A B [in, out] (a GEMM), W + it, its square, the column sums: every forward
            self.dora_flops += E * (2.0 * r + 3.0) * fan_in * fan_out
            i = 1 if m.experts else 0
            self.dora_transient[i] = max(self.dora_transient[i], 3.0 * 4 * E * fan_in * fan_out)


@dataclass(frozen=True)
class _How:
    rank: int
    k: int  # routed experts per token
    dora: bool
    dropout: float
    half: bool  # the base held in 16 bits


class _LayerSum:
    """One layer's adapter costs while they are summed; routed experts per modality group, of which
    a token runs k experts of its own (the largest group bounds it, as planner.layer_costs does)."""

    def __init__(self, how: _How) -> None:
        self.how = how
        # flops, saved, ops, cast saved, upcast elements, saved whole over tp, cast saved whole over tp
        self.attn = [0.0, 0.0, 0, 0.0, 0, 0.0, 0.0]
        self.mlp = [0.0, 0.0, 0, 0.0, 0, 0.0, 0.0]
        # stack name -> [weights per token, saved, ops, per-expert ops, upcast elements, cast saved,
        # weights per token of tensors whole on every tp rank, saved whole, cast saved whole]
        self.routed: dict[str, list] = {}

    def add(self, m: Module, proj: str, fan_in: int, fan_out: int) -> None:
        r, h = self.how.rank, self.how
        # x A then (x A) B: the backward keeps x A ([r]); with dropout also the dropped copy of x
        # and its mask (1 byte an element: a quarter of a float32)
        saved = r + (1.25 * fan_in if h.dropout > 0 else 0.0)
        upcast = fan_in * fan_out * max(m.experts, 1) if h.half else 0
        if m.experts:  # per expert group: two GEMMs and a scale each, and the split, unbind, concat, add
            whole = saved_whole_over_tp("row" if proj in EXPERT_ROW_PROJS else "column", True, r, fan_in, fan_out, h)
            acc = self.routed.setdefault(m.name, [0.0, 0.0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0])
            acc[0] += h.k * r * (fan_in + fan_out)
            acc[6] += h.k * r * (fan_out if proj in EXPERT_ROW_PROJS else fan_in)
            # DoRA: the pre-scale output and its per-row scales ([out] each) for the product's gradient
            acc[1] += h.k * (saved + (2 * fan_out if h.dora else 0))
            # DoRA: the norms (6), the scale, concat, product; a 16-bit base: split, unbind, concat
            acc[2] += 5 + (9 if h.dora else 0) + (3 if h.half else 0)
            # a loop over the experts that got rows (DoRA: an expand each; 16-bit: a cast and a GEMM each)
            acc[3] += (3 + (h.dropout > 0) + h.dora + 2 * h.half) * m.experts
            acc[4] += upcast
            acc[5] += h.k * 0.5 * fan_in if h.half else 0.0
            acc[7] += h.k * whole[0]
            acc[8] += h.k * whole[1]
            return
        whole = saved_whole_over_tp(linear_tp_kind(m.name), False, r, fan_in, fan_out, h)
        acc = self.attn if m.part == "attn" else self.mlp
        acc[0] += 2.0 * r * (fan_in + fan_out) * m.rows
        acc[1] += (saved + (fan_out if h.dora else 0)) * m.rows  # DoRA: the pre-scale output
        # (dropout,) two GEMMs, the scale, the add; DoRA: the norms (6), the scale, the product;
        # a 16-bit base: the cast (CPU: of the weight, GPU: of the input)
        acc[2] += 4 + (h.dropout > 0) + (8 if h.dora else 0) + h.half
        acc[3] += (0.5 * fan_in if h.half else 0.0) * m.rows
        acc[4] += upcast
        acc[5] += whole[0] * m.rows
        acc[6] += whole[1] * m.rows

    def done(self) -> LayerAdapters:
        routed = max(self.routed.values(), key=lambda a: a[0], default=[0.0, 0.0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0])
        return LayerAdapters(
            attn_flops=self.attn[0],
            mlp_flops=self.mlp[0] + 2.0 * routed[0],
            routed=routed[0],
            routed_whole=routed[6],
            attn_saved=self.attn[1],
            mlp_saved=self.mlp[1] + routed[1],
            attn_ops=self.attn[2],
            mlp_ops=self.mlp[2] + routed[2],
            expert_ops=routed[3],
            attn_cast_saved=self.attn[3],
            mlp_cast_saved=self.mlp[3] + routed[5],
            attn_saved_whole=self.attn[5],
            mlp_saved_whole=self.mlp[5] + routed[7],
            attn_cast_saved_whole=self.attn[6],
            mlp_cast_saved_whole=self.mlp[6] + routed[8],
            attn_upcast=self.attn[4],
            mlp_upcast=self.mlp[4],
            expert_upcast=sum(a[4] for a in self.routed.values()),
        )


def trains_adapters(cfg) -> bool:
    """Whether a training config (normalised or as loaded: `lora` is a spelling of LoRA) trains LoRA adapters."""
    from erniekit.config.schema import FINE_TUNING

    return FINE_TUNING.get(str(cfg.fine_tuning).lower()) == "LoRA"


def adapters_from_config(cfg, c) -> Adapters:
    """The adapters a LoRA training config (lora_rank, lora_target_modules, use_dora, lora_dropout,
    lora_base_dtype) adds to its model, of config `c`."""
    patterns = [cfg.lora_target_modules] if cfg.lora_target_modules else None
    return count_adapters(c, cfg.lora_rank, patterns, cfg.use_dora, cfg.lora_dropout, cfg.lora_base_dtype)
