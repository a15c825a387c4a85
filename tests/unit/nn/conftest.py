"""Shared by the CPU kernel tests (norm, swiglu, masked_softmax): the compiled kernels of the
module under test, skipped where this machine builds none, and a float array's bits."""

import numpy as np
import pytest

from erniekit.nn import native


@pytest.fixture
def kernel(request):
    """The kernels of the test file's KERNEL_MODULE, or a skip saying why there are none."""
    k = request.module.KERNEL_MODULE._kernels()
    if k is None:
        pytest.skip(f"no C kernel here: {native.why_not}")
    return k


@pytest.fixture
def bits():
    """float32 values as their bits, so a comparison sees -0.0, NaN payloads and the last ulp."""
    return lambda a: np.asarray(a.numpy() if hasattr(a, "numpy") else a).view(np.uint32)
