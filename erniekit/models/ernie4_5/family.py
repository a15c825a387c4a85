"""ERNIE 4.5 text models (dense and MoE) in the model-family registry. Paddle loads only when a
model is built, loaded or saved."""

from __future__ import annotations

from typing import Any

from erniekit.models.ernie4_5.configuration import PRESETS, Ernie4_5Config
from erniekit.models.registry import ModelFamily, register_model_family


def _build(config: Ernie4_5Config) -> Any:
    from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM

    return Ernie4_5ForCausalLM(config)


def _load_weights(model: Any, path: str) -> None:
    from erniekit.models.ernie4_5.checkpoint import load_state_into

    load_state_into(model, path)


def _check_weights(config: Ernie4_5Config, path: str, overridden: bool) -> None:
    from erniekit.models.ernie4_5.checkpoint import check_config_against_weights

    check_config_against_weights(config, path, overridden)


def _state_dict(model: Any, dtype: str | None = None) -> dict:
    from erniekit.models.ernie4_5.checkpoint import hf_state_dict

    return hf_state_dict(model, dtype)


def _save(model: Any, path: str, tokenizer: Any = None, **options: Any) -> None:
    from erniekit.models.ernie4_5.checkpoint import save_pretrained

    save_pretrained(model, path, tokenizer=tokenizer, **options)


def _load_tokenizer(path: str) -> Any:
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(path)


def _checkpoint_names(model: Any) -> dict:
    from erniekit.models.ernie4_5.checkpoint import _specs_cache

    return {name: (spec.kind, list(spec.hf_names)) for name, spec in _specs_cache(model).items()}


def _default_tokenizer() -> Any:
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    return default_tokenizer()


ERNIE4_5 = register_model_family(
    ModelFamily(
        name="ernie4_5",
        model_types=("ernie4_5", "ernie4_5_moe"),
        presets=lambda: PRESETS,
        read_config=Ernie4_5Config.from_pretrained,
        build=_build,
        load_weights=_load_weights,
        loads_every_parameter=True,  # load_state_into raises on a missing tensor
        check_weights=_check_weights,  # the safetensors headers' shapes, before the model is built
        state_dict=_state_dict,
        save=_save,
        load_tokenizer=_load_tokenizer,
        default_tokenizer=_default_tokenizer,
        checkpoint_names=_checkpoint_names,
    )
)
