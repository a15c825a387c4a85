"""Training config: schema, YAML + `key=value` loading, validation and dumping.

The loader needs PyYAML, so it is imported on first use: `erniekit help` lists keys without it.
Validation (config/checks.py) never imports the planner; `validate` here runs the planner on the
normalised config when `parallel: auto` asks for it, then checks the result.
"""

from __future__ import annotations

from typing import Any

from erniekit.config.schema import TrainConfig

__all__ = ["TrainConfig", "load_config", "validate", "dump_config"]

_LAZY = {
    "load_config": "erniekit.config.loader",
    "dump_config": "erniekit.config.loader",
}


def validate(cfg: TrainConfig) -> TrainConfig:
    """A normalised, checked copy of cfg; with `parallel: auto`, the planner's layout, batch split
    and recompute replace the ones set (erniekit/distributed/planner.py). ConfigError on the first
    bad key."""
    from erniekit.config.checks import check, normalise

    cfg = normalise(cfg)
    if cfg.parallel == "auto":
        from erniekit.distributed.planner import auto_plan, with_plan

        cfg = with_plan(cfg, auto_plan(cfg).plan)
    check(cfg)
    return cfg


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'erniekit.config' has no attribute {name!r}")
