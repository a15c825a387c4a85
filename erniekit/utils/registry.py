"""Pieces the registries share (stages, SFT data formats, export formats, model families): finding
a package's built-in modules once, and a config `choices` table read from a registry each time."""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping

_imported: set[str] = set()  # packages whose built-in modules import_modules has imported


def import_modules(package: str, path: Iterable[str], first: tuple[str, ...] = (), submodule: str = "") -> None:
    """Import every module of `package` (its `__path__`) the first time this is asked: `first` in
    that order, then the rest by name. `submodule`: import `<package>.<subpackage>.<submodule>` of
    each subpackage that has one instead (a model family's `family.py`)."""
    if package in _imported:
        return
    _imported.add(package)  # before importing: a module that asks the registry does not recurse
    found = list(pkgutil.iter_modules(path))
    if submodule:
        names = sorted(
            f"{m.name}.{submodule}"
            for m in found
            if m.ispkg and any(os.path.isfile(os.path.join(p, m.name, f"{submodule}.py")) for p in path)
        )
    else:
        names = sorted(m.name for m in found if m.name not in first)
    for name in (*first, *names):
        importlib.import_module(f"{package}.{name}")


class LiveChoices(Mapping):
    """lower-case spelling -> canonical name, asked of `table()` on every read: a config key's
    `choices` that include whatever was registered after the schema was built."""

    def __init__(self, table: Callable[[], dict[str, str]]):
        self._table = table

    def __getitem__(self, key: str) -> str:
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())
