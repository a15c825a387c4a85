"""generation_config.json: the decoding defaults transformers' `generate` (and FastDeploy) read.

A checkpoint keeps what its source said (the authors' sampling settings, extra fields), with every
id that ends an assistant turn added to `eos_token_id`, so `generate` stops where `erniekit chat`
stops. A model with no source file (a preset, a fresh model) is greedy: the same reply every time,
as `erniekit chat` gives by default.
"""

from __future__ import annotations

import os
from typing import Any

from erniekit.errors import CheckpointError
from erniekit.infer.stops import turn_end_ids
from erniekit.utils.io import read_json_object

GENERATION_CONFIG_NAME = "generation_config.json"
_SOURCE_ATTR = "_erniekit_generation_config"  # the source checkpoint's file, kept on the loaded model


def read_generation_config(path: str) -> dict | None:
    """`path`/generation_config.json as a dict, None when the directory has none."""
    file = os.path.join(path, GENERATION_CONFIG_NAME)
    if not os.path.isfile(file):
        return None
    return read_json_object(file, f"fix or delete {GENERATION_CONFIG_NAME}")


def remember_source(model: Any, path: str) -> None:
    """Keep the generation config of the checkpoint `model` was loaded from, for its next save
    (checked now: a malformed eos_token_id is reported at load, not at the first checkpoint)."""
    source = read_generation_config(path)
    if source is not None:
        _ids(source.get("eos_token_id"), os.path.join(path, GENERATION_CONFIG_NAME))
    object.__setattr__(model, _SOURCE_ATTR, source)


def _ids(value: Any, where: str) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{where}: eos_token_id={value!r} must be a token id or a list of them; fix the file")
    return list(values)


def generation_config(model: Any, tokenizer: Any = None) -> dict:
    """The generation config to save with `model`: its source's fields (greedy when it had none),
    eos_token_id = the source's / config's eos ids + the tokenizer's turn-end ids, bos / pad ids."""
    c = model.config
    source = model.__dict__.get(_SOURCE_ATTR)
    out: dict = dict(source) if source else {"do_sample": False}
    eos = _ids(out.get("eos_token_id"), f"source {GENERATION_CONFIG_NAME}") + list(c.eos_token_ids)
    if tokenizer is not None:
        eos += turn_end_ids(tokenizer)
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    tok = tokenizer if tokenizer is not None else c
    for key in ("bos_token_id", "pad_token_id"):
        if out.get(key) is None:
            value = getattr(tok, key, None)
            out[key] = getattr(c, key, None) if value is None else value
    return out
