"""The decode and attention kernels keep their register blocks in registers on both x86 vector
widths: built for AVX2 (x86-64-v3: 16 ymm registers) and for AVX-512 (x86-64-v4: 32 zmm), no
function's stack frame grows past a few spilled values. A block sized for AVX-512 and built for
AVX2 spilled to the stack (24,320 bytes in the packed kernel's loop) and decoded 3x slower
(docs/performance.md, the fifteenth round); GCC's -fstack-usage shows it without running anything."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from erniekit.nn import native

KERNELS = Path(native.__file__).resolve().parent / "kernels"
# bytes, by target: with gcc 12 the largest frames are 1,224 (attention's backward, v3) and 1,936
# (the packed loop, v4); the spilled v3 builds had 2,728 (nk), 3,624 (attention) and 24,320 (packed)
MAX_FRAME = {"x86-64-v3": 2048, "x86-64-v4": 4096}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths only")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64-v4"])
@pytest.mark.parametrize("kernel", ["small_gemm", "attention"])
def test_no_kernel_function_spills_its_register_block(tmp_path, arch, kernel):
    flags = [f for f in native._FLAGS if f not in ("-march=native", "-shared")]
    obj = tmp_path / f"{kernel}.o"
    cmd = [
        "gcc",
        *flags,
        f"-march={arch}",
        "-fopenmp",
        "-fstack-usage",
        "-c",
        str(KERNELS / f"{kernel}.c"),
        "-o",
        str(obj),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "bad value" in r.stderr:
        pytest.skip(f"this gcc does not know -march={arch}")
    assert r.returncode == 0, r.stderr[-2000:]
    frames = {}
    for line in (tmp_path / f"{kernel}.su").read_text().splitlines():
        where, size, _ = line.split("\t")
        frames[where.rsplit(":", 1)[-1]] = int(size)
    assert frames and max(frames.values()) <= MAX_FRAME[arch], frames
