"""C kernels for the CPU hot paths numpy cannot fuse, compiled on first use with the system's C
compiler and loaded with ctypes.

Why C: the emulated FP8 quantisation (nn/fp8.py) is ~9 elementwise passes in numpy (0.35 ms for
the embedded default's 0.5M-element operands, ~40 operands a step); one C pass does it in a
fraction of that. The kernels compute the numpy path's arithmetic operation for operation (tests
check the bits), so a machine without a compiler gets the same numbers from numpy, only slower.
`ERNIEKIT_NATIVE_KERNELS=0` turns them off.

Builds are cached under $ERNIEKIT_CACHE (default ~/.cache/erniekit)/kernels, keyed by the source,
the flags and the CPU's feature flags (the build targets the CPU it runs on, so a home directory
shared by different CPUs gets one build each); written to a temporary name and renamed, so
concurrent ranks never load half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

_KERNELS = Path(__file__).resolve().parent / "kernels"
# -fno-trapping-math and -fno-math-errno change no value (only whether FP exceptions may trap and
# errno is set); without them GCC keeps floorf and sqrtf scalar (masked_softmax.c's exponential:
# 65 -> ~15 ms a forward)
_FLAGS = ["-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
_FLAGS += ["-fPIC", "-shared"]
_loaded: dict[str, ctypes.CDLL | None] = {}
_OPENMP = {"small_gemm"}  # kernels that run their own threads (on Paddle's OpenMP team)
why_not: dict[str, str] = {}  # kernel -> why it is not in use (for `erniekit env` and tests)


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("ERNIEKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "erniekit"
    )
    return Path(base) / "kernels"


def openmp_runtime() -> Path | None:
    """Paddle's libiomp5: the OpenMP runtime its MKL runs on (None without it, e.g. other wheels).
    Kernels that thread link to it, so they run on the very team MKL uses instead of a second pool of
    spinning threads on the same cores."""
    import paddle

    path = Path(paddle.__file__).resolve().parent / "libs" / "libiomp5.so"
    return path if path.is_file() else None


def _link_args(name: str) -> tuple[list[str], list[str]]:
    """(compile flags, link arguments) beyond _FLAGS: OpenMP kernels compile with -fopenmp and link
    to libiomp5 (its GOMP entry points) in place of GCC's libgomp."""
    if name not in _OPENMP:
        return [], []
    runtime = openmp_runtime()
    if runtime is None:
        raise OSError("Paddle's OpenMP runtime (paddle/libs/libiomp5.so) is missing")
    return ["-fopenmp"], [str(runtime), f"-Wl,-rpath,{runtime.parent}"]


def _build(name: str, src: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc / gcc) on PATH")
    extra, link = _link_args(name)
    link = [*link, "-lm"]  # libm: a kernel may call it (small_gemm's fmaf without FMA instructions)
    code = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # lanes.h
    flags = " ".join(_FLAGS + extra + link).encode()
    key = hashlib.sha256(code + flags + _cpu_flags().encode() + platform.machine().encode())
    out = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        # compiled, then linked: with -fopenmp at the link GCC would add its own libgomp
        steps = [[cc, *_FLAGS, *extra, "-c", str(src), "-o", obj], [cc, *_FLAGS, obj, *link, "-o", tmp]]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise OSError(f"{cc} failed: {r.stderr.strip()[-300:]}")
        os.replace(tmp, out)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return out


def kernels_enabled() -> bool:
    """False with ERNIEKIT_NATIVE_KERNELS=0: every native path (compiled or MKL) is off."""
    return os.environ.get("ERNIEKIT_NATIVE_KERNELS", "1") != "0"


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library of kernels/<name>.c, or None (reason in `why_not[name]`)."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    if not kernels_enabled():
        why_not[name] = "ERNIEKIT_NATIVE_KERNELS=0"
    else:
        try:
            lib = ctypes.CDLL(str(_build(name, _KERNELS / f"{name}.c")))
        except (OSError, subprocess.SubprocessError) as e:
            why_not[name] = str(e)
    _loaded[name] = lib
    return lib


