"""The export-format registry: the one list of `erniekit export --format` names.

A format is an `ExportFormat` registered with `register_export_format`: how to write a directory
from a loaded model, and how `--verify` checks it against its source. The built-in ones are the
modules of this package (found the first time a name is needed), so a new built-in format is one
new file here; a format registered from anywhere else (a plugin, a test) works the same way.
Format modules import paddle inside their functions: the CLI lists the names before paddle loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from erniekit.utils.registry import import_modules

MAX_SHARD_SIZE = "5GB"  # the default of --max-shard-size: what a format that writes no shards is given
# --verify's tolerance relative to the largest logit, by the dtype the weights were written in: float32
# differs from the source by summation order only, 16 bits by every weight's rounding (float16 keeps 3
# more mantissa bits than bfloat16); gguf, paddle-layout and hf read it
RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class ExportOptions:
    max_shard_size: str = MAX_SHARD_SIZE
    dtype: str | None = None
    group_size: int = 64


@dataclass(frozen=True)
class ExportFormat:
    name: str
    help: str
    # write(model, tokenizer, out, info, options): a complete directory at `out` (old or new files,
    # never half of one); `info` (source, format, elastic) goes into export_info.json and the writer
    # may add to it
    write: Callable
    # verify(out, info, reference model, tokenizer, atol) -> {max_abs_diff, max_logit, same_greedy,
    # tolerance, ok}
    verify: Callable
    aliases: tuple[str, ...] = field(default=())
    # which ExportOptions it honours: the --dtype values it writes (none: it writes the weights as
    # loaded, float32) and whether it splits its weights by --max-shard-size. An option a format does
    # not declare is refused (check_options): ignoring it would change nothing, silently.
    dtypes: tuple[str, ...] = ()
    shards: bool = False

    def check_options(self, options: ExportOptions) -> None:
        """Refuse, before anything loads, an option this format would ignore or a size that is no size."""
        from erniekit.errors import CheckpointError
        from erniekit.models.hf_files import shard_size_bytes

        if options.dtype is not None and options.dtype not in self.dtypes:
            if self.dtypes:
                raise CheckpointError(
                    f"export --format {self.name}: --dtype {options.dtype} is not one it writes; "
                    f"use {', '.join(self.dtypes)}, or drop --dtype"
                )
            takers = [n for n in format_names() if _formats[n].dtypes]
            raise CheckpointError(
                f"export --format {self.name}: --dtype {options.dtype} is not supported (its float weights stay "
                f"float32, as loaded); drop --dtype, or use --format {'|'.join(takers)}"
            )
        if self.shards:
            shard_size_bytes(options.max_shard_size, "export: --max-shard-size")
        elif options.max_shard_size != MAX_SHARD_SIZE:
            raise CheckpointError(
                f"export --format {self.name}: --max-shard-size {options.max_shard_size} is not supported "
                "(it does not split its weights into shards); drop --max-shard-size"
            )


INFO_NAME = "export_info.json"  # every export records its source and format here; --verify reads it
VERIFY_PROMPTS = ("1+2=", "What is 7 plus 5?", "Hello, ERNIE.")  # what --verify compares the logits on


def verify_report(
    info: dict, max_abs_diff: float, max_logit: float, same_greedy: float, atol: float | None, relative: float
) -> dict:
    """What every format's `verify` returns: the tolerance is `atol`, else `relative` times the
    largest reference logit (at least 1)."""
    tol = atol if atol is not None else relative * max(1.0, max_logit)
    return {
        "format": info["format"],
        "source": info["source"],
        "max_abs_diff": max_abs_diff,
        "max_logit": max_logit,
        "same_greedy": same_greedy,
        "tolerance": tol,
        "ok": max_abs_diff <= tol,
    }


def relative_tolerance(dtype: str, out: str) -> float:
    """RELATIVE_TOLERANCE of the dtype an export in `out` recorded, or one line saying it is no dtype."""
    if dtype not in RELATIVE_TOLERANCE:
        from erniekit.errors import CheckpointError

        raise CheckpointError(
            f"{out}/{INFO_NAME}: dtype {dtype!r} is not one of {', '.join(RELATIVE_TOLERANCE)}; "
            "re-run erniekit export to rewrite it"
        )
    return RELATIVE_TOLERANCE[dtype]


_formats: dict[str, ExportFormat] = {}


def register_export_format(fmt: ExportFormat) -> ExportFormat:
    _formats[fmt.name] = fmt
    return fmt


def unregister_export_format(name: str) -> None:
    _formats.pop(name, None)


def _load_builtins() -> None:
    import_modules(__name__, __path__, first=_FIRST)


# built-in modules, in the order `--format` and the WebUI list them
_FIRST = ("hf", "weight_only", "static_graph", "paddle_layout", "gguf")


def _rank(fmt: ExportFormat) -> int:
    module = fmt.write.__module__.rsplit(".", 1)[-1] if fmt.write.__module__.startswith(__name__) else ""
    return _FIRST.index(module) if module in _FIRST else len(_FIRST)


def format_names() -> list[str]:
    """Built-in formats first, in their fixed order, then the others as they were registered."""
    _load_builtins()
    order = {name: i for i, name in enumerate(_formats)}
    return sorted(_formats, key=lambda n: (_rank(_formats[n]), order[n]))


def export_format(name: str) -> ExportFormat:
    _load_builtins()
    if name not in _formats:
        from erniekit.errors import CheckpointError

        raise CheckpointError(f"unknown export format {name!r}; use one of {', '.join(format_names())}")
    return _formats[name]
