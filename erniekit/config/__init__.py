"""Training config: schema, YAML + `key=value` loading, validation and dumping.

The loader needs PyYAML, so it is imported on first use: `erniekit help` lists keys without it.
"""

from __future__ import annotations

from typing import Any

from erniekit.config.schema import TrainConfig

__all__ = ["TrainConfig", "load_config", "validate", "dump_config"]

_LAZY = {
    "load_config": "erniekit.config.loader",
    "dump_config": "erniekit.config.loader",
    "validate": "erniekit.config.checks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'erniekit.config' has no attribute {name!r}")