def function(name: str, symbol: str, argtypes: list):
    """`symbol` of kernels/<name>.c with its argument types set (once), or None without the build."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, None
    return fn


def functions(name: str, *symbols: tuple[str, list]) -> tuple | None:
    """`function` for each (symbol, argument types) of kernels/<name>.c, or None without the build."""
    if load(name) is None:
        return None
    return tuple(function(name, symbol, argtypes) for symbol, argtypes in symbols)


_P, _I64, _U32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_float


def fake_quant_runs():
    """erniekit_fake_quant_runs from kernels/fake_quant.c, or None."""
    return function("fake_quant", "erniekit_fake_quant_runs", [_P, _P, _I64, _P, _I64, _I64, _F32, _U32, _U32, _P, _P])


def adamw():
    """erniekit_adamw from kernels/adamw.c, or None."""
    args = [_P, _P, _P, _P, _F32, _F32, _F32, _F32, _I64, _F32, _F32, _F32, _F32, _I64, _I64]
    return function("adamw", "erniekit_adamw", args)


LANES = 16  # the kernels' sum lanes (kernels/lanes.h): element j of a row is added into lane j % 16
_NP32 = np.float32


def _f32(hex_literal: str) -> np.float32:
    return _NP32(float.fromhex(hex_literal))  # exact: each is a float32 value


# Cephes' expf constants as kernels/lanes.h writes them
_LOG2E, _LN2_HI, _LN2_LO = _f32("0x1.715476p+0"), _f32("0x1.63p-1"), _f32("-0x1.bd0106p-13")
_POLY = [
    _f32(h) for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7", "0x1.555382p-5", "0x1.555554p-3", "0x1p-1")
]
_LOW = _NP32(-87.0)


def exp_neg(x: np.ndarray) -> np.ndarray:
    """exp(x) for float32 x <= 0 as kernels/lanes.h's exp_neg computes it (0 below -87)."""
    c = np.maximum(x, _LOW)
    n = np.floor(c * _LOG2E + _NP32(0.5))
    r = c - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.full_like(r, _POLY[0])
    for coef in _POLY[1:]:
        p = p * r + coef
    p = p * (r * r) + r
    p = p + _NP32(1.0)
    two_n = ((n.astype(np.int32) + 127).astype(np.uint32) << 23).view(np.float32)
    return np.where(x < _LOW, _NP32(0.0), p * two_n)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c for float32 values (others are cast to float32 first), rounded once, as a fused
    multiply-add computes it (numpy has no fma). Why not float32(float64(a) * b + c): the product
    is exact in float64 but the sum rounds twice, which is wrong in rare ties. The sum is rounded
    to odd in float64 instead (TwoSum finds whether it was exact; an inexact result with an even
    last bit moves one ulp toward the exact value), and float64 keeps 2 + 2 * 24 bits, enough for
    that single later rounding to float32 to be the correct one (Boldo and Melquiond, "Emulation
    of FMA and correctly rounded sums", 2008)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore"):  # inf and nan inputs give fmaf's inf and nan, without warnings
        p = a * b  # exact: 24 + 24 bits
        s = p + c
        back = s - p
        err = (p - (s - back)) + (c - back)  # s + err == p + c exactly
        raw = s.view(np.int64)
        move = (err != 0) & ((raw & 1) == 0) & np.isfinite(s)
        away = (err > 0) == (s > 0)  # the exact sum lies farther from zero than s
        odd = np.where(move, raw + np.where(away, 1, -1), raw).view(np.float64)
    return odd.astype(np.float32)


def sum16(x: np.ndarray) -> np.ndarray:
    """Row sums over the last axis in the kernels' order: lane j % 16 in order, then the lanes in
    order (what their numpy twins use to give the same bits)."""
    pad = (-x.shape[-1]) % LANES
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1)  # + 0.0 changes no lane
    blocks = x.reshape(x.shape[:-1] + (-1, LANES))
    # the kernels' lanes start at +0.0: a row of -0.0 sums to +0.0 there, and must here too
    zero = np.zeros(blocks.shape[:-2] + (1, LANES), x.dtype)
    lanes = np.cumsum(np.concatenate([zero, blocks], axis=-2), axis=-2)[..., -1, :]
    return np.cumsum(lanes, axis=-1)[..., -1]


def eager_only(fn):
    """Keep a kernel dispatch out of to_static conversion: full-graph (AST) programs call it
    unconverted, in static mode, so it takes Paddle's ops; SOT (to_static's default) leaves it
    untranslated too (tracing into it fails: `usable` reads tensor places). `marker.unified` covers
    both modes; Paddle versions without it get the AST-only `not_to_static`."""
    import paddle

    unified = getattr(getattr(paddle.jit, "marker", None), "unified", None)
    if unified is None:
        return paddle.jit.not_to_static(fn)
    return unified(fn, for_sot=True, for_ast=True)


