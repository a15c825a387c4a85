"""Let the MKL bundled with Paddle's CPU wheel use the vector units of AMD CPUs.

Paddle's CPU wheel ships MKL 2019, whose dispatcher gives any CPU that is not Intel's its generic
code path: on an AMD EPYC with AVX-512, a float32 GEMM ran at 29 GFLOP/s instead of 145 with the
AVX-512 kernels, and the embedded default's training step took 1.9x longer (measured,
docs/reproducibility.md). MKL 2019 reads `MKL_DEBUG_CPU_TYPE` to pick the kernels (5: AVX2,
7: AVX-512); later MKLs ignore it and dispatch AMD CPUs properly. Like OMP_NUM_THREADS it must be
in the environment before paddle is imported, and a user's own value always wins.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")  # what MKL's AVX-512 kernels assume
AVX2 = ("avx2", "fma")
_CAPS = {  # MKL_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA values that rule out AVX-512 or AVX2
    "avx2": ("AVX2",),
    "none": ("AVX", "SSE4_2", "SSE41", "SSE4_1", "SSE42"),
}


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(vendor_id, flags) of the first CPU; ("", set()) where /proc/cpuinfo does not exist."""
    vendor, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def has_avx512(flags: set[str] | None = None) -> bool:
    """Whether the CPU (`flags`, default this machine's) has the AVX-512 subsets MKL's kernels and
    erniekit's wide decode tiles assume."""
    return all(f in (read_cpuinfo()[1] if flags is None else flags) for f in AVX512)


def mkl_cpu_type(environ: Mapping[str, str], vendor: str, flags: set[str]) -> str | None:
    """The MKL_DEBUG_CPU_TYPE to set, or None to leave MKL alone.

    Only AMD CPUs need it (Intel ones get their best kernels anyway). A cap the user asked for
    with Intel's own variables (MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2) is obeyed:
    MKL 2019 stops reading them once MKL_DEBUG_CPU_TYPE is set, so the cap is applied here.
    """
    if "MKL_DEBUG_CPU_TYPE" in environ or vendor != "AuthenticAMD":
        return None
    asked = {environ.get(k, "").strip().upper() for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    if asked & set(_CAPS["none"]):
        return None
    if has_avx512(flags) and not asked & set(_CAPS["avx2"]):
        return "7"
    if all(f in flags for f in AVX2):
        return "5"
    return None


def use_mkl_vector_kernels(
    environ: MutableMapping[str, str] | None = None, cpuinfo: str = "/proc/cpuinfo"
) -> str | None:
    """Set MKL_DEBUG_CPU_TYPE in `environ` (default os.environ) where it helps; the value set, or None."""
    environ = os.environ if environ is None else environ
    value = mkl_cpu_type(environ, *read_cpuinfo(cpuinfo))
    if value is not None:
        environ["MKL_DEBUG_CPU_TYPE"] = value
    return value
