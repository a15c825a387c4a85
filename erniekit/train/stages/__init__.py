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


def stage_spellings() -> dict[str, str]:
    """lower-case spelling (name or alias) -> canonical stage name, every registered stage."""
    _load_builtins()
    return dict(_spellings)


STAGE_SPELLINGS = LiveChoices(stage_spellings)  # the `choices` of config key `stage`
