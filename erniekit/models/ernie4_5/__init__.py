"""ERNIE 4.5 text models: config + presets, Paddle modeling, HF-layout checkpoints, tokenizer."""

from erniekit.models.ernie4_5.checkpoint import from_pretrained, load_state_into, save_pretrained
from erniekit.models.ernie4_5.configuration import PRESETS, Ernie4_5Config, get_preset
from erniekit.models.ernie4_5.modeling import CausalLMOutput, Ernie4_5ForCausalLM, KVCache

__all__ = [
    "PRESETS",
    "Ernie4_5Config",
    "get_preset",
    "CausalLMOutput",
    "Ernie4_5ForCausalLM",
    "KVCache",
    "from_pretrained",
    "load_state_into",
    "save_pretrained",
]
