"""Test files are collected by basename (tests/ has no __init__.py packages): two files with one name
make pytest refuse to collect the second ("import file mismatch"), so the whole suite errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_no_two_test_files_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
