"""LoRA / rsLoRA / DoRA / LoRA+ adapters for Paddle models, saved in the Hugging Face PEFT layout.

Adapted layers keep their base parameters under the same names (`...q_proj.weight`), so the
HF-layout checkpoint io and the optimizer's name-keyed state keep working, and
`merge_and_unload` gives back the original layer objects. Adapter tensors are stored in Paddle's
[in, out] orientation (A [in, r], B [r, out]; experts A [E, in, r], B [E, r, out]) and transposed
to PEFT's torch orientation (lora_A.weight [r, in], lora_B.weight [out, r]) on save/load.
Formulas and references: docs/lora.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from erniekit.errors import CheckpointError, ConfigError
from erniekit.nn.moe import StackedExperts
from erniekit.nn.rows import concat_rows, split_rows
from erniekit.utils.io import read_json_object

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_STATE_ATTR = "_erniekit_lora_state"

# One pattern, so the default fits dense and MoE models alike (each pattern must match something):
# attention, dense MLP, shared experts and routed experts (`mlp.experts`, all three projections).
DEFAULT_TARGET_MODULES = [r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|experts)"]


@dataclass
class LoraConfig:
    """Adapter hyper-parameters (PEFT names). `target_modules` are regexes, re.fullmatch'ed against
    module names (`model.layers.0.self_attn.q_proj`, `model.layers.1.mlp.experts`); a routed-experts
    projection is also selected when a pattern matches all its per-expert names
    (`model.layers.1.mlp.experts.<e>.gate_proj`), which is how PEFT configs are expressed."""

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    use_dora: bool = False  # weight-decomposed LoRA (magnitude * direction)
    lora_plus_scale: float = 1.0  # LoRA+: learning-rate multiplier of the B matrices
    base_dtype: str | None = None  # "bfloat16": hold frozen adapted base weights in bf16

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        checks = [
            (isinstance(self.r, int) and self.r > 0, f"r={self.r!r} must be a positive integer"),
            (self.lora_alpha > 0, f"lora_alpha={self.lora_alpha!r} must be > 0"),
            (0.0 <= self.lora_dropout < 1.0, f"lora_dropout={self.lora_dropout!r} must be in [0, 1)"),
            (self.lora_plus_scale > 0, f"lora_plus_scale={self.lora_plus_scale!r} must be > 0"),
            (bool(self.target_modules), "target_modules is empty: give at least one module-name regex"),
            (
                self.base_dtype in (None, "float32", "bfloat16", "float16"),
                f"base_dtype={self.base_dtype!r}: use None, 'float32', 'bfloat16' or 'float16'",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"LoraConfig: {msg}")
        for p in self.target_modules:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"LoraConfig: target_modules pattern {p!r} is not a valid regex ({e})") from None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


# ---- shared numerics -------------------------------------------------------------------------


def _dtype_name(t: paddle.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def _cast_param_(p: paddle.Tensor, dtype: str) -> None:
    """In-place dtype change that keeps the Parameter object (what `Layer.to` does), so every
    holder of it (the saved base layer, an optimizer) still sees the same parameter."""
    if _dtype_name(p) != dtype:
        holder = nn.Layer()
        holder.add_parameter("p", p)
        holder.to(dtype=dtype)


def _mm(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x @ w for a base weight possibly held in another dtype (bf16). Paddle's CPU build has no
    bf16 matmul, so on CPU the weight is upcast per call (the saving is the memory it is held in);
    on GPU the activations are cast down to use bf16 tensor cores."""
    if w.dtype == x.dtype:
        return paddle.matmul(x, w)
    if x.place.is_gpu_place():
        return paddle.matmul(x.astype(w.dtype), w).astype(x.dtype)
    return paddle.matmul(x, w.astype(x.dtype))


def _linear(x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None) -> paddle.Tensor:
    if w.dtype == x.dtype:  # the exact op of nn.Linear, so disabled adapters give the base bitwise
        return F.linear(x, w, b)
    y = _mm(x, w)
    return y if b is None else y + b.astype(y.dtype)


