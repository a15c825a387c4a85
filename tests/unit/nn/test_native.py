"""The C kernels' build and load (erniekit/nn/native.py): cached per source and CPU, off by
ERNIEKIT_NATIVE_KERNELS=0, and without a working compiler the numpy path runs (same values)."""

import numpy as np
import pytest

from erniekit.nn import fp8, native


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("ERNIEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "why_not", {})
    return tmp_path


def test_builds_once_into_the_cache(fresh):
    assert native.fake_quant_runs() is not None, native.why_not
    built = list((fresh / "kernels").glob("fake_quant-*.so"))
    assert len(built) == 1 and not list((fresh / "kernels").glob("*.so.*"))
    mtime = built[0].stat().st_mtime_ns
    native._loaded.clear()
    assert native.fake_quant_runs() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt


def test_switched_off_or_without_a_compiler_numpy_gives_the_same_values(fresh, monkeypatch):
    x = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    with_kernel = fp8.fake_quant_np(x, 1, 64, "e5m2")

    monkeypatch.setenv("ERNIEKIT_NATIVE_KERNELS", "0")
    native._loaded.clear()
    assert native.fake_quant_runs() is None and native.why_not["fake_quant"] == "ERNIEKIT_NATIVE_KERNELS=0"
    np.testing.assert_array_equal(fp8.fake_quant_np(x, 1, 64, "e5m2"), with_kernel)

    monkeypatch.setenv("ERNIEKIT_NATIVE_KERNELS", "1")
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "another cpu")  # a key with no cached build
    native._loaded.clear()
    assert native.fake_quant_runs() is None and "/bin/false failed" in native.why_not["fake_quant"]
    np.testing.assert_array_equal(fp8.fake_quant_np(x, 1, 64, "e5m2"), with_kernel)


def test_the_package_ships_every_kernel_source_and_header():
    """Kernels compile at first use from the installed package, so setup.py's package data must
    hold every .c file and every header they include (kernels/lanes.h)."""
    import fnmatch
    import re
    from pathlib import Path

    kernels = Path(native.__file__).parent / "kernels"
    setup = (kernels.parents[2] / "setup.py").read_text()
    patterns = re.findall(r'"(kernels/[^"]+)"', re.search(r'"erniekit\.nn": \[([^\]]*)\]', setup)[1])
    sources = sorted(kernels.glob("*.c"))
    included = {inc for c in sources for inc in re.findall(r'#include "([^"]+)"', c.read_text())}
    assert "lanes.h" in included
    for name in [c.name for c in sources] + sorted(included):
        assert (kernels / name).exists(), name
        assert any(fnmatch.fnmatch(f"kernels/{name}", p) for p in patterns), (name, patterns)
