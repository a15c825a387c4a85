"""`erniekit export` after argument parsing: check the request before paddle loads, export,
and say what was written (or what --verify found)."""

from __future__ import annotations

import os

from erniekit.errors import ErniekitError
from erniekit.utils.paddle_import import import_paddle


def verify_export(out: str) -> int:
    import_paddle()
    from erniekit.export.hf import verify

    r = verify(out)
    print(
        f"verify {out} ({r['format']}) against {r['source']}: max |logit difference| "
        f"{r['max_abs_diff']:.3g} (tolerance {r['tolerance']:.3g}, logits up to {r['max_logit']:.3g}), "
        f"greedy token agrees at {100 * r['same_greedy']:.1f}% of positions"
        + _transformers_line(r)
        + f": {'OK' if r['ok'] else 'FAILED'}"
    )
    return 0 if r["ok"] else 1


def _transformers_line(r: dict) -> str:
    if "transformers_max_abs_diff" not in r:
        return ""
    if r["transformers_max_abs_diff"] is None:
        return "; transformers not checked (install transformers>=5 to check that it loads the export)"
    return f"; transformers loads it: max |logit difference| {r['transformers_max_abs_diff']:.3g} with a picture"


def export(
    src: str | None,
    output: str | None,
    fmt: str,
    force: bool,
    max_shard_size: str | None,
    dtype: str | None,
    group_size: int | None,
    elastic: list[str],
) -> int:
    """max_shard_size / group_size None: not given (the format's default); given to a format that
    would ignore it, refused."""
    from erniekit.elastic.submodels import parse_settings
    from erniekit.export.formats import MAX_SHARD_SIZE, ExportOptions, export_format
    from erniekit.export.hf import check_output

    if not src or not output:
        raise ErniekitError("export needs SRC and --output OUT (or --verify DIR)")
    if group_size is not None and fmt != "wint4":
        raise ErniekitError(f"export --format {fmt}: --group-size applies to --format wint4 only; drop it")
    if max_shard_size is not None and not export_format(fmt).shards:
        raise ErniekitError(
            f"export --format {fmt}: --max-shard-size is not supported (it does not split its weights into "
            "shards); drop it"
        )
    group_size = 64 if group_size is None else group_size
    max_shard_size = MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    if fmt == "wint4" and (group_size < 2 or group_size % 2):
        raise ErniekitError(f"export: --group-size {group_size} must be an even number >= 2")
    if not os.path.isdir(src):
        raise ErniekitError(
            f"export: source {src} is not a directory; give a checkpoint or LoRA adapter directory "
            "(output of erniekit train)"
        )
    export_format(fmt).check_options(ExportOptions(max_shard_size, dtype, group_size))  # before paddle, too
    check_output(src, output, force, fmt)  # before paddle: a mistake is reported at once
    spec = parse_settings(elastic)  # before paddle: a typo is reported at once
    import_paddle()
    from erniekit.export.hf import export_hf

    out = export_hf(src, output, max_shard_size, dtype, elastic=spec, fmt=fmt, group_size=group_size, force=force)
    what = "" if spec.is_full else f" (elastic sub-model depth={spec.depth} experts={spec.experts} top_k={spec.top_k})"
    shown = "" if fmt == "hf" else f" as {fmt}"
    print(f"exported {src} -> {out}{shown}{what}; check it with: erniekit export --verify {out}")
    return 0