def _col_norm(w: paddle.Tensor) -> paddle.Tensor:
    """L2 norm of each output column of an [..., in, out] weight (PEFT's row norm of [out, in])."""
    return paddle.sqrt((w * w).sum(axis=-2))


def _kaiming_uniform(fan_in: int) -> nn.initializer.Initializer:
    # PEFT: kaiming_uniform_(A, a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    bound = 1.0 / math.sqrt(fan_in)
    return nn.initializer.Uniform(-bound, bound)


class _LoraMixin:
    """Flags and bookkeeping shared by the Linear and experts adapters."""

    def _init_flags(self, base: nn.Layer, config: LoraConfig, weight: paddle.Tensor) -> None:
        self.__dict__["base_layer"] = base  # not a sublayer: its parameters are ours, same objects
        self.r, self.scaling, self.dropout_p = config.r, config.scaling, config.lora_dropout
        self.use_dora = config.use_dora
        self.adapters_enabled = True
        self.merged = False
        self.__dict__["_merge_norm"] = {}  # DoRA column norms used by the last merge, for unmerge
        self.orig_dtype = _dtype_name(weight)
        # adapters, merges and DoRA norms in fp32 (fp64 for an fp64 model), whatever the base is held in
        self.compute_dtype = "float64" if self.orig_dtype == "float64" else "float32"

    def _drop(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.training and self.dropout_p > 0:
            x = F.dropout(x, self.dropout_p, training=True)
        return x.astype(self.compute_dtype)

    def _active(self) -> bool:
        return self.adapters_enabled and not self.merged

    def lora_b_params(self) -> list[paddle.Tensor]:
        raise NotImplementedError

    def adapter_params(self) -> list[paddle.Tensor]:
        raise NotImplementedError


# ---- Linear ----------------------------------------------------------------------------------


class LoraLinear(_LoraMixin, nn.Layer):
    """y = x W + b + s * dropout(x) A B          (LoRA; s = alpha/r, or alpha/sqrt(r) for rsLoRA)
    y = m / ||W + s A B||_col * (x W + s * dropout(x) A B) + b            (DoRA, norm detached)"""

    def __init__(self, base: nn.Linear, config: LoraConfig):
        super().__init__()
        self._init_flags(base, config, base.weight)
        self.weight = base.weight
        self.bias = base.bias
        if config.base_dtype:
            _cast_param_(self.weight, config.base_dtype)
        fan_in, fan_out = self.weight.shape
        self.lora_A = self.create_parameter(
            [fan_in, config.r], dtype=self.compute_dtype, default_initializer=_kaiming_uniform(fan_in)
        )
        self.lora_B = self.create_parameter(
            [config.r, fan_out], dtype=self.compute_dtype, default_initializer=nn.initializer.Constant(0.0)
        )
        if config.use_dora:  # m = ||W|| of the weight as held, so the adapted model starts at the base
            self.lora_magnitude_vector = self.create_parameter([fan_out], dtype=self.compute_dtype)
            self.lora_magnitude_vector.set_value(_col_norm(self.weight.detach().astype(self.compute_dtype)))
        else:
            self.lora_magnitude_vector = None

    def _delta(self) -> paddle.Tensor:
        return self.scaling * paddle.matmul(self.lora_A, self.lora_B)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not self._active():
            return _linear(x, self.weight, self.bias)
        lora = self.scaling * paddle.matmul(paddle.matmul(self._drop(x), self.lora_A), self.lora_B)
        if not self.use_dora:
            return _linear(x, self.weight, self.bias) + lora.astype(x.dtype)
        with paddle.no_grad():  # the norm is a constant for the gradient (DoRA paper, sec. 4.3)
            norm = _col_norm(self.weight.astype(self.compute_dtype) + self._delta())
        g = self.lora_magnitude_vector / norm
        y = ((_mm(x, self.weight).astype(self.compute_dtype) + lora) * g).astype(x.dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)

    @paddle.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        w = self.weight.astype(self.compute_dtype) + self._delta()
        if self.use_dora:
            norm = _col_norm(w)
            self._merge_norm["w"] = norm
            w = w * (self.lora_magnitude_vector / norm)
        self.weight.set_value(w.astype(self.weight.dtype))
        self.merged = True

    @paddle.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        w = self.weight.astype(self.compute_dtype)
        if self.use_dora:
            w = w * (self._merge_norm.pop("w") / self.lora_magnitude_vector)
        self.weight.set_value((w - self._delta()).astype(self.weight.dtype))
        self.merged = False

    def restore_base_dtype(self) -> None:
        _cast_param_(self.weight, self.orig_dtype)

    def lora_b_params(self) -> list[paddle.Tensor]:
        return [self.lora_B]

    def adapter_params(self) -> list[paddle.Tensor]:
        return [p for p in (self.lora_A, self.lora_B, self.lora_magnitude_vector) if p is not None]

    def peft_tensors(self, name: str) -> dict[str, tuple[paddle.Tensor, bool]]:
        """PEFT tensor name -> (our parameter, transposed?)."""
        base = PEFT_PREFIX + name
        out = {f"{base}.lora_A.weight": (self.lora_A, True), f"{base}.lora_B.weight": (self.lora_B, True)}
        if self.lora_magnitude_vector is not None:
            out[f"{base}.lora_magnitude_vector"] = (self.lora_magnitude_vector, False)
        return out


# ---- routed experts --------------------------------------------------------------------------


class LoraStackedExperts(_LoraMixin, StackedExperts):
    """StackedExperts with per-expert adapters: for projection p of expert e,
    h W_p[e] + s * dropout(h) A_p[e] B_p[e] (DoRA: scaled per expert column), inside the same
    sorted, grouped dispatch; each expert adds one small GEMM pair per adapted projection."""

    def __init__(self, base: StackedExperts, config: LoraConfig, projs: tuple[str, ...] = _EXPERT_PROJS):
        nn.Layer.__init__(self)
        self._init_flags(base, config, base.gate_proj)
        self.num_experts = base.num_experts
        self.fp8_block, self.fp8_grad_format = base.fp8_block, base.fp8_grad_format
        self.expert_offset = base.expert_offset
        self.expert_parallel, self.replicated, self._local = base.expert_parallel, base.replicated, {}
        self.projs = tuple(projs)
        for p in _EXPERT_PROJS:
            setattr(self, p, getattr(base, p))
        for p in self.projs:
            w = getattr(self, p)
            if config.base_dtype:
                _cast_param_(w, config.base_dtype)
            E, fan_in, fan_out = w.shape
            setattr(
                self,
                f"{p}_lora_A",
                self.create_parameter(
                    [E, fan_in, config.r], dtype=self.compute_dtype, default_initializer=_kaiming_uniform(fan_in)
                ),
            )
            setattr(
                self,
                f"{p}_lora_B",
                self.create_parameter(
                    [E, config.r, fan_out], dtype=self.compute_dtype, default_initializer=nn.initializer.Constant(0.0)
                ),
            )
            if config.use_dora:
                m = self.create_parameter([E, fan_out], dtype=self.compute_dtype)
                m.set_value(_col_norm(w.detach().astype(self.compute_dtype)))
                setattr(self, f"{p}_lora_magnitude_vector", m)

    def _delta(self, p: str) -> paddle.Tensor:
        return self.scaling * paddle.bmm(self.param(f"{p}_lora_A"), self.param(f"{p}_lora_B"))

    def base_matmul(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        return _mm(x, w)  # the frozen base may be held in bf16

    def grouped_many(
        self, ps: tuple[str, ...], x: paddle.Tensor, sizes: list[int], used: list[int]
    ) -> list[paddle.Tensor]:
        """StackedExperts' grouped projections, plus each group's expert adapter (and DoRA scale)."""
        return [self._adapted(p, x, y, sizes, used) for p, y in zip(ps, super().grouped_many(ps, x, sizes, used))]

    def _adapted(self, p: str, x: paddle.Tensor, y: paddle.Tensor, sizes: list[int], used: list[int]) -> paddle.Tensor:
        if not (self._active() and p in self.projs):
            return y
        A, B = paddle.unbind(self.param(f"{p}_lora_A")), paddle.unbind(self.param(f"{p}_lora_B"))
        lora = concat_rows(
            [
                self.scaling * paddle.matmul(paddle.matmul(self._drop(g), A[e]), B[e])
                for g, e in zip(split_rows(x, sizes), used)
            ]
        )
        if not self.use_dora:
            return y + lora.astype(y.dtype)
        with paddle.no_grad():  # all experts' column scales at once: m / ||W + s A B||
            norm = _col_norm(self.param(p).astype(self.compute_dtype) + self._delta(p))
        scale = self.param(f"{p}_lora_magnitude_vector") / norm  # [E, out]
        rows = concat_rows([scale[e].expand([n, scale.shape[-1]]) for n, e in zip(sizes, used)])
        return ((y.astype(self.compute_dtype) + lora) * rows).astype(y.dtype)

    @paddle.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        for p in self.projs:
            base = getattr(self, p)
            w = base.astype(self.compute_dtype) + self._delta(p)
            if self.use_dora:
                norm = _col_norm(w)
                self._merge_norm[p] = norm
                w = w * (getattr(self, f"{p}_lora_magnitude_vector") / norm).unsqueeze(1)
            base.set_value(w.astype(base.dtype))
        self.merged = True

    @paddle.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for p in self.projs:
            base = getattr(self, p)
            w = base.astype(self.compute_dtype)
            if self.use_dora:
                w = w * (self._merge_norm.pop(p) / getattr(self, f"{p}_lora_magnitude_vector")).unsqueeze(1)
            base.set_value((w - self._delta(p)).astype(base.dtype))
        self.merged = False

    def restore_base_dtype(self) -> None:
        for p in self.projs:
            _cast_param_(getattr(self, p), self.orig_dtype)

    def lora_b_params(self) -> list[paddle.Tensor]:
        return [getattr(self, f"{p}_lora_B") for p in self.projs]

    def adapter_params(self) -> list[paddle.Tensor]:
        kinds = ("lora_A", "lora_B") + (("lora_magnitude_vector",) if self.use_dora else ())
        return [getattr(self, f"{p}_{k}") for p in self.projs for k in kinds]

    def peft_tensors(self, name: str) -> dict[str, tuple[paddle.Tensor, int, bool]]:
        """PEFT tensor name -> (our stacked parameter, expert index, transposed?)."""
        out = {}
        for p in self.projs:
            for e in range(self.num_experts):
                base = f"{PEFT_PREFIX}{expert_module_name(name, self, e)}.{p}"
                out[f"{base}.lora_A.weight"] = (getattr(self, f"{p}_lora_A"), e, True)
                out[f"{base}.lora_B.weight"] = (getattr(self, f"{p}_lora_B"), e, True)
                if self.use_dora:
                    out[f"{base}.lora_magnitude_vector"] = (getattr(self, f"{p}_lora_magnitude_vector"), e, False)
        return out


# ---- applying, matching ----------------------------------------------------------------------


@dataclass
class _State:
    config: LoraConfig
    stop_gradient: dict[str, bool]  # every base parameter's flag before apply_lora froze it


def _state(model: nn.Layer, what: str) -> _State:
    st = model.__dict__.get(_STATE_ATTR)
    if st is None:
        raise ConfigError(
            f"{what}: the model has no LoRA adapters; call apply_lora(model, config) or load_adapter first"
        )
    return st


def expert_module_name(name: str, layer: StackedExperts, e: int) -> str:
    """HF/PEFT name of expert e of the routed-experts module `name`: modality m's experts
    (`mlp.experts_m`) are numbered after the experts of modalities < m (`mlp.experts.<offset+e>`),
    as ERNIE-VL checkpoints number them, so adapters name the tensors the checkpoint names."""
    return f"{_hf_experts_name(name)}.{layer.expert_offset + e}"


def _hf_experts_name(name: str) -> str:
    return re.sub(r"\.experts_\d+$", ".experts", name)


def lora_layers(model: nn.Layer) -> list[tuple[str, LoraLinear | LoraStackedExperts]]:
    """(module name, adapter layer) for every adapted module, in model order."""
    return [(n, l) for n, l in model.named_sublayers() if isinstance(l, (LoraLinear, LoraStackedExperts))]


def _candidates(model: nn.Layer) -> list[tuple[str, nn.Layer]]:
    return [(n, l) for n, l in model.named_sublayers() if isinstance(l, (nn.Linear, StackedExperts))]


def _sample(names: list[str], n: int = 12) -> str:
    """One name per shape (layer indices collapsed), so the sample shows every kind of module."""
    seen, out = set(), []
    for name in names:
        key = re.sub(r"\.\d+(\.|$)", r".N\1", name)
        if key not in seen:
            seen.add(key)
            out.append(name)
    return ", ".join(out[:n]) + (", ..." if len(out) > n else "")


def _plan(model: nn.Layer, config: LoraConfig) -> list[tuple[str, nn.Layer, tuple[str, ...]]]:
    """(name, layer, expert projections) to adapt; errors name a pattern that matches nothing."""
    pats = [re.compile(p) for p in config.target_modules]
    hit = [False] * len(pats)

    def match(name: str) -> bool:
        ok = [bool(p.fullmatch(name)) for p in pats]
        for i, o in enumerate(ok):
            hit[i] = hit[i] or o
        return any(ok)

    cands = _candidates(model)
    plan = []
    for name, layer in cands:
        if isinstance(layer, nn.Linear):
            if match(name):
                plan.append((name, layer, ()))
            continue
        whole = match(name) or match(_hf_experts_name(name))
        projs = []
        for p in _EXPERT_PROJS:
            per = [match(f"{expert_module_name(name, layer, e)}.{p}") for e in range(layer.num_experts)]
            if any(per) and not all(per) and not whole:
                raise ConfigError(
                    f"LoraConfig: target_modules select only some experts of {name}.*.{p}; "
                    f"adapters cover all experts of a projection: match {name} or every {name}.<e>.{p}"
                )
            if whole or all(per):
                projs.append(p)
        if projs:
            plan.append((name, layer, tuple(projs)))
    missing = [config.target_modules[i] for i, h in enumerate(hit) if not h]
    if missing:
        raise ConfigError(
            f"LoraConfig: target_modules pattern {missing[0]!r} matches no module (re.fullmatch on module names); "
            f"available modules: {_sample([n for n, _ in cands])}"
        )
    return plan


def apply_lora(model: nn.Layer, config: LoraConfig) -> list[str]:
    """Wrap matched Linear / StackedExperts layers with adapters and freeze every base parameter.
    B starts at zero, so the adapted model computes exactly the base model at first."""
    if model.__dict__.get(_STATE_ATTR) is not None or lora_layers(model):
        raise ConfigError("apply_lora: the model already has LoRA adapters; call merge_and_unload(model) first")
    plan = _plan(model, config)  # validates before anything is changed
    frozen = {}
    for n, p in model.named_parameters():
        frozen[n] = p.stop_gradient
        p.stop_gradient = True
    subs = dict(model.named_sublayers())
    for name, layer, projs in plan:
        new = LoraLinear(layer, config) if isinstance(layer, nn.Linear) else LoraStackedExperts(layer, config, projs)
        parent, attr = (subs[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1]) if "." in name else (model, name)
        setattr(parent, attr, new)
    model.__dict__[_STATE_ATTR] = _State(config, frozen)
    return [name for name, _, _ in plan]


def set_adapters_enabled(model: nn.Layer, enabled: bool) -> None:
    """Disabled adapters compute the base model exactly (a DPO/RL reference without a second copy)."""
    _state(model, "set_adapters_enabled")
    for name, layer in lora_layers(model):
        if layer.merged and not enabled:
            raise ConfigError(
                f"set_adapters_enabled: adapters of {name} are merged into its weights; call unmerge_lora(model) first"
            )
        layer.adapters_enabled = bool(enabled)


@contextlib.contextmanager
def adapters_disabled(model: nn.Layer) -> Iterator[nn.Layer]:
    """`with adapters_disabled(model): ref = model(ids)` — base-model outputs, state restored after."""
    layers = lora_layers(model)
    before = [l.adapters_enabled for _, l in layers]
    set_adapters_enabled(model, False)
    try:
        yield model
    finally:
        for (_, l), b in zip(layers, before):
            l.adapters_enabled = b


def merge_lora(model: nn.Layer) -> None:
    """Fold s*A*B (DoRA: the magnitude-scaled direction) into the base weights; forward then runs
    the plain base layers. Exact up to float rounding in fp32; lossy when the base is held in bf16."""
    _state(model, "merge_lora")
    for _, layer in lora_layers(model):
        layer.merge()


def unmerge_lora(model: nn.Layer) -> None:
    """Undo merge_lora (the base weights come back up to float rounding)."""
    _state(model, "unmerge_lora")
    for _, layer in lora_layers(model):
        layer.unmerge()


def merge_and_unload(model: nn.Layer) -> nn.Layer:
    """Merge, then put the original Linear / StackedExperts objects back (same parameter names and
    dtypes, trainability as before apply_lora): the model saves as a plain checkpoint."""
    st = _state(model, "merge_and_unload")
    subs = dict(model.named_sublayers())
    for name, layer in lora_layers(model):
        if not layer.merged:
            layer.restore_base_dtype()  # fold in the original dtype: merging into bf16 would round
            layer.merge()
        else:
            layer.restore_base_dtype()
        parent, attr = (subs[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1]) if "." in name else (model, name)
        setattr(parent, attr, layer.base_layer)
    for n, p in model.named_parameters():
        p.stop_gradient = st.stop_gradient.get(n, p.stop_gradient)
    del model.__dict__[_STATE_ATTR]
    return model


def lora_param_groups(model: nn.Layer, lora_plus_scale: float | None = None) -> dict[str, float]:
    """Trainable parameter name -> learning-rate multiplier: LoRA+ gives the B matrices
    `lora_plus_scale` (from the applied config unless given), everything else 1.0."""
    ratio = _state(model, "lora_param_groups").config.lora_plus_scale if lora_plus_scale is None else lora_plus_scale
    b_ids = {id(p) for _, l in lora_layers(model) for p in l.lora_b_params()}
    return {n: (float(ratio) if id(p) in b_ids else 1.0) for n, p in model.named_parameters() if not p.stop_gradient}


# ---- PEFT layout io --------------------------------------------------------------------------


def _peft_targets(model: nn.Layer, config: LoraConfig) -> list[str] | str:
    """PEFT's `target_modules` for what is adapted: the usual suffix list when it selects exactly
    the adapted modules of the HF model (per-expert Linears), else an exact regex."""
    known, adapted = [], set()
    layers = dict(lora_layers(model))
    for name, layer in model.named_sublayers():
        if isinstance(layer, (nn.Linear, LoraLinear)):
            known.append(name)
            if name in layers:
                adapted.add(name)
        elif isinstance(layer, StackedExperts):
            for e in range(layer.num_experts):
                for p in _EXPERT_PROJS:
                    known.append(f"{expert_module_name(name, layer, e)}.{p}")
                    if name in layers and p in layer.projs:
                        adapted.add(f"{expert_module_name(name, layer, e)}.{p}")

    def exact(sel) -> bool:
        return {n for n in known if sel(n)} == adapted

    suffixes = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in known if n in adapted))
    if exact(lambda n: n.rsplit(".", 1)[-1] in suffixes):
        return suffixes
    alt = "|".join(config.target_modules)
    rx = f"(?:{alt})|(?:(?:{alt})\\.\\d+\\.(?:{'|'.join(_EXPERT_PROJS)}))"
    if exact(lambda n: re.fullmatch(rx, n) is not None):
        return rx
    return "|".join(re.escape(n) for n in known if n in adapted)


