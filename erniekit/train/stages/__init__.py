"""The stage registry: the one list of stage names.

A stage is a `Stage` subclass decorated with `@register_stage`. The built-in ones are the modules
of this package, found and imported the first time a name is needed, so a new built-in stage is
one new file here; `register_stage` also takes a class from anywhere else (a plugin, a test).
Each run gets a fresh instance (`get_stage`): no run state outlives its run. This module imports
no paddle itself; asking for names imports the stage modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from erniekit.utils.registry import LiveChoices, import_modules

if TYPE_CHECKING:
    from erniekit.train.stage import Stage

_classes: dict[str, type] = {}  # canonical name -> class, in registration order
_spellings: dict[str, str] = {}  # lower-case name or alias -> canonical name


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
    import_modules(__name__, __path__)


def _in_order() -> list[type]:
    """The built-in stages by module name, whichever was imported first (a caller importing one
    stage module directly must not reorder every message that lists stages), then the others in
    registration order."""
    _load_builtins()
    classes = list(_classes.values())
    builtin = sorted((c for c in classes if c.__module__.startswith(__name__ + ".")), key=lambda c: c.__module__)
    return builtin + [c for c in classes if c not in builtin]


def stage_names() -> list[str]:
    """Every canonical stage name: the built-in ones (by module name), then any registered later."""
    return [c.name for c in _in_order()]


def stage_class(name: str) -> type:
    """The class registered under `name` (canonical, case-insensitive or an alias)."""
    _load_builtins()
    canonical = _spellings.get(name.lower())
    if canonical is None:
        raise KeyError(f"unknown stage {name!r}; choose one of {', '.join(stage_names())}")
    return _classes[canonical]


def stage_classes() -> Iterator[type]:
    yield from _in_order()


def get_stage(name: str) -> Stage:
    """A fresh stage for one run."""
    return stage_class(name)()


def stage_spellings() -> dict[str, str]:
    """lower-case spelling (name or alias) -> canonical stage name, every registered stage."""
    _load_builtins()
    return dict(_spellings)


STAGE_SPELLINGS = LiveChoices(stage_spellings)  # the `choices` of config key `stage`
