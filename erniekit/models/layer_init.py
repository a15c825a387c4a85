"""Start a model from another checkpoint's layers: a shallower student from its teacher, as
DistilBERT initialised its 6 layers from every other of BERT's 12 (Sanh et al. 2019).

`init_layers_from` (TrainConfig) names the checkpoint; `init_layer_map[i]` is the checkpoint layer
that model layer i starts from (default `even_layer_map`: evenly spaced, the first and last kept).
The embeddings, the final norm and the head come as they are; an untied head starts from a tied
source's embedding (what that source's head computed). Every other weight must have a counterpart
of the same shape: a narrower or otherwise reshaped student cannot start this way, and the error
names the first weight that does not fit.
"""

from __future__ import annotations

import re

import numpy as np

from erniekit.errors import ConfigError

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def even_layer_map(n_layers: int, n_source: int) -> list[int]:
    """n_layers indices into n_source layers, evenly spaced, first and last kept ([0, 3] for 2 of 4)."""
    if n_layers == 1:
        return [0]
    return [round(i * (n_source - 1) / (n_layers - 1)) for i in range(n_layers)]


def depth_fraction_layer_map(n_layers: int, n_source: int) -> list[int]:
    """Layer i -> source layer (i + 1) * N / M - 1: the same fraction of depth, the last from the
    last (TinyBERT's uniform map for layer outputs; [1, 3] for 2 of 4). A model deeper than its
    source maps its first layers to source layer 0 ([0, 0, 0, 1] for 4 of 2)."""
    return [max(0, (i + 1) * n_source // n_layers - 1) for i in range(n_layers)]


def source_name(name: str, layer_map: list[int]) -> str:
    """The source checkpoint's name of this model's parameter `name`."""
    m = _LAYER.match(name)
    return name if m is None else f"{m.group(1)}{layer_map[int(m.group(2))]}{m.group(3)}"


def init_from_layers(model, source, layer_map: list[int] | None, where: str = "init_layers_from") -> list[int]:
    """Copy `source`'s weights (a loaded model of the same family) into `model`, layer i from
    source layer layer_map[i]; the map used."""
    n, n_src = model.config.num_hidden_layers, source.config.num_hidden_layers
    layer_map = list(layer_map) if layer_map is not None else even_layer_map(n, n_src)
    if len(layer_map) != n or any(not 0 <= i < n_src for i in layer_map):
        raise ConfigError(
            f"init_layer_map={layer_map}: needs {n} indices (one per layer of the model) in [0, {n_src}) "
            f"(the layers of {where})"
        )
    src = source.state_dict()
    tied_source = getattr(source.config, "tie_word_embeddings", False)
    for name, param in model.state_dict().items():
        key = source_name(name, layer_map)
        if key not in src and name == "lm_head.weight" and tied_source:
            key = "model.embed_tokens.weight"  # [V, H] where the untied head is [H, V]
            value = np.ascontiguousarray(src[key].numpy().T)
        elif key not in src:
            raise ConfigError(_missing(name, key, layer_map, where))
        else:
            value = src[key].numpy()
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"{where}: {key} is {list(value.shape)} where the model's {name} is {list(param.shape)}; "
                "the student may have fewer layers, not other shapes (match model_overrides to the checkpoint)"
            )
        param.set_value(value.astype(np.asarray(param.numpy()).dtype, copy=False))
    return layer_map


def _missing(name: str, key: str, layer_map: list[int], where: str) -> str:
    m = _LAYER.match(name)
    if m is None:
        return f"{where}: the checkpoint has no {key} for the model's {name}; it must be the same family"
    i = int(m.group(2))
    return (
        f"init_layer_map: the model's layer {i} and layer {layer_map[i]} of {where} differ in kind ({key} is "
        f"missing for {name}); map dense layers to dense ones and MoE layers to MoE ones"
    )
