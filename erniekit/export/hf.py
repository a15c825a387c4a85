"""`erniekit export`: a self-contained Hugging Face-layout directory (what FastDeploy and
transformers read): LoRA merged into the base, config, generation config, tokenizer with its chat
template, safetensors sharded above `max_shard_size`; or any other registered format
(erniekit/export/formats/: hf, wint8 / wint4, paddle / onnx, one module each). Every export records
its source in `export_info.json`, which `--verify` reads."""

from __future__ import annotations

import contextlib
import os

from erniekit.errors import CheckpointError, ErniekitError
from erniekit.export.formats import INFO_NAME, MAX_SHARD_SIZE, ExportOptions, export_format, format_names


def _load_source(src: str, elastic=None):
    from erniekit.models.registry import load_model_or_adapter, load_tokenizer

    tokenizer = load_tokenizer(src)
    model = load_model_or_adapter(src)
    if elastic is not None and not elastic.is_full:
        from erniekit.elastic.submodels import extract_submodel

        model = extract_submodel(model, elastic)
    model.eval()
    return model, tokenizer


# what model weights are stored as, in any format: a directory holding such a file is a model
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pdiparams", ".pdparams", ".onnx", ".bin", ".pt", ".pth")


def check_output(src: str, out: str, force: bool = False, fmt: str = "hf") -> None:
    """Before any loading: `out` must not be the source nor, for an adapter, its base (symlinks
    resolved: the export would overwrite what it reads), not a file, new or empty unless `force`,
    and writable. `force` replaces an export of the same format only (check_replaceable)."""
    from erniekit.models.registry import adapter_base

    real = os.path.realpath(out)
    if real == os.path.realpath(src):
        raise CheckpointError(f"export: --output {out} is the source directory {src}; choose a new directory")
    base = adapter_base(src) if os.path.isdir(src) else None  # --base-model included
    if base is not None and real == os.path.realpath(base):
        raise CheckpointError(
            f"export: --output {out} is the base checkpoint {base} of the adapter {src}; the merged model would "
            "replace it: choose a new directory"
        )
    if os.path.lexists(out) and not os.path.isdir(out):
        raise CheckpointError(f"export: --output {out} is a file, not a directory; choose a new directory")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise CheckpointError(
                f"export: --output {out} is not empty; choose a new directory, or add --force to "
                "replace the model files in it"
            )
        check_replaceable(out, fmt)
    probe = os.path.abspath(out)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"export: cannot write {out}: {probe} is not a writable directory; choose another --output"
        )


def check_replaceable(out: str, fmt: str) -> None:
    """`--force` into a non-empty `out`: it must hold an export of the same format, or no model
    weights at all. Another format's weights would stay beside the new ones (hf's model.safetensors
    beside a gguf's model.gguf, which chat and the server then load), and a directory that is no
    export (a training checkpoint) would lose its weights: refused rather than deleted, so --force
    never removes a file the new export does not replace."""
    from erniekit.export.formats import export_format, format_names
    from erniekit.utils.io import read_json_object

    info_file = os.path.join(out, INFO_NAME)
    if os.path.isfile(info_file):
        held = read_json_object(info_file, f"remove {out} or choose another --output").get("format")
        same = held == fmt or (held in format_names() and export_format(held) is export_format(fmt))
        if not same:
            raise CheckpointError(
                f"export: --output {out} holds a {held} export; --force replaces an export of the same format "
                f"({fmt}): remove {out} or choose another --output"
            )
        return
    weights = sorted(n for n in os.listdir(out) if n.endswith(_WEIGHT_SUFFIXES))
    if weights:
        raise CheckpointError(
            f"export: --output {out} holds model weights ({', '.join(weights[:3])}) but no {INFO_NAME}: it is no "
            f"erniekit export, which is all --force replaces; remove them or choose another --output"
        )


def export_hf(
    src: str,
    out: str,
    max_shard_size: str = MAX_SHARD_SIZE,
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
    options = ExportOptions(max_shard_size, dtype, group_size)
    writer.check_options(options)  # so is an option it would ignore
    check_output(src, out, force, fmt)
    record = _control_record(src)  # a damaged one is refused before anything is written
    model, tokenizer = _load_source(src, elastic)
    info = {"source": os.path.abspath(src), "format": fmt}
    from erniekit.models.registry import adapter_base

    base = adapter_base(src)
    if base is not None:  # an adapter: --verify reloads it on the same base (--base-model included)
        info["base"] = os.path.abspath(base)
    if elastic is not None and not elastic.is_full:
        info["elastic"] = {"depth": elastic.depth, "experts": elastic.experts, "top_k": elastic.top_k}
    with _marked_unfinished(out, info):
        writer.write(model, tokenizer, out, info, options)
        from erniekit.data.control import write_control_record

        write_control_record(out, record)  # none: a --force export removes a stale one
    return out


def _control_record(src: str) -> dict | None:
    """The control attributes the source was trained on, which go with the export so chat and the
    server check them there too (docs/control.md): an adapter's own record holds its base's; an
    adapter without one keeps its base's."""
    from erniekit.data.control import read_control_record
    from erniekit.models.registry import adapter_base

    if not os.path.isdir(src):
        return None
    record, base = read_control_record(src), adapter_base(src)
    return record if record is not None or base is None else read_control_record(base)


@contextlib.contextmanager
def _marked_unfinished(out: str, info: dict):
    """export_info.json says "complete": false while the writer runs (its own info ends it), so an
    export killed after its weights are published is still this format's export, which --force
    replaces and --verify refuses. A refusal (an ErniekitError, raised before anything is written)
    puts back what was there."""
    from erniekit.utils.io import atomic_write_json

    info_file, created = os.path.join(out, INFO_NAME), not os.path.isdir(out)
    before = None if created or not os.path.isfile(info_file) else open(info_file, "rb").read()
    os.makedirs(out, exist_ok=True)
    atomic_write_json(info_file, {**info, "complete": False})
    try:
        yield
    except ErniekitError:
        if before is not None:
            with open(info_file, "wb") as f:
                f.write(before)
        else:
            os.remove(info_file)
            if created and not os.listdir(out):
                os.rmdir(out)
        raise


def verify(out: str, atol: float | None = None) -> dict:
    """Reload an exported directory and compare its logits with its source's on fixed prompts:
    {max_abs_diff, max_logit, same_greedy (argmax agreement), tolerance, ok}."""
    from erniekit.elastic.submodels import ElasticSpec

    info_file = os.path.join(out, INFO_NAME)
    if not os.path.isfile(info_file):
        raise CheckpointError(f"{out}: no {INFO_NAME}; --verify checks a directory written by erniekit export")
    from erniekit.utils.io import read_json_object

    info = read_json_object(info_file, "re-run erniekit export to rewrite it")
    if info.get("complete") is False:
        raise CheckpointError(
            f"{out}: this export did not finish (its {INFO_NAME} says so); run the same erniekit export again with --force"
        )
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
