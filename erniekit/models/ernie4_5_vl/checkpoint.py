"""ERNIE-4.5-VL checkpoints in the hub layout (the names transformers reads and writes for
`ernie4_5_vl_moe`): the text model as ERNIE 4.5 MoE's (`model.layers.N...`, text experts
numbered first, then vision experts), routers stored [hidden, experts] as `mlp.gate.weight` and
`mlp.gate.weight_1`, both correction biases in one [2, experts] `mlp.moe_statics.
e_score_correction_bias`, the vision transformer under `model.vision_model.` and the resampler
under `model.resampler_model.` (its MLPs as `.0` / `.2` / `.3`).
"""

from __future__ import annotations

import re

import paddle

from erniekit.models.ernie4_5 import checkpoint as text_ckpt
from erniekit.models.ernie4_5.checkpoint import _Spec

_RESAMPLER_MLP = {"fc1": "0", "fc2": "2", "ln": "3"}
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
    text_ckpt.load_state_into(model, path, _specs(model))


def hf_state_dict(model, dtype: str | None = None) -> dict[str, paddle.Tensor]:
    return text_ckpt.hf_state_dict(model, dtype, _specs(model))


def save_pretrained(model, path: str, tokenizer=None, **options) -> None:
    """The text model's writer (staging, shards, index, generation config) with the VL tensors."""
    state = options.pop("state", None)
    if state is None:
        state = hf_state_dict(model, options.get("dtype"))
    text_ckpt.save_pretrained(model, path, tokenizer=tokenizer, state=state, **options)
