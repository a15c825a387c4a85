"""The C kernels' build and load (erniekit/nn/native.py): cached per source and CPU, off by
ERNIEKIT_NATIVE_KERNELS=0, and without a working compiler the numpy path runs (same values)."""

from fractions import Fraction

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


def _round_to_float32(exact: Fraction) -> np.float32:
    """The float32 nearest to an exact rational, ties to even (decided in exact arithmetic)."""
    guess = np.float32(float(exact))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    dist = [abs(Fraction(float(c)) - exact) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    return min(ties, key=lambda c: int(c.view(np.int32)) & 1)  # ties: the even last bit


def test_fma32_rounds_a_times_b_plus_c_once():
    """native.fma32 (the kn kernel's twin arithmetic) is the exactly rounded a * b + c, also where
    rounding the float64 sum to float32 would round twice: (1 - 2^-22) 2^-23 x (1.5 + 2^-22 + 2^-23)
    + 1 is 2^-68 x 3 below a float32 tie, which float64 cannot hold, so it lands on the tie."""
    a, b = np.float32((1 - 2**-22) * 2**-23), np.float32(1.5 + 2**-22 + 2**-23)
    hard = ([a, -a, 4 * a], [b, b, b], [1.0, -1.0, 4.0])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    near = (-(x * y) * (1 + rng.standard_normal(300) * 1e-6)).astype(np.float32)  # cancellation
    wide = (rng.standard_normal(300) * 2.0 ** rng.integers(-40, 40, 300)).astype(np.float32)
    for a, b, c in (hard, (x, y, near), (x, y, wide)):
        a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
        want = [
            _round_to_float32(Fraction(float(p)) * Fraction(float(q)) + Fraction(float(r))) for p, q, r in zip(a, b, c)
        ]
        np.testing.assert_array_equal(native.fma32(a, b, c).view(np.int32), np.array(want, np.float32).view(np.int32))
    twice = (hard[0][0] * np.float64(hard[1][0]) + hard[2][0]).astype(np.float32)  # what the twin must not do
    assert twice != native.fma32(np.float32(hard[0][0]), hard[1][0], np.float32(1.0))
