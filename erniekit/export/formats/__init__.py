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


@dataclass(frozen=True)
class ExportOptions:
    max_shard_size: str = "5GB"
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