def save_adapter(
    model: nn.Layer, path: str, config: LoraConfig | None = None, base_model_name_or_path: str | None = None
) -> None:
    """Write adapter_config.json + adapter_model.safetensors as PEFT's `save_pretrained` does."""
    from safetensors.paddle import save_file

    from erniekit.utils.io import atomic_write, atomic_write_json

    st = _state(model, "save_adapter")
    config = config or st.config
    applied = st.config
    for k in ("r", "lora_alpha", "use_rslora", "use_dora"):
        if getattr(config, k) != getattr(applied, k):
            raise ConfigError(
                f"save_adapter: config {k}={getattr(config, k)!r} differs from the applied {getattr(applied, k)!r}; "
                "pass the config given to apply_lora (or none)"
            )
    tensors: dict[str, paddle.Tensor] = {}
    for name, layer in lora_layers(model):
        for key, spec in layer.peft_tensors(name).items():
            t = spec[0].detach()
            if isinstance(layer, LoraStackedExperts):
                t = t[spec[1]]
            tensors[key] = (t.T if spec[-1] else t).astype("float32").contiguous()
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": _peft_targets(model, config),
        "use_rslora": config.use_rslora,
        "use_dora": config.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    atomic_write(weights, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_json(os.path.join(path, ADAPTER_CONFIG_NAME), cfg)


def _read_adapter_config(path: str) -> LoraConfig:
    file = os.path.join(path, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{file}: not found; point at a directory written by save_adapter or PEFT's save_pretrained"
        )
    d = read_json_object(file, "fix adapter_config.json")
    unsupported = [
        (d.get("peft_type", "LORA") != "LORA", f"peft_type={d.get('peft_type')!r} (only LORA is supported)"),
        (d.get("bias", "none") != "none", f"bias={d.get('bias')!r} (only 'none' is supported)"),
        (bool(d.get("fan_in_fan_out")), "fan_in_fan_out=true (only Linear layers are supported)"),
        (bool(d.get("modules_to_save")), "modules_to_save (fully trained extra modules are not supported)"),
        (
            bool(d.get("rank_pattern")) or bool(d.get("alpha_pattern")),
            "rank_pattern/alpha_pattern (one r and alpha for all modules)",
        ),
        (d.get("layers_to_transform") is not None, "layers_to_transform (use a target_modules regex)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise CheckpointError(f"{file}: {what}")
    tm = d.get("target_modules")
    if tm == "all-linear":
        patterns = [r"(?!lm_head$).*"]
    elif isinstance(tm, str):
        patterns = [tm]
    elif isinstance(tm, list) and tm:  # PEFT list: exact name or a '.'-separated suffix
        patterns = [r"(?:.*\.)?" + re.escape(k) for k in tm]
    else:
        raise CheckpointError(f"{file}: target_modules={tm!r}: expected a list of module names or a regex")
    try:
        return LoraConfig(
            r=d.get("r", 8),
            lora_alpha=d.get("lora_alpha", 8),
            lora_dropout=d.get("lora_dropout", 0.0),
            target_modules=patterns,
            use_rslora=bool(d.get("use_rslora")),
            use_dora=bool(d.get("use_dora")),
        )
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None


def _expected_shapes(model: nn.Layer, plan, r: int, dora: bool) -> dict[str, list[int]]:
    out = {}
    for name, layer, projs in plan:
        if isinstance(layer, nn.Linear):
            shapes = [(PEFT_PREFIX + name, layer.weight.shape)]
        else:
            shapes = [
                (f"{PEFT_PREFIX}{expert_module_name(name, layer, e)}.{p}", getattr(layer, p).shape[1:])
                for p in projs
                for e in range(layer.num_experts)
            ]
        for base, (fan_in, fan_out) in shapes:
            out[f"{base}.lora_A.weight"] = [r, fan_in]
            out[f"{base}.lora_B.weight"] = [fan_out, r]
            if dora:
                out[f"{base}.lora_magnitude_vector"] = [fan_out]
    return out


def load_adapter(model: nn.Layer, path: str, base_dtype: str | None = None) -> LoraConfig:
    """Apply LoRA as `path`/adapter_config.json says and load adapter_model.safetensors (PEFT layout).
    Everything is checked before the model is changed; errors name the tensor."""
    from erniekit.utils.io import open_safetensors

    config = _read_adapter_config(path)
    config.base_dtype = base_dtype
    file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    if not os.path.isfile(file):
        hint = (
            " (adapter_model.bin is pickle and is not loaded: convert it to safetensors)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise CheckpointError(f"{file}: not found{hint}")
    try:
        plan = _plan(model, config)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    expected = _expected_shapes(model, plan, config.r, config.use_dora)
    with open_safetensors(file) as f:
        names = list(f.keys())
        known = {n for n, _ in _candidates(model)}
        for n in names:
            if n not in expected:
                module = re.sub(r"\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)$", "", n)
                module = module[len(PEFT_PREFIX) :] if module.startswith(PEFT_PREFIX) else module
                owned = module in known or re.sub(r"\.\d+\.\w+$", "", module) in known
                why = (
                    "which adapter_config.json target_modules does not select: the two files disagree"
                    if owned
                    else "which the model does not have: the adapter was made for another base model"
                )
                raise CheckpointError(f"{file}: tensor {n} is for module {module}, {why}")
        for n, want in expected.items():
            if n not in names:
                raise CheckpointError(f"{file}: tensor {n} is missing (adapter_config.json targets its module)")
            got = list(f.get_slice(n).get_shape())
            if got != want:
                raise CheckpointError(
                    f"{file}: tensor {n} has shape {got}, the model expects {want}: "
                    "the adapter's base model has other shapes (check base_model_name_or_path)"
                )
        apply_lora(model, config)
        _fill_adapters(model, f)
    return config


def _fill_adapters(model: nn.Layer, f) -> None:
    """Copy PEFT-layout tensors from an open safetensors file into the model's adapters."""
    with paddle.no_grad():
        for name, layer in lora_layers(model):
            specs = layer.peft_tensors(name)
            if isinstance(layer, LoraLinear):
                for key, (p, tr) in specs.items():
                    t = f.get_tensor(key).astype(p.dtype)
                    p.set_value(t.T if tr else t)
                continue
            stacks: dict[int, list] = {}
            for key, (p, _expert, tr) in specs.items():
                t = f.get_tensor(key).astype(p.dtype)
                stacks.setdefault(id(p), [p, []])[1].append(t.T if tr else t)
            for p, ts in stacks.values():  # peft_tensors lists experts in order
                p.set_value(paddle.stack(ts))


def load_adapter_weights(model: nn.Layer, path: str) -> None:
    """Refill the adapters of a model that already has LoRA applied (resume), from `path`."""
    from erniekit.utils.io import open_safetensors

    file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    if not lora_layers(model):
        raise CheckpointError(f"{path}: holds a LoRA adapter but the model has none; set fine_tuning=LoRA")
    with open_safetensors(file) as f:
        missing = [k for name, layer in lora_layers(model) for k in layer.peft_tensors(name) if k not in f.keys()]
        if missing:
            raise CheckpointError(
                f"{file}: tensor {missing[0]} is missing; the adapter was saved with other lora settings"
            )
        _fill_adapters(model, f)
