"""`erniekit export`: a self-contained Hugging Face-layout directory (what FastDeploy and
transformers read): LoRA merged into the base, config, generation config, tokenizer with its chat
template, safetensors sharded above `max_shard_size`."""

from __future__ import annotations

import os

from erniekit.errors import CheckpointError


def export_hf(src: str, out: str, max_shard_size: str = "5GB", dtype: str | None = None, elastic=None) -> str:
    """`elastic` (an erniekit.nn.elastic.ElasticSpec) writes that sub-model as an ordinary smaller checkpoint."""
    from erniekit.models.ernie4_5.checkpoint import load_model_or_adapter, save_pretrained
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

    if os.path.abspath(src) == os.path.abspath(out):
        raise CheckpointError(f"export: --output {out} is the source directory; choose a new directory")
    tokenizer = ErnieTokenizer.from_pretrained(src)
    model = load_model_or_adapter(src)
    if elastic is not None and not elastic.is_full:
        from erniekit.nn.elastic import extract_submodel

        model = extract_submodel(model, elastic)
    save_pretrained(model, out, tokenizer=tokenizer, max_shard_size=max_shard_size, dtype=dtype)
    return out
