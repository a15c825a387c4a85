"""Pieces the registries share (stages, SFT data formats, export formats): finding a package's
built-in modules, and a config `choices` table that is read from a registry each time."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping


def import_modules(package: str, path: Iterable[str], first: tuple[str, ...] = ()) -> None:
    """Import every module of `package` (its `__path__`): `first` in that order, then the rest by name."""
    rest = sorted(m.name for m in pkgutil.iter_modules(path) if m.name not in first)
    for name in (*first, *rest):
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
