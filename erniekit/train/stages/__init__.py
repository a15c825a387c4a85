"""The stage registry: the one list of stage names.

A stage is a `Stage` subclass decorated with `@register_stage`. The built-in ones are the modules
of this package, found and imported the first time a name is needed, so a new built-in stage is
one new file here; `register_stage` also takes a class from anywhere else (a plugin, a test).
Each run gets a fresh instance (`get_stage`): no run state outlives its run. This module imports
no paddle itself; asking for names imports the stage modules.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from erniekit.train.stage import Stage

_classes: dict[str, type] = {}  # canonical name -> class, in registration order
_spellings: dict[str, str] = {}  # lower-case name or alias -> canonical name
_builtins_loaded = False


def register_stage(cls: type) -> type:
    """Class decorator: make `cls.name` (and each of `cls.aliases`) a valid `stage:` value."""
    _classes[cls.name] = cls
    for spelling in (cls.name, *cls.aliases):
        _spellings[spelling.lower()] = cls.name
    return cls


def unregister_stage(name: str) -> None:
    """Remove a stage registered at run time (a test's toy stage) with its spellings."""
    _classes.pop(name, None)
    for spelling in [k for k, v in _spellings.items() if v == name]:
        del _spellings[spelling]


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            importlib.import_module(f"{__name__}.{info.name}")


def stage_names() -> list[str]:
    """Every canonical stage name: the built-in ones (by module name), then any registered later."""
    _load_builtins()
    return list(_classes)


def stage_class(name: str) -> type:
    """The class registered under `name` (canonical, case-insensitive or an alias)."""
    _load_builtins()
    canonical = _spellings.get(name.lower())
    if canonical is None:
        raise KeyError(f"unknown stage {name!r}; choose one of {', '.join(_classes)}")
    return _classes[canonical]


def stage_classes() -> Iterator[type]:
    _load_builtins()
    yield from list(_classes.values())


def get_stage(name: str) -> Stage:
    """A fresh stage for one run."""
    return stage_class(name)()


class StageSpellings(Mapping):
    """lower-case spelling -> canonical stage name, read live from the registry: the `choices` of
    config key `stage` (a stage registered later counts too)."""

    def __getitem__(self, key: str) -> str:
        _load_builtins()
        return _spellings[key]

    def __iter__(self) -> Iterator[str]:
        _load_builtins()
        return iter(dict(_spellings))

    def __len__(self) -> int:
        _load_builtins()
        return len(_spellings)
