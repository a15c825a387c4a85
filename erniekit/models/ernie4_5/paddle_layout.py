"""The Paddle checkpoint layout of the `-Paddle` ERNIE 4.5 repositories (what FastDeploy and
PaddleFormers read), mapped onto our model for loading and exporting. docs/paddle_layout.md
lists the public sources each rule comes from.

The layout, against the PT (Hugging Face) one that checkpoint.py maps:
- prefix `ernie.` instead of `model.` (`ernie.embed_tokens.weight`, `ernie.layers.N...`,
  `ernie.norm.weight`, `ernie.mtp_block.N...`); `lm_head.weight` keeps its name;
- every Linear weight is stored [in, out] (Paddle's orientation, also ours: no transposes);
- `self_attn.qkv_proj` = q | k | v concatenated along the output axis, each all of its heads
  (num_attention_heads * head_dim, then num_key_value_heads * head_dim twice);
- `mlp.up_gate_proj` (dense MLP, shared experts, each routed expert) = gate | up along the
  output axis: silu is applied to the first half;
- the router `mlp.gate.weight` is [hidden, experts] float32 and the correction bias
  `mlp.moe_statics.e_score_correction_bias` is [1, experts] (both as ours);
- tied embeddings: `lm_head.weight`, when written at all, is ignored; untied it is [hidden, vocab].
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import paddle

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5.configuration import Ernie4_5Config
from erniekit.models.hf_files import INDEX_NAME, WEIGHTS_NAME
from erniekit.utils.dtensor import assign_full, to_dense

PREFIX = "ernie"  # the base model's name in ERNIEKit / PaddleFormers / FastDeploy checkpoints
# config.json `architectures` FastDeploy registers for the Paddle layout (fastdeploy/config.py ErnieArchitectures)
ARCHITECTURES = {"ernie4_5": "Ernie4_5_ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
_FUSED = re.compile(r"\.(qkv_proj|up_gate_proj)\.(weight|bias)$")
_IGNORED_UNEXPECTED = re.compile(r"rotary_emb\.inv_freq$")
PDPARAMS_HINT = (
    "convert it to safetensors once, where you trust the file (it is a pickle): "
    'python -c "import paddle; from safetensors.paddle import save_file; '
    "save_file(paddle.load('model_state.pdparams'), 'model.safetensors')\""
)


@dataclass(frozen=True)
class _Part:
    """A Paddle tensor, or the columns [start, stop) of its last axis (one block of a fused tensor)."""

    name: str
    cols: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Spec:
    """Where one of our parameters lives: one part, or one part per routed expert stacked on axis 0."""

    parts: tuple[_Part, ...]
    stacked: bool = False


def is_paddle_layout(names: Iterable[str]) -> bool:
    """A checkpoint is in the Paddle layout when it holds fused attention or MLP tensors."""
    return any(_FUSED.search(n) for n in names)


def checkpoint_tensor_names(path: str) -> list[str]:
    """The tensor names of the checkpoint directory `path` (its index, else its one file), read
    without loading a tensor."""
    from erniekit.utils.io import open_safetensors, read_json_object

    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        weight_map = read_json_object(index, f"fix {INDEX_NAME}").get("weight_map")
        return list(weight_map) if isinstance(weight_map, dict) else []
    single = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(single):
        return []
    with open_safetensors(single, "numpy") as f:
        return list(f.keys())


def check_supported(config, where: str) -> None:
    """The configurations the layout's rules are known for; anything else is refused, not guessed."""
    if config.num_modalities != 1:
        raise CheckpointError(
            f"{where}: the Paddle layout is mapped for ERNIE 4.5 text models only; "
            "load or export this vision-language model in the Hugging Face layout (--format hf)"
        )
    if config.num_key_value_heads == config.num_attention_heads:
        raise CheckpointError(
            f"{where}: num_key_value_heads == num_attention_heads: ERNIEKit fuses qkv_proj per head for such "
            "models and PaddleFormers/FastDeploy as q|k|v, so the order is ambiguous; use the Hugging Face layout"
        )
    ratio = config.extra.get("compression_ratio", 1.0)
    if ratio != 1.0:
        raise CheckpointError(
            f"{where}: compression_ratio={ratio} (scaled rope positions) is not supported; "
            "only checkpoints with compression_ratio 1.0 load"
        )
    if config.extra.get("use_rmsnorm", True) is not True:
        raise CheckpointError(f"{where}: use_rmsnorm=false (LayerNorm) is not supported; ERNIE 4.5 uses RMSNorm")