def is_float32(t) -> bool:
    """t.dtype is float32: by identity first (~0.3 us), where == costs ~1 us a tensor."""
    import paddle

    dtype = t.dtype
    return dtype is paddle.float32 or dtype == paddle.float32


def dense_cpu_float32(*tensors) -> bool:
    """Whether a kernel can take these tensors: dynamic mode, dense (not distributed) float32 on the
    CPU; anything else (GPU, static graphs, half precision, DistTensors) keeps Paddle's ops.
    Runs before every kernel call (decode steps make ~30 a token), so it reads as little as it can:
    a CPU build's tensors all live on the CPU."""
    import paddle

    if not paddle.in_dynamic_mode():
        return False
    cpu = cpu_build()
    for t in tensors:
        if not isinstance(t, paddle.Tensor) or not is_float32(t) or t.is_dist():
            return False
        if not cpu and not t.place.is_cpu_place():
            return False
    return True


@functools.cache
def cpu_build() -> bool:
    """Paddle built for the CPU alone (no CUDA, no XPU): every tensor then lives on the CPU."""
    import paddle

    return not paddle.is_compiled_with_cuda() and not paddle.is_compiled_with_xpu()


def versions(*tensors) -> tuple[int, ...] | None:
    """The in-place versions of tensors a kernel's PyLayer saves (its own inputs, not copies); None
    (not checked) inside a recomputed part (erniekit/nn/recompute.py): the backward gets the
    tensors of its second run, run just before, which Paddle's recompute hands back as new tensors
    of version 0 (a tp slice of an expert weight, updated in place by the optimizer, read as
    modified after the forward)."""
    from erniekit.nn.recompute import in_checkpoint

    return None if in_checkpoint() else _versions_now(tensors)


def _versions_now(tensors) -> tuple[int, ...]:
    return tuple(t._inplace_version() for t in tensors)


def check_versions(op: str, saved: tuple[int, ...] | None, *tensors) -> None:
    """Refuse a backward whose saved inputs were modified in place after the forward (Paddle's
    autograd refuses that too): the gradient would be computed from the new values."""
    if saved is not None and (now := _versions_now(tensors)) != saved:
        raise RuntimeError(
            f"{op}: an input was modified in place after the forward (versions {saved} -> {now}), so its "
            "gradient would be wrong; modify a copy (x.clone()) instead"
        )


_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """As many threads as Paddle's kernels use (OMP_NUM_THREADS), so the two never oversubscribe."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def in_parallel(jobs: list) -> None:
    """Run (fn, *args) jobs on a shared pool (the first in this thread); each writes its own slice.
    numpy's kernels and ctypes calls release the GIL, so the jobs run on separate cores."""
    global _pool
    if len(jobs) == 1:
        jobs[0][0](*jobs[0][1:])
        return
    if _pool is None or _pool._max_workers < len(jobs) - 1:
        _pool = ThreadPoolExecutor(len(jobs) - 1, thread_name_prefix="erniekit-native")
    futures = [_pool.submit(*job) for job in jobs[1:]]
    jobs[0][0](*jobs[0][1:])
    for f in futures:
        f.result()


PARALLEL_BYTES = 1 << 20  # an activation under this is one chunk: the hand-off costs more than a core gains


def over_chunks(fn, n: int, nbytes: int, *args, min_bytes: int | None = None) -> None:
    """fn(*args, start, end) over [0, n) cut into one chunk per thread (`cuts`; `min_bytes`
    defaults to PARALLEL_BYTES): the kernels take their range last, so each writes only its own rows."""
    limit = PARALLEL_BYTES if min_bytes is None else min_bytes
    if nbytes < limit:  # one chunk (a decode step's rows): called straight, ~10 us less than the pool's path
        fn(*args, 0, n)
        return
    c = cuts(n, nbytes, limit)
    in_parallel([(fn, *args, a, b) for a, b in zip(c[:-1], c[1:])])


def address(t) -> int | None:
    """A tensor's buffer address for a kernel, None for an output it need not write."""
    return None if t is None else t.data_ptr()


def cuts(n: int, nbytes: int, min_bytes: int) -> list[int]:
    """Boundaries cutting n independent units into one chunk per thread; one chunk when the data
    is under `min_bytes` (smaller chunks lose more to hand-offs than they gain in cache)."""
    k = min(threads(), n) if nbytes >= min_bytes else 1
    return [n * i // k for i in range(k + 1)] if k > 1 else [0, n]
