"""ERNIE 4.5 text models: config + presets, Paddle modeling, HF-layout checkpoints, tokenizer.

The names below load on first use, so `family.py` (what the model-family registry imports) and
`configuration.py` are importable without paddle."""

from importlib import import_module

_EXPORTS = {
    "PRESETS": "configuration",
    "Ernie4_5Config": "configuration",
    "get_preset": "configuration",
    "CausalLMOutput": "modeling",
    "Ernie4_5ForCausalLM": "modeling",
    "KVCache": "modeling",
    "from_pretrained": "checkpoint",
    "load_state_into": "checkpoint",
    "save_pretrained": "checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