def _rename(name: str, prefix: str) -> str:
    """Our top-level names -> the checkpoint's: model.* and mtp.* live under the prefix."""
    for ours in ("model.", "mtp."):
        if name.startswith(ours):
            return f"{prefix}.{name[len(ours) :]}"
    return name


def paddle_specs(model, prefix: str = PREFIX) -> tuple[dict[str, _Spec], dict[str, list[int]]]:
    """Our parameter name -> _Spec, and each Paddle tensor's full shape (fused tensors whole)."""
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    specs: dict[str, _Spec] = {}
    shapes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        shape = list(p.shape)
        attn = re.match(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$", name)
        mlp = re.match(r"(.*)\.(gate|up)_proj\.(weight|bias)$", name)
        experts = re.match(r"(.*\.mlp)\.experts\.(gate_proj|up_proj|down_proj)$", name)
        if attn:
            fused = _rename(f"{attn[1]}.self_attn.qkv_proj.{attn[3]}", prefix)
            start = {"q": 0, "k": q, "v": q + kv}[attn[2]]
            specs[name] = _Spec((_Part(fused, (start, start + shape[-1])),))
            shapes[fused] = shape[:-1] + [q + 2 * kv]
        elif mlp:
            fused = _rename(f"{mlp[1]}.up_gate_proj.{mlp[3]}", prefix)
            inter = shape[-1]
            start = 0 if mlp[2] == "gate" else inter
            specs[name] = _Spec((_Part(fused, (start, start + inter)),))
            shapes[fused] = shape[:-1] + [2 * inter]
        elif experts:
            inter = shape[2] if experts[2] != "down_proj" else shape[1]
            parts = []
            for e in range(shape[0]):
                if experts[2] == "down_proj":
                    part = _Part(_rename(f"{experts[1]}.experts.{e}.down_proj.weight", prefix))
                    shapes[part.name] = shape[1:]
                else:
                    start = 0 if experts[2] == "gate_proj" else inter
                    part = _Part(
                        _rename(f"{experts[1]}.experts.{e}.up_gate_proj.weight", prefix), (start, start + inter)
                    )
                    shapes[part.name] = [shape[1], 2 * inter]
                parts.append(part)
            specs[name] = _Spec(tuple(parts), stacked=True)
        else:
            target = name.replace(".gate.e_score_correction_bias", ".moe_statics.e_score_correction_bias")
            target = _rename(target, prefix)
            specs[name] = _Spec((_Part(target),))
            shapes[target] = shape
    return specs, shapes


def _prefix_of(names: Iterable[str]) -> str:
    names = set(names)
    return PREFIX if f"{PREFIX}.embed_tokens.weight" in names else "model"


def load_paddle_layout(model, path: str, reader) -> None:
    """Fill `model` from a Paddle-layout checkpoint (reader: checkpoint._ShardReader of `path`).
    Column blocks of fused tensors are read lazily, so no fused tensor is held whole."""
    check_supported(model.config, os.path.join(path, "config.json"))
    quantized = [n for n in reader.where if n.endswith((".quant_weight", ".weight_scale", "_scale"))]
    if quantized:
        raise CheckpointError(
            f"{path}: tensor {quantized[0]} belongs to a quantized checkpoint; erniekit loads the "
            "bfloat16/float16/float32 -Paddle checkpoints: download the unquantized one"
        )
    prefix = _prefix_of(reader.where)
    specs, shapes = paddle_specs(model, prefix)
    checked: set[str] = set()
    for name, p in model.named_parameters():
        spec = specs[name]
        values = []
        for part in spec.parts:
            if part.name not in reader.where:
                hint = (
                    "; set num_nextn_predict_layers to 0 in config.json to load without MTP heads"
                    if name.startswith("mtp.")
                    else "; the weights are incomplete or belong to another model: re-save them"
                )
                raise CheckpointError(
                    f"{path}: tensor {part.name} is missing from the checkpoint (needed for {name}){hint}"
                )
            if part.name not in checked:
                got = reader.shape(part.name)  # also refuses a non-float dtype
                if list(got) != shapes[part.name]:
                    raise CheckpointError(
                        f"{reader.where[part.name]}: tensor {part.name} has shape {list(got)}, the model config "
                        f"expects {shapes[part.name]}: config.json and weights disagree: use the config.json "
                        "the weights were saved with"
                    )
                checked.add(part.name)
            if part.cols is None:
                values.append(reader.get(part.name))
            else:
                values.append(reader.columns(part.name, *part.cols))
        value = paddle.stack(values) if spec.stacked else values[0]
        assign_full(p, value.astype(p.dtype))
    extra = [n for n in reader.where if n not in checked and not _IGNORED_UNEXPECTED.search(n)]
    if model.config.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    if model.mtp is None:
        extra = [n for n in extra if not n.startswith(f"{prefix}.mtp")]
    if extra:
        warnings.warn(f"{path}: {len(extra)} checkpoint tensors were not used, e.g. {extra[:3]}", stacklevel=2)


def paddle_state_dict(model, dtype: str | None = None, prefix: str = PREFIX) -> dict[str, paddle.Tensor]:
    """Our parameters in the Paddle layout: fused tensors assembled from their blocks, contiguous.
    The router and its correction bias stay float32 (as Paddle keeps them) whatever `dtype` says."""
    check_supported(model.config, "export")
    specs, shapes = paddle_specs(model, prefix)
    blocks: dict[str, list[tuple[int, paddle.Tensor]]] = {}
    for name, p in model.named_parameters():
        t = to_dense(p.detach())
        if dtype and "e_score_correction_bias" not in name and not name.endswith(".mlp.gate.weight"):
            t = t.astype(dtype)
        spec = specs[name]
        for e, part in enumerate(spec.parts):
            blocks.setdefault(part.name, []).append((part.cols[0] if part.cols else 0, t[e] if spec.stacked else t))
    out = {}
    for n, parts in blocks.items():
        parts.sort(key=lambda x: x[0])
        whole = parts[0][1] if len(parts) == 1 else paddle.concat([t for _, t in parts], axis=-1)
        if list(whole.shape) != shapes[n]:  # every block of a fused tensor was found, in order
            raise CheckpointError(f"export: tensor {n} assembled as {list(whole.shape)}, expected {shapes[n]}")
        out[n] = whole.contiguous()
    return out


def paddle_config_dict(d: dict, model_type: str, dtype: str) -> dict:
    """config.json (our to_dict) as FastDeploy reads a Paddle-layout checkpoint: its `architectures`
    name, and `dtype` without `torch_dtype` (FastDeploy takes `torch_dtype` to mean the PT layout)."""
    d = dict(d)
    d.pop("torch_dtype", None)
    d.pop("transformers_version", None)  # above 4.56 it too would make FastDeploy read the PT layout
    d["architectures"] = [ARCHITECTURES[model_type]]
    d["dtype"] = dtype
    return d


def paddle_config(config: Ernie4_5Config, dtype: str) -> Ernie4_5Config:
    """The same config, written (save_pretrained / to_dict) as paddle_config_dict says."""
    c = _PaddleConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    c.export_dtype = dtype
    return c


class _PaddleConfig(Ernie4_5Config):
    export_dtype = "float32"

    def to_dict(self) -> dict:
        return paddle_config_dict(super().to_dict(), self.model_type, self.export_dtype)


def refuse_pickle_only(path: str) -> None:
    """A directory whose only weights are .pdparams (a pickle) is refused with how to convert it."""
    if os.path.isfile(os.path.join(path, WEIGHTS_NAME)) or os.path.isfile(os.path.join(path, INDEX_NAME)):
        return
    found = sorted(f for f in os.listdir(path) if f.endswith(".pdparams"))
    if found:
        hint = PDPARAMS_HINT.replace("model_state.pdparams", found[0])
        raise CheckpointError(f"{os.path.join(path, found[0])}: pickle weights are not loaded; {hint}")
