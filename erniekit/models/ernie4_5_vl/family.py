"""ERNIE-4.5-VL in the model-family registry (`model_type: ernie4_5_vl_moe`). Paddle loads only when
a model is built, loaded or saved; the tokenizer is the ERNIE 4.5 one."""

from __future__ import annotations

from typing import Any

from erniekit.models.ernie4_5.family import ERNIE4_5
from erniekit.models.ernie4_5_vl.configuration import MODEL_TYPE, PRESETS, Ernie4_5_VLConfig
from erniekit.models.registry import ModelFamily, register_model_family


def _build(config: Ernie4_5_VLConfig) -> Any:
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration

    return Ernie4_5_VLForConditionalGeneration(config)


def _load_weights(model: Any, path: str) -> None:
    from erniekit.models.ernie4_5_vl.checkpoint import load_state_into
    from erniekit.models.ernie4_5_vl.processor import load_image_settings
    from erniekit.models.ernie4_5_vl.video import load_video_settings

    load_state_into(model, path)
    model.image_settings = load_image_settings(path)
    model.video_settings = load_video_settings(path)


def _state_dict(model: Any, dtype: str | None = None) -> dict:
    from erniekit.models.ernie4_5_vl.checkpoint import hf_state_dict

    return hf_state_dict(model, dtype)


def _save(model: Any, path: str, tokenizer: Any = None, **options: Any) -> None:
    from erniekit.models.ernie4_5_vl.checkpoint import save_pretrained

    save_pretrained(model, path, tokenizer=tokenizer, **options)


ERNIE4_5_VL = register_model_family(
    ModelFamily(
        name="ernie4_5_vl",
        model_types=(MODEL_TYPE,),
        presets=lambda: PRESETS,
        read_config=Ernie4_5_VLConfig.from_pretrained,
        build=_build,
        load_weights=_load_weights,
        loads_every_parameter=True,  # load_state_into raises on a missing tensor
        check_weights=ERNIE4_5.check_weights,  # its text model's tensors have the same names
        state_dict=_state_dict,
        save=_save,
        load_tokenizer=ERNIE4_5.load_tokenizer,
        default_tokenizer=ERNIE4_5.default_tokenizer,
    )
)
