"""MKL's vector kernels on AMD CPUs (erniekit/utils/mkl.py): when the variable is set, what it does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from erniekit.utils.mkl import AVX2, AVX512, mkl_cpu_type, read_cpuinfo, use_mkl_vector_kernels

ROOT = str(Path(__file__).resolve().parents[3])
ZEN4 = set(AVX512) | set(AVX2) | {"sse4_2"}
ZEN2 = set(AVX2) | {"sse4_2"}


@pytest.mark.parametrize(
    "vendor, flags, env, want",
    [
        ("AuthenticAMD", ZEN4, {}, "7"),
        ("AuthenticAMD", ZEN2, {}, "5"),
        ("AuthenticAMD", {"sse4_2", "avx"}, {}, None),  # no AVX2: MKL's generic path is right
        ("GenuineIntel", ZEN4, {}, None),  # Intel: MKL dispatches it already
        ("AuthenticAMD", ZEN4, {"MKL_DEBUG_CPU_TYPE": "4"}, None),  # the user's own choice wins
        ("AuthenticAMD", ZEN4, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "5"),  # Intel's cap is obeyed
        ("AuthenticAMD", ZEN4, {"ONEDNN_MAX_CPU_ISA": "avx2"}, "5"),
        ("AuthenticAMD", ZEN4, {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, None),
        ("AuthenticAMD", {"avx512f", "avx2", "fma"}, {}, "5"),  # partial AVX-512: not MKL's kernels
        ("", set(), {}, None),  # no /proc/cpuinfo
    ],
)
def test_which_kernels_are_asked_for(vendor, flags, env, want):
    assert mkl_cpu_type(env, vendor, flags) == want


def test_cpuinfo_is_read_and_only_a_helping_value_is_set(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_2 avx2 fma\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n"
    )
    assert read_cpuinfo(str(info)) == ("AuthenticAMD", {"fpu", "sse4_2", "avx2", "fma"})
    assert read_cpuinfo(str(tmp_path / "missing")) == ("", set())
    env = {}
    assert use_mkl_vector_kernels(env, str(info)) == "5" and env == {"MKL_DEBUG_CPU_TYPE": "5"}
    env = {"MKL_DEBUG_CPU_TYPE": "1"}
    assert use_mkl_vector_kernels(env, str(info)) is None and env == {"MKL_DEBUG_CPU_TYPE": "1"}


_GEMM = (
    "import hashlib, numpy as np, paddle\n"
    "rng = np.random.default_rng(0)\n"
    "a, b = rng.standard_normal((257, 384), dtype=np.float32), rng.standard_normal((384, 129), dtype=np.float32)\n"
    "c = paddle.matmul(paddle.to_tensor(a), paddle.to_tensor(b)).numpy()\n"
    "ref = a.astype(np.float64) @ b.astype(np.float64)\n"
    "print(float(np.abs(c - ref).max() / np.abs(ref).max()), hashlib.md5(c.tobytes()).hexdigest())\n"
)


def _gemm(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_DEBUG_CPU_TYPE", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(env_extra, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _GEMM], env=env, capture_output=True, text=True, check=True)
    err, digest = out.stdout.split()
    return float(err), digest


@pytest.mark.skipif(mkl_cpu_type({}, *read_cpuinfo()) is None, reason="this CPU needs no MKL_DEBUG_CPU_TYPE")
def test_on_this_cpu_the_chosen_kernels_run_and_compute_the_same_product():
    """The setting changes which kernels run (other rounding: different bits) and they are right
    (float32 rounding against a float64 product). If MKL ignored the variable the bits would be
    equal: then this Paddle's MKL dispatches AMD CPUs itself and utils/mkl.py is no longer needed."""
    chosen = mkl_cpu_type({}, *read_cpuinfo())
    err_generic, generic = _gemm({"MKL_DEBUG_CPU_TYPE": "1"})
    err_chosen, fast = _gemm({"MKL_DEBUG_CPU_TYPE": chosen})
    assert err_generic < 1e-5 and err_chosen < 1e-5, (err_generic, err_chosen)
    assert fast != generic, "MKL ignored MKL_DEBUG_CPU_TYPE"


def test_the_cli_sets_it_before_paddle_loads_and_leaves_a_users_value():
    code = (
        "import os, erniekit.cli as c; c._import_paddle(); import paddle; "
        "print(os.environ.get('MKL_DEBUG_CPU_TYPE', '-'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert got == (mkl_cpu_type({}, *read_cpuinfo()) or "-")
    env["MKL_DEBUG_CPU_TYPE"] = "4"
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert got == "4"
