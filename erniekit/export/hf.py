"""`erniekit export`: a self-contained Hugging Face-layout directory (what FastDeploy and
transformers read): LoRA merged into the base, config, generation config, tokenizer with its chat
template, safetensors sharded above `max_shard_size`; or any other registered format
(erniekit/export/formats/: hf, wint8 / wint4, paddle / onnx, one module each). Every export records
its source in `export_info.json`, which `--verify` reads."""

from __future__ import annotations

import os

from erniekit.errors import CheckpointError
from erniekit.export.formats import INFO_NAME, ExportOptions, export_format, format_names


def _load_source(src: str, elastic=None):
    from erniekit.models.registry import load_model_or_adapter, load_tokenizer

    tokenizer = load_tokenizer(src)
    model = load_model_or_adapter(src)
    if elastic is not None and not elastic.is_full:
        from erniekit.elastic.submodels import extract_submodel

        model = extract_submodel(model, elastic)
    model.eval()
    return model, tokenizer


def check_output(src: str, out: str, force: bool = False) -> None:
    """Before any loading: `out` must not be the source, not a file, and new or empty unless `force`
    (an export over an earlier one would silently mix their files), and must be writable."""
    if os.path.abspath(src) == os.path.abspath(out):
        raise CheckpointError(f"export: --output {out} is the source directory; choose a new directory")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise CheckpointError(f"export: --output {out} is a file, not a directory; choose a new directory")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise CheckpointError(
            f"export: --output {out} is not empty; choose a new directory, or add --force to "
            "replace the model files in it"
        )
    probe = os.path.abspath(out)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"export: cannot write {out}: {probe} is not a writable directory; choose another --output"
        )


def export_hf(
    src: str,
    out: str,
    max_shard_size: str = "5GB",
    dtype: str | None = None,
    elastic=None,
    fmt: str = "hf",
    group_size: int = 64,
    force: bool = False,
) -> str:
    """`elastic` (an erniekit.elastic.submodels.ElasticSpec) writes that sub-model as an ordinary smaller checkpoint.
    `force` writes into a non-empty `out` (the weights are replaced atomically: old or new, never mixed).
    `fmt`: a registered export format (erniekit/export/formats/)."""
    writer = export_format(fmt)  # an unknown format is refused before anything loads
    check_output(src, out, force)
    model, tokenizer = _load_source(src, elastic)
    info = {"source": os.path.abspath(src), "format": fmt}
    from erniekit.models.registry import adapter_base

    base = adapter_base(src)
    if base is not None:  # an adapter: --verify reloads it on the same base (--base-model included)
        info["base"] = os.path.abspath(base)
    if elastic is not None and not elastic.is_full:
        info["elastic"] = {"depth": elastic.depth, "experts": elastic.experts, "top_k": elastic.top_k}
    writer.write(model, tokenizer, out, info, ExportOptions(max_shard_size, dtype, group_size))
    return out


def verify(out: str, atol: float | None = None) -> dict:
    """Reload an exported directory and compare its logits with its source's on fixed prompts:
    {max_abs_diff, max_logit, same_greedy (argmax agreement), tolerance, ok}."""
    from erniekit.elastic.submodels import ElasticSpec

    info_file = os.path.join(out, INFO_NAME)
    if not os.path.isfile(info_file):
        raise CheckpointError(f"{out}: no {INFO_NAME}; --verify checks a directory written by erniekit export")
    from erniekit.utils.io import read_json_object

    info = read_json_object(info_file, "re-run erniekit export to rewrite it")
    src = info.get("source")
    if not isinstance(src, str) or info.get("format") not in format_names():
        raise CheckpointError(
            f"{info_file}: needs 'source' (a directory) and 'format' (one of {', '.join(format_names())}); "
            "re-run erniekit export to rewrite it"
        )
    if not os.path.isdir(src):
        raise CheckpointError(f"{out}: its source {src} is gone; --verify needs the source to compare with")
    el = info.get("elastic")
    from erniekit.models.registry import adapter_base_overridden, adapter_base_override

    base = info.get("base")
    recorded = base if isinstance(base, str) and os.path.isdir(base) and not adapter_base_overridden() else None
    with adapter_base_override(recorded):
        ref_model, tokenizer = _load_source(src, ElasticSpec(**el) if el else None)
    return export_format(info["format"]).verify(out, info, ref_model, tokenizer, atol)
