"""ERNIE-4.5-VL checkpoints in the hub layout (the names transformers reads and writes for
`ernie4_5_vl_moe`): the text model as ERNIE 4.5 MoE's (`model.layers.N...`, text experts
numbered first, then vision experts), routers stored [hidden, experts] as `mlp.gate.weight` and
`mlp.gate.weight_1`, both correction biases in one [2, experts] `mlp.moe_statics.
e_score_correction_bias`, the vision transformer under `model.vision_model.` and the resampler
under `model.resampler_model.` (its MLPs as `.0` / `.2` / `.3`).
"""

from __future__ import annotations

import re
import warnings

import paddle

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import checkpoint as text_ckpt
from erniekit.models.ernie4_5.checkpoint import _check_shape, _ShardReader, _Spec
from erniekit.utils.dtensor import assign_full, to_dense

_RESAMPLER_MLP = {"fc1": "0", "fc2": "2", "ln": "3"}
_IGNORED_UNEXPECTED = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")
_SPECS_ATTR = "_erniekit_vl_specs"


def _specs(model) -> dict[str, _Spec]:
    specs = model.__dict__.get(_SPECS_ATTR)
    if specs is not None:
        return specs
    specs = text_ckpt._specs(model)
    for name, spec in specs.items():
        if name.startswith("vision_model."):
            spec.hf_names = ["model." + name]
        elif name.startswith("resampler_model."):
            hf = re.sub(r"_linear\.(fc1|fc2|ln)\.", lambda m: f"_linear.{_RESAMPLER_MLP[m[1]]}.", name)
            spec.hf_names = ["model." + hf]
        elif m := re.match(r"(.*\.mlp)\.gate(?:_(\d+))?\.weight$", name):
            spec.kind = "copy"  # stored [hidden, experts], as ours
            spec.hf_names = [f"{m[1]}.gate.weight" + (f"_{m[2]}" if m[2] else "")]
        elif m := re.match(r"(.*\.mlp)\.gate(?:_(\d+))?\.e_score_correction_bias$", name):
            spec.kind = f"row{int(m[2] or 0)}"  # one row of the [modalities, experts] tensor
            spec.hf_names = [f"{m[1]}.moe_statics.e_score_correction_bias"]
    object.__setattr__(model, _SPECS_ATTR, specs)
    return specs


def load_state_into(model, path: str) -> None:
    reader = _ShardReader(path)
    used: set[str] = set()
    for name, p in model.named_parameters():
        spec = _specs(model)[name]
        missing = [n for n in spec.hf_names if n not in reader.where]
        if missing:
            raise CheckpointError(
                f"{path}: tensor {missing[0]} is missing from the checkpoint (needed for {name}); the weights "
                "are incomplete or belong to another model: re-save them"
            )
        expected = list(p.shape)
        n = spec.hf_names[0]
        if spec.kind == "experts":
            for e in spec.hf_names:
                _check_shape(path, e, reader.shape(e), [expected[2], expected[1]])
            value = paddle.stack([reader.get(e).astype(p.dtype).T for e in spec.hf_names])
        elif spec.kind.startswith("row"):
            row = int(spec.kind[3:])
            shape = reader.shape(n)
            if len(shape) != 2 or shape[1] != expected[1] or shape[0] <= row:
                raise CheckpointError(
                    f"{path}: tensor {n} has shape {shape}, the model config expects [2, {expected[1]}]: "
                    "config.json and weights disagree: use the config.json the weights were saved with"
                )
            value = reader.get(n).astype(p.dtype)[row : row + 1]
        else:
            _check_shape(path, n, reader.shape(n), expected[::-1] if spec.kind == "transpose" else expected)
            value = reader.get(n).astype(p.dtype)
            if spec.kind == "transpose":
                value = value.T
        assign_full(p, value)
        used.update(spec.hf_names)
    extra = [n for n in reader.where if n not in used and not _IGNORED_UNEXPECTED.search(n)]
    if extra:
        warnings.warn(f"{path}: {len(extra)} checkpoint tensors were not used, e.g. {extra[:3]}", stacklevel=2)


def hf_state_dict(model, dtype: str | None = None) -> dict[str, paddle.Tensor]:
    out: dict[str, paddle.Tensor] = {}
    rows: dict[str, dict[int, paddle.Tensor]] = {}
    for name, p in model.named_parameters():
        spec = _specs(model)[name]
        t = to_dense(p.detach())
        keep_fp32 = "e_score_correction_bias" in name or re.search(r"\.mlp\.gate(_\d+)?\.weight$", name)
        if dtype and not keep_fp32:
            t = t.astype(dtype)
        if spec.kind == "experts":
            for e, n in enumerate(spec.hf_names):
                out[n] = t[e].T.contiguous()
        elif spec.kind.startswith("row"):
            rows.setdefault(spec.hf_names[0], {})[int(spec.kind[3:])] = t.reshape([-1])
        elif spec.kind == "transpose":
            out[spec.hf_names[0]] = t.T.contiguous()
        else:
            out[spec.hf_names[0]] = t.contiguous()
    for n, parts in rows.items():
        out[n] = paddle.stack([parts[i] for i in sorted(parts)]).contiguous()
    return out


def save_pretrained(model, path: str, tokenizer=None, **options) -> None:
    """The text model's writer (staging, shards, index, generation config) with the VL tensors."""
    state = options.pop("state", None)
    if state is None:
        state = hf_state_dict(model, options.get("dtype"))
    text_ckpt.save_pretrained(model, path, tokenizer=tokenizer, state=state, **options)
