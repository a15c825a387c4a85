"""LoRA / rsLoRA / DoRA / LoRA+ adapters for Paddle models, saved in the Hugging Face PEFT layout.

Adapted layers keep their base parameters under the same names (`...q_proj.weight`), so the
HF-layout checkpoint io and the optimizer's name-keyed state keep working, and
`merge_and_unload` gives back the original layer objects. Adapter tensors are stored in Paddle's
[in, out] orientation (A [in, r], B [r, out]; experts A [E, in, r], B [E, r, out]) and transposed
to PEFT's torch orientation (lora_A.weight [r, in], lora_B.weight [out, r]) on save/load; routed
experts go per expert (transformers < 5) or as PEFT's target_parameters on transformers 5's fused
experts (erniekit/nn/lora_fused.py). Formulas, layouts and references: docs/lora.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from erniekit.errors import CheckpointError, ConfigError
from erniekit.nn import lora_fused, native
from erniekit.nn.linear import linear
from erniekit.nn.lora_targets import (
    DEFAULT_TARGET_MODULES,
    EXPERT_PROJS,
    TargetMatcher,
    compile_target,
    hf_experts_name,
    module_sample,
)
from erniekit.nn.moe import StackedExperts
from erniekit.nn.rows import concat_rows, split_rows
from erniekit.utils.io import read_json_object

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_STATE_ATTR = "_erniekit_lora_state"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite int or float (not a bool, a string or NaN: they would pass or break `> 0` later)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    # routed-expert tensors on save: "fused" (transformers >= 5: PEFT target_parameters on the fused
    # experts), "per_expert" (transformers < 5, the Hub checkpoints' names), "auto" (by transformers)
    peft_layout: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        checks = [
            (_is_int(self.r) and self.r > 0, f"r={self.r!r} must be a positive integer"),
            (
                _is_number(self.lora_alpha) and self.lora_alpha > 0,
                f"lora_alpha={self.lora_alpha!r} must be a number > 0",
            ),
            (
                _is_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0,
                f"lora_dropout={self.lora_dropout!r} must be in [0, 1)",
            ),
            (
                _is_number(self.lora_plus_scale) and self.lora_plus_scale > 0,
                f"lora_plus_scale={self.lora_plus_scale!r} must be > 0",
            ),
            (bool(self.target_modules), "target_modules is empty: give at least one module-name regex"),
            (
                self.base_dtype in (None, "float32", "bfloat16", "float16"),
                f"base_dtype={self.base_dtype!r}: use None, 'float32', 'bfloat16' or 'float16'",
            ),
            (
                self.peft_layout in lora_fused.PEFT_LAYOUTS,
                f"peft_layout={self.peft_layout!r}: use " + ", ".join(repr(x) for x in lora_fused.PEFT_LAYOUTS),
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"LoraConfig: {msg}")
        for p in self.target_modules:
            compile_target(p, "LoraConfig: target_modules")

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


class _UpcastMatmul(PyLayer):
    """x @ w.astype(x.dtype) (x @ w[index].astype(x.dtype): one expert of a stacked [E, in, out]
    weight) for a frozen weight held in 16 bits, keeping only w for the backward.

    Autograd through `matmul(x, w.astype(...))` keeps the float32 copy of w until the backward
    (dx = dy @ w^T): every adapted weight of the step in 4 bytes an element, more than the 16-bit
    base saves (4 LoRA Linears [4096, 4096]: 256 MB kept). Here the parameter itself is kept (no
    new bytes; an expert's slice is taken again, not kept: with FLAGS_use_stride_kernel=0, as
    erniekit runs, a slice is a copy) and upcast again in the backward, one weight at a time. The
    same casts and GEMMs on the same values as autograd's, so the same bits
    (tests/unit/nn/test_lora_upcast.py)."""

    @staticmethod
    def forward(ctx, x, w, index=None):
        ctx.save_for_backward(w)
        ctx.versions = native.versions(w)
        ctx.index = index
        return paddle.matmul(x, _upcast(w, index, x.dtype))

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensor()
        native.check_versions("lora upcast matmul", ctx.versions, w)
        if paddle.is_grad_enabled():  # create_graph: the GEMM is recorded, so its weight must not be the shared buffer
            wt = (w if ctx.index is None else w[ctx.index]).astype(dy.dtype)
        else:
            wt = _upcast(w, ctx.index, dy.dtype)
        return paddle.matmul(dy, wt, transpose_y=True), None


_scratch = threading.local()  # .buf: the float32 buffer _upcast writes bf16 weights into, per thread (a
# server may run forwards on several), grown on demand to the largest weight upcast


def _upcast(w: paddle.Tensor, index: int | None, dtype) -> paddle.Tensor:
    """w (w[index]) in `dtype`, for one GEMM. A contiguous bf16 CPU weight to float32 is written into
    one buffer reused by every call (bf16 is float32's upper 16 bits: the same values as astype):
    no allocation per call, so the step's heap does not fragment around weight-sized blocks
    (dense-1024's peak: docs/lora.md), by kernels/bf16_upcast.c in 2.2 ms for 16M elements where
    Paddle's astype takes 4-8. The result aliases that buffer: consume it before the next call
    (_UpcastMatmul's GEMM does)."""
    if not (_is_bf16(w) and dtype == paddle.float32 and w.is_contiguous() and not w.is_dist()):
        return (w if index is None else w[index]).astype(dtype)
    shape = list(w.shape) if index is None else list(w.shape[1:])
    n = math.prod(shape)
    if getattr(_scratch, "buf", None) is None or _scratch.buf.size < n:
        _scratch.buf = np.empty(n, np.uint32)
    out = _scratch.buf[:n]
    src = w.data_ptr() + (0 if index is None else index * n * 2)
    kernel = native.function("bf16_upcast", "erniekit_bf16_upcast", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
    if kernel is not None:
        kernel(src, out.ctypes.data, n)
    else:  # the same bits, ~2x slower
        np.left_shift(np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(src)), 16, out=out, dtype=np.uint32)
    return paddle.from_dlpack(out.view(np.float32).reshape(shape))


def _is_bf16(t: paddle.Tensor) -> bool:
    return t.dtype == paddle.bfloat16


def _upcasts(x: paddle.Tensor, w: paddle.Tensor) -> bool:
    """_UpcastMatmul's case: a frozen weight in another dtype than x, on the CPU, in dynamic mode
    (a trained 16-bit weight's gradient needs x anyway; static graphs keep autograd's ops)."""
    return w.dtype != x.dtype and w.stop_gradient and not x.place.is_gpu_place() and paddle.in_dynamic_mode()


def _mm(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x @ w for a base weight possibly held in another dtype (bf16). Paddle's CPU build has no
    bf16 matmul, so on CPU the weight is upcast per call, and a frozen one again in the backward
    rather than kept (_UpcastMatmul: the memory saving holds during the step too); on GPU the
    activations are cast down to use bf16 tensor cores."""
    if w.dtype == x.dtype:
        return paddle.matmul(x, w)
    if x.place.is_gpu_place():
        return paddle.matmul(x.astype(w.dtype), w).astype(x.dtype)
    if _upcasts(x, w):
        return _UpcastMatmul.apply(x, w)
    return paddle.matmul(x, w.astype(x.dtype))


def _linear(x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None) -> paddle.Tensor:
    if w.dtype == x.dtype:  # the exact op of the models' Linear, so disabled adapters give the base bitwise
        return linear(x, w, b)
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

    def __init__(self, base: StackedExperts, config: LoraConfig, projs: tuple[str, ...] = EXPERT_PROJS):
        nn.Layer.__init__(self)
        self._init_flags(base, config, base.gate_proj)
        self.num_experts = base.num_experts
        self.fp8_block, self.fp8_grad_format = base.fp8_block, base.fp8_grad_format
        self.expert_offset = base.expert_offset
        self.expert_parallel, self.replicated, self._local = base.expert_parallel, base.replicated, {}
        self.tensor_parallel = base.tensor_parallel
        self.projs = tuple(projs)
        for p in EXPERT_PROJS:
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
        return [self._adapted(p, x, y, sizes, used) for p, y in zip(ps, self._base_grouped(ps, x, sizes, used))]

    def _base_grouped(self, ps: tuple[str, ...], x: paddle.Tensor, sizes: list[int], used: list[int]):
        """StackedExperts' per-group loop, except that a frozen 16-bit weight on the CPU goes through
        _UpcastMatmul with its expert index: the backward keeps the stacked parameter, not each
        expert's unbound slice (a bf16 copy) or its float32 upcast."""
        ws = [self.param(p) for p in ps]
        if self.fp8_block or not any(_upcasts(x, w) for w in ws):
            return super().grouped_many(ps, x, sizes, used)
        xs = split_rows(x, sizes)
        out = []
        for w in ws:
            if _upcasts(x, w):
                out.append(concat_rows([_UpcastMatmul.apply(g, w, e) for g, e in zip(xs, used)]))
            else:
                W = paddle.unbind(w)
                out.append(concat_rows([self.base_matmul(g, W[e]) for g, e in zip(xs, used)]))
        return out

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
            norm = self._col_norm(p)
        scale = self.param(f"{p}_lora_magnitude_vector") / norm  # [E, out]
        rows = concat_rows([scale[e].expand([n, scale.shape[-1]]) for n, e in zip(sizes, used)])
        return ((y.astype(self.compute_dtype) + lora) * rows).astype(y.dtype)

    def _col_norm(self, p: str) -> paddle.Tensor:
        """||W + s A B|| per expert column of this forward's weights; under tensor parallelism the
        down projection's rows are split over the tp ranks, so its squares are summed over them."""
        w = self.param(p).astype(self.compute_dtype) + self._delta(p)
        if p != "down_proj" or self.tensor_parallel is None or not self._local:
            return _col_norm(w)
        return paddle.sqrt(self.tensor_parallel.sum((w * w).sum(axis=-2)))

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


@dataclass(frozen=True)
class _Module:
    """An adaptable module (a Linear or routed experts) as apply_lora found it. The saved
    adapter_config.json's targets and layout are computed from these, so a model that later holds
    only some layers (a pipeline stage) writes the whole model's config."""

    name: str
    experts: int = 0  # routed experts (StackedExperts); 0: a Linear
    offset: int = 0  # the first expert's number in checkpoints (modality experts: expert_module_name)
    adapted: tuple[str, ...] = ()  # a Linear: ("weight",) when adapted; experts: the adapted projections

    def expert_name(self, e: int) -> str:
        return f"{hf_experts_name(self.name)}.{self.offset + e}"


@dataclass
class _State:
    config: LoraConfig
    stop_gradient: dict[str, bool]  # every base parameter's flag before apply_lora froze it
    modules: tuple[_Module, ...]  # the whole model's adaptable modules, once adapted (_inventory)


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
    return _Module(name, layer.num_experts, layer.expert_offset).expert_name(e)


def _inventory(model: nn.Layer) -> tuple[_Module, ...]:
    """The model's Linear and routed-experts modules in model order, with what is adapted."""
    layers = dict(lora_layers(model))
    out = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, (nn.Linear, LoraLinear)):
            out.append(_Module(name, adapted=("weight",) if name in layers else ()))
        elif isinstance(layer, StackedExperts):
            projs = tuple(layer.projs) if name in layers else ()
            out.append(_Module(name, layer.num_experts, layer.expert_offset, projs))
    return tuple(out)


def lora_layers(model: nn.Layer) -> list[tuple[str, LoraLinear | LoraStackedExperts]]:
    """(module name, adapter layer) for every adapted module, in model order."""
    return [(n, l) for n, l in model.named_sublayers() if isinstance(l, (LoraLinear, LoraStackedExperts))]


def has_lora(model: nn.Layer) -> bool:
    """apply_lora (or load_adapter) ran on the model: it saves an adapter, also where it holds none
    of the adapted layers (a pipeline stage whose layers no target selects)."""
    return model.__dict__.get(_STATE_ATTR) is not None


def _candidates(model: nn.Layer) -> list[tuple[str, nn.Layer]]:
    return [(n, l) for n, l in model.named_sublayers() if isinstance(l, (nn.Linear, StackedExperts))]


def _plan(model: nn.Layer, config: LoraConfig) -> list[tuple[str, nn.Layer, tuple[str, ...]]]:
    """(name, layer, expert projections) to adapt; errors name a pattern that matches nothing."""
    match = TargetMatcher(config.target_modules)
    cands = _candidates(model)
    plan = []
    for name, layer in cands:
        if isinstance(layer, nn.Linear):
            if match(name):
                plan.append((name, layer, ()))
            continue
        whole = match(name) or match(hf_experts_name(name))
        projs = []
        for p in EXPERT_PROJS:
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
    missing = match.unmatched()
    if missing:
        raise ConfigError(
            f"LoraConfig: target_modules pattern {missing[0]!r} matches no module (re.fullmatch on module names); "
            f"available modules: {module_sample([n for n, _ in cands])}"
        )
    return plan


def apply_lora(model: nn.Layer, config: LoraConfig) -> list[str]:
    """Wrap matched Linear / StackedExperts layers with adapters and freeze every base parameter.
    B starts at zero, so the adapted model computes exactly the base model at first."""
    if has_lora(model) or lora_layers(model):
        raise ConfigError("apply_lora: the model already has LoRA adapters; call merge_and_unload(model) first")
    plan = _plan(model, config)  # validates before anything is changed
    frozen = {}
    for n, p in model.named_parameters():
        frozen[n] = p.stop_gradient
        p.stop_gradient = True
    subs = dict(model.named_sublayers())
    for name, layer, projs in plan:
        new = LoraLinear(layer, config) if isinstance(layer, nn.Linear) else LoraStackedExperts(layer, config, projs)
        new.training = layer.training  # a new Layer starts in train mode: keep the model's (eval: no dropout)
        parent, attr = (subs[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1]) if "." in name else (model, name)
        setattr(parent, attr, new)
    model.__dict__[_STATE_ATTR] = _State(config, frozen, _inventory(model))
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


def _peft_targets(modules: tuple[_Module, ...], config: LoraConfig) -> list[str] | str:
    """PEFT's `target_modules` for what is adapted: the usual suffix list when it selects exactly
    the adapted modules of the HF model (per-expert Linears), else an exact regex."""
    known, adapted = [], set()
    for m in modules:
        if not m.experts:
            known.append(m.name)
            if m.adapted:
                adapted.add(m.name)
            continue
        for e in range(m.experts):
            for p in EXPERT_PROJS:
                known.append(f"{m.expert_name(e)}.{p}")
                if p in m.adapted:
                    adapted.add(f"{m.expert_name(e)}.{p}")

    def exact(sel) -> bool:
        return {n for n in known if sel(n)} == adapted

    suffixes = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in known if n in adapted))
    if exact(lambda n: n.rsplit(".", 1)[-1] in suffixes):
        return suffixes
    alt = "|".join(config.target_modules)
    rx = f"(?:{alt})|(?:(?:{alt})\\.\\d+\\.(?:{'|'.join(EXPERT_PROJS)}))"
    if exact(lambda n: re.fullmatch(rx, n) is not None):
        return rx
    return "|".join(re.escape(n) for n in known if n in adapted)


def _multimodal(modules: tuple[_Module, ...]) -> bool:
    """Modality experts (ERNIE-VL `mlp.experts_<m>`): transformers 5 names them differently again."""
    return any(re.search(r"\.experts_\d+$", m.name) for m in modules if m.experts)


def _param_target(name: str) -> bool:
    """A Linear that PEFT on a transformers >= 5 MoE model can only adapt as a parameter target."""
    return name.rsplit(".", 1)[-1] in lora_fused.PEFT_REMAPPED_LEAVES


def _fused_obstacle(modules: tuple[_Module, ...], config: LoraConfig) -> str | None:
    """What of this adapter the fused-expert layout cannot hold (None: nothing, or no routed experts)."""
    if not any(m.experts for m in modules):
        return None
    if _multimodal(modules):
        return "modality experts (mlp.experts_<m>, ERNIE-VL)"
    if config.use_dora and any(m.adapted and (m.experts or _param_target(m.name)) for m in modules):
        return "DoRA on MLP projections (PEFT's ParamWrapper for target_parameters has no DoRA)"
    return None


def fused_layout_obstacle(model: nn.Layer) -> str | None:
    """Why save_adapter(peft_layout='fused') would refuse the adapter apply_lora gave `model` (None: it
    would not), so a training run can refuse that layout before its first step instead of at its first save."""
    st = _state(model, "fused_layout_obstacle")
    return _fused_obstacle(st.modules, st.config)


def _save_layout(modules: tuple[_Module, ...], config: LoraConfig, requested: str, warn: bool = True) -> str:
    """'fused' or 'per_expert'. The layouts differ only for a model with routed experts. Where the
    fused layout cannot hold the adapter, asking for it is an error and 'auto' writes per-expert
    tensors with a warning (the adapter stays exact for erniekit and PEFT on transformers < 5)."""
    if requested not in lora_fused.PEFT_LAYOUTS:
        raise ConfigError(f"save_adapter: peft_layout={requested!r}: use one of {lora_fused.PEFT_LAYOUTS}")
    if lora_fused.resolve_layout(requested) == "per_expert" or not any(m.experts for m in modules):
        return "per_expert"
    why = _fused_obstacle(modules, config)
    if why is None:
        return "fused"
    msg = f"the fused-expert PEFT layout (target_parameters, transformers >= 5) cannot hold {why}"
    if requested == "fused":
        raise ConfigError(f"save_adapter: {msg}; use peft_layout='per_expert'")
    if warn:
        warnings.warn(
            f"save_adapter: {msg}; wrote the per-expert layout, which PEFT loads with transformers < 5 only",
            stacklevel=3,
        )
    return "per_expert"


def _torch_pair(layer: LoraStackedExperts, p: str) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Projection p's factors in torch's per-expert orientation: A [E, r, in], B [E, out, r]."""
    return tuple(getattr(layer, f"{p}_lora_{k}").detach().transpose([0, 2, 1]) for k in ("A", "B"))


def _fused_tensors(model: nn.Layer) -> dict[str, paddle.Tensor]:
    """This model's adapter tensors in PEFT's fused-expert layout (erniekit/nn/lora_fused.py)."""
    tensors: dict[str, paddle.Tensor] = {}
    for name, layer in lora_layers(model):
        if isinstance(layer, LoraLinear):
            for k, (p, tr) in layer.peft_tensors(name).items():
                tensors[k] = p.detach().T if tr else p.detach()
            continue
        gate, up = (_torch_pair(layer, p) if p in layer.projs else None for p in ("gate_proj", "up_proj"))
        fused = {}
        if gate is not None or up is not None:
            fused[lora_fused.GATE_UP] = lora_fused.fuse_gate_up(gate, up)
        if "down_proj" in layer.projs:
            fused[lora_fused.DOWN] = _torch_pair(layer, "down_proj")
        prefixes = lora_fused.wrapper_prefixes(name, list(fused))
        for q, (a, b) in fused.items():
            a_key, b_key = (f"{PEFT_PREFIX}{prefixes[q]}.lora_{k}.weight" for k in "AB")
            tensors[a_key], tensors[b_key] = lora_fused.pack(a, b)
    return tensors


def _fused_entries(modules: tuple[_Module, ...], config: LoraConfig) -> dict:
    """adapter_config.json entries of PEFT's fused-expert layout for the whole model."""
    G, D = lora_fused.GATE_UP, lora_fused.DOWN
    names, params, on, gate_ups, doubled = [], [], set(), [], []
    for m in modules:
        if not m.experts:
            key = f"{m.name}.weight" if _param_target(m.name) else m.name
            (params if key != m.name else names).append(key)
            if m.adapted:
                on.add(key)
            continue
        params += [f"{m.name}.{q}" for q in lora_fused.FUSED_PARAMS]
        gate_up = [p for p in ("gate_proj", "up_proj") if p in m.adapted]
        if gate_up:
            on.add(f"{m.name}.{G}")
            gate_ups.append(f"{m.name}.{G}")
            if len(gate_up) == 2:
                doubled.append(f"{m.name}.{G}")
        if "down_proj" in m.adapted:
            on.add(f"{m.name}.{D}")
    # gate and up at rank r each are one rank-2r update: its scaling must stay alpha/r (rsLoRA alpha/sqrt(r))
    keys = [r"experts\.gate_up_proj"] if doubled and doubled == gate_ups else [re.escape(k) for k in doubled]
    alpha2 = config.lora_alpha * (math.sqrt(2) if config.use_rslora else 2)
    return {
        "target_modules": lora_fused.peft_list(names, on & set(names), 1),
        "target_parameters": lora_fused.peft_list(params, on & set(params), 2) or None,
        "rank_pattern": {k: 2 * config.r for k in keys},
        "alpha_pattern": {k: alpha2 for k in keys},
    }


def _per_expert_tensors(model: nn.Layer) -> dict[str, paddle.Tensor]:
    """This model's adapter tensors with routed experts one Linear per expert."""
    tensors = {}
    for name, layer in lora_layers(model):
        for key, spec in layer.peft_tensors(name).items():
            t = spec[0].detach()
            if isinstance(layer, LoraStackedExperts):
                t = t[spec[1]]
            tensors[key] = t.T if spec[-1] else t
    return tensors


def _saved_config(model: nn.Layer, config: LoraConfig | None, what: str) -> tuple[_State, LoraConfig]:
    """The applied state and the config to save with, which must be the applied one's numbers."""
    st = _state(model, what)
    config = config or st.config
    for k in ("r", "lora_alpha", "use_rslora", "use_dora"):
        if getattr(config, k) != getattr(st.config, k):
            raise ConfigError(
                f"{what}: config {k}={getattr(config, k)!r} differs from the applied {getattr(st.config, k)!r}; "
                "pass the config given to apply_lora (or none)"
            )
    return st, config


def adapter_tensors(
    model: nn.Layer, config: LoraConfig | None = None, peft_layout: str | None = None
) -> dict[str, paddle.Tensor]:
    """The adapter tensors this model holds (PEFT names, torch orientation, float32), in the layout
    the whole model saves in: a pipeline stage's share of its run's adapter (save_adapter's `tensors`)."""
    st, config = _saved_config(model, config, "adapter_tensors")
    layout = _save_layout(st.modules, config, peft_layout or config.peft_layout)
    return _tensors_in(model, layout)


def _tensors_in(model: nn.Layer, layout: str) -> dict[str, paddle.Tensor]:
    tensors = _fused_tensors(model) if layout == "fused" else _per_expert_tensors(model)
    return {k: t.astype("float32").contiguous() for k, t in tensors.items()}


def save_adapter(
    model: nn.Layer,
    path: str,
    config: LoraConfig | None = None,
    base_model_name_or_path: str | None = None,
    peft_layout: str | None = None,
    tensors: dict[str, paddle.Tensor] | None = None,
) -> None:
    """Write adapter_config.json + adapter_model.safetensors as PEFT's `save_pretrained` does.
    peft_layout (default: the config's): routed experts as transformers >= 5 fuses them ('fused')
    or one Linear per expert ('per_expert'); 'auto' follows the installed transformers.
    tensors: the whole model's `adapter_tensors`, gathered from the pipeline stages (None: this
    model's); the config's targets are always the whole model's, as apply_lora found it."""
    from safetensors.paddle import save_file

    from erniekit.utils.io import atomic_write, atomic_write_json

    st, config = _saved_config(model, config, "save_adapter")
    layout = _save_layout(st.modules, config, peft_layout or config.peft_layout, warn=tensors is None)
    if layout == "fused":
        entries = _fused_entries(st.modules, config)
    else:
        entries = {"target_modules": _peft_targets(st.modules, config), "rank_pattern": {}, "alpha_pattern": {}}
    tensors = _tensors_in(model, layout) if tensors is None else tensors
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        # PEFT's ParamWrapper refuses dropout; it is a training setting, the adapter's function has none
        "lora_dropout": 0.0 if entries.get("target_parameters") else config.lora_dropout,
        "use_rslora": config.use_rslora,
        "use_dora": config.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        **entries,
    }
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    atomic_write(weights, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_json(os.path.join(path, ADAPTER_CONFIG_NAME), cfg)


def _read_adapter_config(path: str) -> dict:
    """adapter_config.json, with what erniekit cannot load refused in one line."""
    file = os.path.join(path, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{file}: not found; point at a directory written by save_adapter or PEFT's save_pretrained"
        )
    d = read_json_object(file, "fix adapter_config.json")
    tp, patterns = d.get("target_parameters"), [d.get("rank_pattern") or {}, d.get("alpha_pattern") or {}]
    unsupported = [
        (d.get("peft_type", "LORA") != "LORA", f"peft_type={d.get('peft_type')!r} (only LORA is supported)"),
        (d.get("bias", "none") != "none", f"bias={d.get('bias')!r} (only 'none' is supported)"),
        (bool(d.get("fan_in_fan_out")), "fan_in_fan_out=true (only Linear layers are supported)"),
        (bool(d.get("modules_to_save")), "modules_to_save (fully trained extra modules are not supported)"),
        (d.get("layers_to_transform") is not None, "layers_to_transform (use a target_modules regex)"),
        (
            tp is not None and not (isinstance(tp, list) and all(isinstance(x, str) for x in tp)),
            f"target_parameters={tp!r} (expected a list of parameter names)",
        ),
        (bool(tp) and bool(d.get("use_dora")), "use_dora with target_parameters (PEFT's ParamWrapper has no DoRA)"),
        (
            not all(isinstance(p, dict) for p in patterns)
            or not all(_is_int(v) and v > 0 for v in patterns[0].values())
            or not all(_is_number(v) and v > 0 for v in patterns[1].values()),
            "rank_pattern/alpha_pattern (expected {pattern: positive number})",
        ),
    ]
    for bad, what in unsupported:
        if bad:
            raise CheckpointError(f"{file}: {what}")
    # the numbers every adapter tensor's shape and scaling come from (also where no LoraConfig checks them)
    r, alpha = d.get("r", 8), d.get("lora_alpha", 8)
    if not _is_int(r) or r < 1:
        raise CheckpointError(f"{file}: r={r!r} must be a positive integer; fix adapter_config.json")
    if not _is_number(alpha) or alpha <= 0:
        raise CheckpointError(f"{file}: lora_alpha={alpha!r} must be a finite number > 0; fix adapter_config.json")
    for key, pats in zip(("rank_pattern", "alpha_pattern"), patterns):
        for pat in pats:
            try:
                re.compile(pat)  # the position an error names is then the key's own
                lora_fused.pattern_regex(pat)
            except re.error as e:
                raise CheckpointError(
                    f"{file}: {key} key {pat!r} is not a valid regex ({e}); fix adapter_config.json"
                ) from None
    return d


def _target_patterns(model: nn.Layer, d: dict, file: str) -> list[str]:
    """Our target_modules regexes for what the adapter's config targets on `model`."""
    tm, tp = d.get("target_modules"), d.get("target_parameters")
    if not tp:
        if tm == "all-linear":
            return [r"(?!lm_head$).*"]
        if isinstance(tm, str):
            return [tm]
        if isinstance(tm, list) and tm:  # PEFT list: exact name or a '.'-separated suffix
            return [r"(?:.*\.)?" + re.escape(k) for k in tm]
        raise CheckpointError(f"{file}: target_modules={tm!r}: expected a list of module names or a regex")
    if _multimodal(_inventory(model)):
        raise CheckpointError(
            f"{file}: target_parameters (PEFT's fused-expert layout) on a model with modality experts: "
            "only text MoE models are supported; save the adapter per expert (transformers < 5 names)"
        )
    selected = []
    for name, layer in _candidates(model):
        if isinstance(layer, nn.Linear):
            if lora_fused.peft_selects(tm, name) or lora_fused.peft_selects(tp, f"{name}.weight"):
                selected.append(re.escape(name))
            continue
        projs = ["gate_proj", "up_proj"] if lora_fused.peft_selects(tp, f"{name}.{lora_fused.GATE_UP}") else []
        projs += ["down_proj"] if lora_fused.peft_selects(tp, f"{name}.{lora_fused.DOWN}") else []
        if projs:
            selected.append(rf"{re.escape(name)}\.\d+\.(?:{'|'.join(projs)})")
    if not selected:
        raise CheckpointError(
            f"{file}: target_modules={tm!r} and target_parameters={tp!r} select nothing in the model: "
            "the adapter was made for another base model"
        )
    return ["|".join(selected)]


@dataclass
class _Slot:
    """One LoRA pair of the file: `owner` (module name, expert projection or None); kind 'linear',
    'expert' (one expert of the per-expert layout) or a fused parameter (gate_up_proj, down_proj)."""

    owner: tuple[str, str | None]
    kind: str
    prefix: str
    shapes: dict[str, list[int]]
    scaling: float
    experts: int


def _slots(plan, d: dict, fused: bool) -> list[_Slot]:
    """What the file must hold for `plan`, with each pair's rank and scaling as PEFT gives them
    (rank_pattern / alpha_pattern keyed by module name, or by parameter name for target_parameters)."""
    r0, a0, rs, dora = d.get("r", 8), d.get("lora_alpha", 8), bool(d.get("use_rslora")), bool(d.get("use_dora"))

    def slot(owner, kind, key, prefix, fan_in, fan_out, experts=1, magnitude=False) -> _Slot:
        R = int(lora_fused.pattern_value(d.get("rank_pattern"), key, r0))
        alpha = lora_fused.pattern_value(d.get("alpha_pattern"), key, a0)
        shapes = {f"{prefix}.lora_A.weight": [R * experts, fan_in], f"{prefix}.lora_B.weight": [fan_out, R * experts]}
        if magnitude:
            shapes[f"{prefix}.lora_magnitude_vector"] = [fan_out]
        return _Slot(owner, kind, prefix, shapes, alpha / (math.sqrt(R) if rs else R), experts)

    out = []
    for name, layer, projs in plan:
        if not projs:
            fan_in, fan_out = layer.weight.shape
            param = fused and not lora_fused.peft_selects(d.get("target_modules"), name)
            key = f"{name}.weight" if param else name
            out.append(slot((name, None), "linear", key, PEFT_PREFIX + name, fan_in, fan_out, magnitude=dora))
        elif fused:
            E, H, I = layer.gate_proj.shape
            targeted = [q for q, ps in lora_fused.FUSED_PROJS.items() if set(ps) & set(projs)]
            prefixes = lora_fused.wrapper_prefixes(name, targeted)
            for q in targeted:
                fan_in, fan_out = (H, 2 * I) if q == lora_fused.GATE_UP else (I, H)
                out.append(slot((name, q), q, f"{name}.{q}", PEFT_PREFIX + prefixes[q], fan_in, fan_out, E))
        else:
            for p in projs:
                fan_in, fan_out = getattr(layer, p).shape[1:]
                for e in range(layer.num_experts):
                    mod = f"{expert_module_name(name, layer, e)}.{p}"
                    out.append(slot((name, p), "expert", mod, PEFT_PREFIX + mod, fan_in, fan_out, magnitude=dora))
    return out


def _check_names(model: nn.Layer, f, file: str, slots: list[_Slot], missing_hint: str, extra: bool = False) -> None:
    """Every tensor of the file has a place (unless `extra`: a model holding part of the layers)
    and every place its tensor, of the right shape."""
    expected = {n: shape for s in slots for n, shape in s.shapes.items()}
    names = list(f.keys())
    known = {n for n, _ in _candidates(model)} | {n for n, _ in lora_layers(model)}
    for n in names:
        if n not in expected and not extra:
            module = re.sub(r"\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)$", "", n)
            module = re.sub(r"(\.base_layer)+$", "", module)
            module = module[len(PEFT_PREFIX) :] if module.startswith(PEFT_PREFIX) else module
            owned = module in known or re.sub(r"\.\d+\.\w+$", "", module) in known
            why = (
                "which adapter_config.json target_modules (or target_parameters) does not select: the two files disagree"
                if owned
                else "which the model does not have: the adapter was made for another base model"
            )
            raise CheckpointError(f"{file}: tensor {n} is for module {module}, {why}")
    for n, want in expected.items():
        if n not in names:
            raise CheckpointError(f"{file}: tensor {n} is missing ({missing_hint})")
        got = list(f.get_slice(n).get_shape())
        if got != want:
            raise CheckpointError(
                f"{file}: tensor {n} has shape {got}, the model expects {want}: "
                "the adapter's base model has other shapes (check base_model_name_or_path)"
            )


def _read_pieces(f, slots: list[_Slot], r: int) -> dict[tuple[str, str | None], list[list]]:
    """(module, projection) -> per expert [A [in, R], B [R, out], scaling, magnitude or None] in
    Paddle's orientation. A fused gate_up_proj pair becomes gate and up (lora_fused.split_gate_up)."""
    pieces: dict[tuple[str, str | None], list[list]] = {}
    for s in slots:
        a, b = f.get_tensor(f"{s.prefix}.lora_A.weight"), f.get_tensor(f"{s.prefix}.lora_B.weight")
        if s.kind in ("linear", "expert"):
            mag = f"{s.prefix}.lora_magnitude_vector"
            m = f.get_tensor(mag) if mag in s.shapes else None
            pieces.setdefault(s.owner, []).append([a.T, b.T, s.scaling, m])
            continue
        a_t, b_t = lora_fused.unpack(a, b, s.experts)
        halves = lora_fused.split_gate_up(a_t, b_t, r) if s.kind == lora_fused.GATE_UP else [(a_t, b_t)]
        for p, (at, bt) in zip(lora_fused.FUSED_PROJS[s.kind], halves):
            pieces[(s.owner[0], p)] = [[at[e].T, bt[e].T, s.scaling, None] for e in range(s.experts)]
    return pieces


def _fit(a: paddle.Tensor, b: paddle.Tensor, s: float, layer, what: str, file: str, exact: bool):
    """A [in, R], B [R, out] at scaling s as the layer's rank and scaling: B rescaled, the rank
    zero-padded (a padded column of A meets a zero row of B: the update is unchanged)."""
    R, r = a.shape[1], layer.r
    if R > r or (exact and R != r):
        raise CheckpointError(
            f"{file}: the adapter of {what} has rank {R}, the model's adapters rank {r}: "
            "the adapter was saved with other lora settings"
        )
    if s != layer.scaling:
        b = b.astype(layer.compute_dtype) * (s / layer.scaling)
    if R < r:
        a = paddle.concat([a, paddle.zeros([a.shape[0], r - R], dtype=a.dtype)], axis=1)
        b = paddle.concat([b, paddle.zeros([r - R, b.shape[1]], dtype=b.dtype)], axis=0)
    return a, b


def _fill(model: nn.Layer, pieces: dict, file: str, exact: bool = False) -> None:
    """Copy read pieces into the model's adapters; a fused gate/up half the model does not adapt
    must be zero (it is when the adapter was saved from such a model)."""
    with paddle.no_grad():
        for name, layer in lora_layers(model):
            if isinstance(layer, LoraLinear):
                [(a, b, s, m)] = pieces.pop((name, None))
                a, b = _fit(a, b, s, layer, name, file, exact)
                for p, t in ((layer.lora_A, a), (layer.lora_B, b), (layer.lora_magnitude_vector, m)):
                    if p is not None and t is not None:
                        p.set_value(t.astype(p.dtype))
                continue
            for p in layer.projs:
                items = pieces.pop((name, p))
                fitted = [_fit(a, b, s, layer, f"{name}.<e>.{p}", file, exact) for a, b, s, _ in items]
                for k, ts in (("lora_A", [x for x, _ in fitted]), ("lora_B", [y for _, y in fitted])):
                    param = getattr(layer, f"{p}_{k}")
                    param.set_value(paddle.stack(ts).astype(param.dtype))
                if layer.use_dora:
                    param = getattr(layer, f"{p}_lora_magnitude_vector")
                    param.set_value(paddle.stack([m for *_, m in items]).astype(param.dtype))
        for (name, p), items in pieces.items():
            if any(bool((b != 0).any()) for _, b, _, _ in items):
                raise CheckpointError(
                    f"{file}: the fused gate_up_proj adapter of {name} changes {p}, which the model's adapters "
                    "do not cover: load it with load_adapter on the base model"
                )


def load_adapter(model: nn.Layer, path: str, base_dtype: str | None = None) -> LoraConfig:
    """Apply LoRA as `path`/adapter_config.json says and load adapter_model.safetensors, in either
    PEFT layout (per-expert Linears, or target_parameters on transformers 5's fused experts).
    Everything is checked before the model is changed; errors name the tensor. Ranks that differ
    per module (rank_pattern, a fused gate_up whose halves share A) load at the largest rank, the
    others zero-padded: the same adapted model, and trainable further."""
    from erniekit.utils.io import open_safetensors

    d = _read_adapter_config(path)
    cfg_file = os.path.join(path, ADAPTER_CONFIG_NAME)
    file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    if not os.path.isfile(file):
        hint = (
            " (adapter_model.bin is pickle and is not loaded: convert it to safetensors)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise CheckpointError(f"{file}: not found{hint}")
    patterns = _target_patterns(model, d, cfg_file)
    try:
        config = LoraConfig(
            r=d.get("r", 8),
            lora_alpha=d.get("lora_alpha", 8),
            lora_dropout=d.get("lora_dropout", 0.0),
            target_modules=patterns,
            use_rslora=bool(d.get("use_rslora")),
            use_dora=bool(d.get("use_dora")),
            base_dtype=base_dtype,
        )
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    try:
        plan = _plan(model, config)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    with open_safetensors(file) as f:
        slots = _slots(plan, d, bool(d.get("target_parameters")))
        _check_names(model, f, file, slots, "adapter_config.json targets its module")
        pieces = _read_pieces(f, slots, config.r)
    rank = max(a.shape[1] for items in pieces.values() for a, *_ in items)
    if rank != config.r:  # the largest rank; alpha so that the scaling stays the config's
        config = replace(config, r=rank, lora_alpha=config.scaling * (math.sqrt(rank) if config.use_rslora else rank))
    apply_lora(model, config)
    _fill(model, pieces, file)
    return config


def load_adapter_weights(model: nn.Layer, path: str) -> None:
    """Refill the adapters of a model that already has LoRA applied (resume), from `path` in
    either layout; ranks must be the model's. The model may hold only some of the adapted layers
    (a pipeline stage): the file's other tensors are skipped."""
    from erniekit.utils.io import open_safetensors

    file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    layers = lora_layers(model)
    if not layers and has_lora(model):
        return  # a pipeline stage whose layers hold no adapter: the file's tensors are the other stages'
    if not layers:
        raise CheckpointError(f"{path}: holds a LoRA adapter but the model has none; set fine_tuning=LoRA")
    first = layers[0][1]
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME)):
        d = _read_adapter_config(path)
    else:  # the model's own settings
        d = {"r": first.r, "lora_alpha": first.scaling * first.r, "use_dora": first.use_dora}
    plan = [(n, l, getattr(l, "projs", ())) for n, l in layers]
    with open_safetensors(file) as f:
        slots = _slots(plan, d, bool(d.get("target_parameters")))
        _check_names(model, f, file, slots, "the adapter was saved with other lora settings", extra=True)
        pieces = _read_pieces(f, slots, first.r)
    _fill(model, pieces, file, exact=True)
