"""Tests run two pytest-xdist workers on two cores: one Paddle thread each avoids oversubscription.

Layout: tests/unit/<package>/ mirror erniekit's packages; tests/e2e/ run the CLI, several
processes, a live server or a browser and carry the `e2e` marker (`-m "not e2e"`: the fast set)."""

import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # launched_jobs.py, shared by e2e and unit tests

from erniekit.utils.malloc import keep_freed_memory  # noqa: E402  (as `erniekit` does: freed tensors are reused)
from erniekit.utils.mkl import use_mkl_vector_kernels  # noqa: E402  (as `erniekit` does: MKL's AVX kernels on AMD)
from erniekit.utils.paddle_import import contiguous_cpu_kernels  # noqa: E402  (as `erniekit` does)

use_mkl_vector_kernels()
keep_freed_memory()
contiguous_cpu_kernels()

E2E_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e")


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ is marked e2e. The embedded defaults' tests take most of the
    suite's time: start them first (pyproject.toml: --dist worksteal), the text one, then the VL one."""
    for item in items:
        if str(item.fspath).startswith(E2E_DIR + os.sep):
            item.add_marker(pytest.mark.e2e)
    first = ("test_embedded_default", "test_vl_default")
    items.sort(key=lambda item: next((i for i, name in enumerate(first) if name in item.nodeid), len(first)))
