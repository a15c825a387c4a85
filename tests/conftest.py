"""Tests run two pytest-xdist workers on two cores: one Paddle thread each avoids oversubscription."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from erniekit.utils.malloc import keep_freed_memory  # noqa: E402  (as `erniekit` does: freed tensors are reused)
from erniekit.utils.mkl import use_mkl_vector_kernels  # noqa: E402  (as `erniekit` does: MKL's AVX kernels on AMD)

use_mkl_vector_kernels()
keep_freed_memory()


def pytest_collection_modifyitems(config, items):
    """The embedded-default test takes most of the suite's time: start it first (see pytest.ini)."""
    items.sort(key=lambda item: "test_embedded_default" not in item.nodeid)
