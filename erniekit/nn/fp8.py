"""Block-scaled FP8 (e4m3) matmul for the MoE expert GEMMs: the DeepSeek-V3 / ERNIE 4.5 recipe.

Every GEMM (the forward and both backward ones) multiplies two FP8 operands whose scales are
fine-grained along the GEMM's reduction dimension, and accumulates in float32:

    forward  Y  = X   @ W      reduction K: X tiled 1 x b along K,   W tiled b x b
    backward dX = dY  @ W^T    reduction N: dY tiled 1 x b along N,  W^T tiled b x b (same tiles as W)
    backward dW = X^T @ dY     reduction M: X^T tiled 1 x b along M, dY tiled b x 1 along M

Per tile: scale = amax(|tile|) / 448, q = round_e4m3(v / scale) (round to nearest even), and the
GEMM is Y = sum over reduction blocks of (q_a . q_b) * s_a * s_b. Gradient tiles are e4m3 by
default (DeepSeek-V3) or e5m2 (`grad_format`, Transformer Engine's hybrid recipe).

Backends (`fp8_backend()`): "gpu" calls Paddle's cuBLASLt blockwise FP8 GEMM on the quantised
operands; "emulated" (CPU, and any GPU without the kernel) rounds exactly to the format's grid
(in numpy, bit-identical to a cast to `paddle.float8_e4m3fn` and back), then runs the float32
GEMM on the dequantised operands. The two
compute the same sum of the same products and differ only in fp32 accumulation order.
No bf16/fp8 matmul exists in the CPU wheel, hence the emulation. Formulas and numbers: docs/fp8.md.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.errors import ConfigError
from erniekit.nn import grouped_gemm, native
from erniekit.nn.rows import concat_rows, split_rows
from erniekit.utils.device import cuda_visible
from erniekit.utils.dtensor import host_array

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_SPACING = 2.0**-9
_SCALE_FLOOR = 2.0**-126  # smallest normal float32: an all-zero tile gets this scale, so q = 0, not 0/0
_FP8 = paddle.float8_e4m3fn
# Formats a gradient tile may use: e4m3 (DeepSeek-V3: precision) or e5m2 (the "hybrid" recipe of
# Transformer Engine: 2^15 more dynamic range, so small per-token gradients in a tile dominated by a
# few large ones are not flushed to zero). Activations and weights are always e4m3.
GRAD_FORMATS = {"e4m3": (paddle.float8_e4m3fn, E4M3_MAX), "e5m2": (paddle.float8_e5m2, 57344.0)}
_BLOCK_HINT = "set fp8_block_size to a divisor of hidden_size and moe_intermediate_size, e.g. 64"

# Paddle ops that could run the block-scaled GEMM on a GPU, probed by name at run time.
# paddle.linalg.fp8_fp8_half_gemm_fused is NOT a candidate: it takes one per-tensor scale.
_GPU_GEMM_CANDIDATES = (("paddle.incubate.nn.functional", "fp8_gemm_blockwise"),)
_GPU_MIN_CAPABILITY = (8, 9)  # first arch with FP8 tensor cores (Ada); Hopper is 9.0
_GPU_BLOCK = 128  # the cuBLASLt kernel's only tile size


class FP8ShapeError(ConfigError, ValueError):
    """A GEMM dimension that FP8 tiles cannot cover: one line, for the CLI, also a ValueError."""


def e4m3_relative_bound() -> float:
    """Round-to-nearest relative error bound of e4m3 for normal values: 2^-(mantissa bits + 1).

    Why this bounds a whole tile: v = x / scale lies in [-448, 448]. If |v| >= 2^-6 (normal) the
    spacing near v is <= |v| * 2^-3, so |round(v) - v| <= |v| * 2^-4. If |v| < 2^-6 (subnormal)
    the spacing is 2^-9, so |round(v) - v| <= 2^-10. Multiplying back by the tile's scale
    (amax / 448), every element of the tile satisfies

        |dequant(x) - x| <= max(|x| * 2^-4, scale * 2^-10)  (+ fp32 rounding, ~|x| * 2^-23)

    which is the bound tests/unit/nn/test_fp8.py checks. The tile's amax maps to exactly +-448, so no
    element saturates; elements with |x| <= scale * 2^-10 (~ amax * 2^-18.8) flush to 0.
    """
    return 2.0 ** -(E4M3_MANTISSA_BITS + 1)


def e4m3_subnormal_half_spacing() -> float:
    """Absolute rounding bound (in units of the tile scale) for values in the subnormal range."""
    return E4M3_SUBNORMAL_SPACING / 2


# ---- tile quantisation ---------------------------------------------------------------------
def _tiled(x: paddle.Tensor, rows: int, cols: int) -> paddle.Tensor:
    """View [R, C] as tiles of rows x cols; 1-sized tile dims are dropped (cheaper reductions)."""
    R, C = x.shape
    if rows == 1:
        return x.reshape([R, C // cols, cols])
    if cols == 1:
        return x.reshape([R // rows, rows, C])
    return x.reshape([R // rows, rows, C // cols, cols])


def _tile_amax(v: paddle.Tensor, rows: int, cols: int) -> paddle.Tensor:
    """amax per tile, keepdim so it broadcasts over the tiled view (one axis at a time: faster)."""
    a = v.abs()
    if rows == 1:
        return a.max(axis=2, keepdim=True)
    if cols == 1:
        return a.max(axis=1, keepdim=True)
    return a.max(axis=3, keepdim=True).max(axis=1, keepdim=True)


def _quant(x: paddle.Tensor, rows: int, cols: int, fmt: str = "e4m3") -> tuple[paddle.Tensor, paddle.Tensor]:
    """(q e4m3 in the tiled view, scale broadcastable to it). x float32, dims divisible by tile.

    No clip before the cast: |x / scale| <= 448 * (1 + 2^-23), far below 464, the point from which
    Paddle's CPU cast stops rounding to 448 (it gives NaN on (464, 480)); see docs/fp8.md.
    """
    dtype, fmax = GRAD_FORMATS[fmt]
    v = _tiled(x, rows, cols)
    scale = (_tile_amax(v, rows, cols) / fmax).clip(min=_SCALE_FLOOR)  # NaN amax stays NaN
    return (v / scale).astype(dtype), scale


def _dequant(q: paddle.Tensor, scale: paddle.Tensor, shape: list[int]) -> paddle.Tensor:
    return (q.astype("float32") * scale).reshape(shape)


def _fake_quant_cast(x: paddle.Tensor, rows: int, cols: int, fmt: str = "e4m3") -> paddle.Tensor:
    """x rounded through e4m3 (or `fmt`) with per-tile scales by Paddle's float8 casts, back in float32."""
    q, scale = _quant(x, rows, cols, fmt)
    return _dequant(q, scale, x.shape)


# (mantissa bits, smallest normal exponent) of each format, for the float32 rounding below
_FORMAT_BITS = {"e4m3": (3, -6), "e5m2": (2, -14)}


def round_to_format_np(v: np.ndarray, fmt: str = "e4m3") -> np.ndarray:
    """v (float32, |v| <= the format's max) rounded to the nearest `fmt` value, ties to even, in float32.

    Adding then subtracting M = 1.5 * 2^(e + 23 - m), e = exponent of v, makes float32's own
    round-to-nearest-even drop all but m mantissa bits; clamping M from below at the subnormal
    spacing's magic number gives the fixed subnormal step. Same values as a cast to the float8
    dtype and back (checked bit for bit in tests), at a fraction of the cost on CPU.
    """
    m, emin = _FORMAT_BITS[fmt]
    binade = (v.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32)  # 2^e (inf for inf/NaN)
    magic = np.maximum(binade * np.float32(1.5 * 2.0 ** (23 - m)), np.float32(1.5 * 2.0 ** (emin - m + 23)))
    return (v + magic) - magic


def _tile_axes(rows: int, cols: int) -> int | tuple[int, int]:
    return 2 if rows == 1 else 1 if cols == 1 else (1, 3)


def _tiles_np(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[R, C] viewed as tiles, the tile's own axes as `_tile_axes` names them (1-sized ones dropped)."""
    R, C = a.shape
    if rows == 1:
        return a.reshape(R, C // cols, cols)
    if cols == 1:
        return a.reshape(R // rows, rows, C)
    return a.reshape(R // rows, rows, C // cols, cols)


_ABS_BITS = np.uint32(0x7FFFFFFF)
_EXPONENT_BITS = np.uint32(0x7F800000)


def _scale_of(amax_bits: np.ndarray, fmt: str) -> np.ndarray:
    """Tile scales from the tiles' max |v| as float32 bits (NaN amax stays NaN)."""
    return np.maximum(amax_bits.view(np.float32) / np.float32(GRAD_FORMATS[fmt][1]), np.float32(_SCALE_FLOOR))


def _round_scaled(v: np.ndarray, scale: np.ndarray, out: np.ndarray, bits: np.ndarray, fmt: str) -> None:
    """out = round_fmt(v / scale) * scale (scale broadcasts over v; bits: a uint32 scratch of v's shape).

    round_to_format_np's arithmetic on the float32 bit patterns where that is faster (numpy's
    integer max is vectorised where its float one is not), the same values bit for bit: the
    rounding constant M = 1.5 * 2^(e + 23 - m) of a binade 2^e, clamped below at the subnormal
    one, is the bit pattern (max(e_bits, emin_bits) + ((23 - m) << 23)) | 0x400000; a NaN element
    gets a meaningless M and stays NaN.
    """
    m, emin = _FORMAT_BITS[fmt]
    t = np.divide(v, scale, out=out)
    np.bitwise_and(t.view(np.uint32), _EXPONENT_BITS, out=bits)
    floor = np.full(bits.shape[-1], (emin + 127) << 23, np.uint32)  # a row, not a scalar: vectorised max
    np.maximum(bits, floor, out=bits)
    bits += np.uint32(((23 - m) << 23) | 0x400000)
    magic = bits.view(np.float32)
    t += magic
    t -= magic
    t *= scale


def _fake_quant_tiles(v: np.ndarray, out: np.ndarray, axes, fmt: str) -> None:
    """out = v's tiles (the tile axes of `_tiles_np`) rounded through `fmt` with their own scales.
    |v| as bits orders like |v| (NaN above inf), so the integer amax is the float one."""
    bits = np.bitwise_and(v.view(np.uint32), _ABS_BITS)
    _round_scaled(v, _scale_of(bits.max(axis=axes, keepdims=True), fmt), out, bits, fmt)


def _run_amax(bits: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per-column max of |a| bits over each row run [starts[i], starts[i+1]) ([runs, C]). Runs of
    equal length that follow each other go in one reshape-max: numpy's reduceat is 9x slower."""
    lengths = np.diff(starts)
    parts, i = [], 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        r0, n = int(starts[i]), int(lengths[i])
        parts.append(bits[r0 : r0 + (j - i) * n].reshape(j - i, n, bits.shape[1]).max(axis=1))
        i = j
    return np.concatenate(parts)


# numpy's kernels run on one core: an operand of at least this many bytes is cut into one chunk of
# whole tiles per thread (measured at tiny-moe sizes: 1 MB rowwise 0.55 -> 0.38 ms on 2 threads;
# smaller chunks lose more to hand-offs than they gain in cache)
_PARALLEL_BYTES = 1 << 18


def _native_runs(a: np.ndarray, starts: np.ndarray, cols: int, fmt: str) -> np.ndarray | None:
    """a quantised by kernels/fake_quant.c (tiles: `cols` columns of each row run), or None
    without a compiled kernel. The runs are cut over the threads; ctypes drops the GIL."""
    fn = native.fake_quant_runs()
    if fn is None:
        return None
    out = np.empty_like(a)
    C = a.shape[1]
    m, emin = _FORMAT_BITS[fmt]
    fixed = (float(GRAD_FORMATS[fmt][1]), (emin + 127) << 23, ((23 - m) << 23) | 0x400000)
    starts = np.ascontiguousarray(starts, dtype=np.int64)

    def run(k0: int, k1: int) -> None:
        amax, scale = np.empty(C, np.uint32), np.empty(C, np.float32)
        sub = starts[k0 : k1 + 1]
        fn(
            a.ctypes.data,
            out.ctypes.data,
            C,
            sub.ctypes.data,
            k1 - k0,
            cols,
            *fixed,
            amax.ctypes.data,
            scale.ctypes.data,
        )

    native.over_chunks(run, len(starts) - 1, a.nbytes, min_bytes=_PARALLEL_BYTES)
    return out


def fake_quant_np(a: np.ndarray, rows: int, cols: int, fmt: str = "e4m3") -> np.ndarray:
    """a [R, C] float32 rounded through `fmt` with per rows x cols tile scales, back in float32.

    Chunks of whole tiles run on a thread pool of OMP_NUM_THREADS (numpy releases the GIL in its
    kernels; each chunk is independent, so the result does not depend on the thread count).
    """
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size:
        got = _native_runs(a, np.arange(0, a.shape[0] + 1, rows), cols, fmt)
        if got is not None:
            return got
    v = _tiles_np(a, rows, cols)
    out = np.empty_like(v)
    axes = _tile_axes(rows, cols)
    native.over_chunks(
        lambda i, j: _fake_quant_tiles(v[i:j], out[i:j], axes, fmt), v.shape[0], v.nbytes, min_bytes=_PARALLEL_BYTES
    )
    return out.reshape(a.shape)


def fake_quant_token_runs_np(a: np.ndarray, sizes: list[int], block: int, fmt: str = "e4m3") -> np.ndarray:
    """a [M, C] float32, its rows in consecutive groups of `sizes`, rounded through `fmt` in
    block x 1 tiles that start at each group's first row (a group's last tile may be shorter).

    The same values as zero-padding every group to a multiple of block and quantising block x 1
    tiles (zeros change no tile's max), without the padded copy.
    """
    a = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty_like(a)
    if not a.shape[0]:
        return out
    firsts = np.cumsum([0] + list(sizes[:-1]))
    starts = np.concatenate([f + np.arange(0, n, block) for f, n in zip(firsts, sizes) if n] + [[a.shape[0]]])
    got = _native_runs(a, starts, 1, fmt)
    if got is not None:
        return got
    bits = np.bitwise_and(a.view(np.uint32), _ABS_BITS)
    scale = np.repeat(_scale_of(_run_amax(bits, starts), fmt), np.diff(starts), axis=0)  # each row its run's
    native.over_chunks(
        lambda i, j: _round_scaled(a[i:j], scale[i:j], out[i:j], bits[i:j], fmt),
        a.shape[0],
        a.nbytes,
        min_bytes=_PARALLEL_BYTES,
    )
    return out


def _tensor(a: np.ndarray) -> paddle.Tensor:
    """A fresh numpy result as a CPU tensor sharing its memory (the tensor keeps the array alive);
    an empty one is copied (its DLPack strides are not the contiguous ones Paddle checks for)."""
    return paddle.from_dlpack(np.ascontiguousarray(a)) if a.size else paddle.to_tensor(a)


def _fake_quant(x: paddle.Tensor, rows: int, cols: int, fmt: str = "e4m3") -> paddle.Tensor:
    """x rounded through e4m3 (or `fmt`) with per-tile scales, back in float32 (the emulated operand).

    Computed in numpy (fake_quant_np): Paddle's CPU elementwise kernels (and the float8 -> float32
    cast above all) are 5-30x slower than numpy's at expert sizes. Bit-identical to
    `_fake_quant_cast` (same division, rounding and multiplication).
    """
    return _tensor(fake_quant_np(host_array(x), rows, cols, fmt))


def _scale_2d(scale: paddle.Tensor, shape: list[int], rows: int, cols: int) -> paddle.Tensor:
    return scale.reshape([shape[0] // rows, shape[1] // cols])


def _check_2d_multiple(x: paddle.Tensor, rows: int, cols: int, what: str) -> None:
    if len(x.shape) != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {list(x.shape)}")
    for axis, t in ((0, rows), (1, cols)):
        if x.shape[axis] % t:
            raise FP8ShapeError(
                f"{what}: dim {axis} has size {x.shape[axis]}, not a multiple of the FP8 block size {t}; {_BLOCK_HINT}"
            )


def quantize_rowwise(x: paddle.Tensor, block: int = 128) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Activations [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, K/block]), 1 x block tiles.

    scale = amax / 448 per tile (floored at 2^-126 so an all-zero tile stays zero); x ~= q * scale.
    """
    x = x.astype("float32")
    _check_2d_multiple(x, 1, block, "quantize_rowwise")
    q, scale = _quant(x, 1, block)
    return q.reshape(x.shape), _scale_2d(scale, x.shape, 1, block)


def quantize_blockwise(w: paddle.Tensor, block: int = 128) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Weights [K, N] -> (q float8_e4m3fn [K, N], scale float32 [K/block, N/block]), block x block tiles.

    A block x block tiling is transpose-invariant, so the same q, scale serve W^T in the dX GEMM.
    """
    w = w.astype("float32")
    _check_2d_multiple(w, block, block, "quantize_blockwise")
    q, scale = _quant(w, block, block)
    return q.reshape(w.shape), _scale_2d(scale, w.shape, block, block)


def dequantize_rowwise(q: paddle.Tensor, scale: paddle.Tensor, block: int = 128) -> paddle.Tensor:
    """Inverse of quantize_rowwise: float32 [M, K] = q * scale broadcast over each 1 x block tile."""
    M, K = q.shape
    return _dequant(q.reshape([M, K // block, block]), scale.reshape([M, K // block, 1]), [M, K])


def dequantize_blockwise(q: paddle.Tensor, scale: paddle.Tensor, block: int = 128) -> paddle.Tensor:
    """Inverse of quantize_blockwise: float32 [K, N] = q * scale broadcast over each block x block tile."""
    K, N = q.shape
    s = scale.reshape([K // block, 1, N // block, 1])
    return _dequant(q.reshape([K // block, block, N // block, block]), s, [K, N])


# ---- backend --------------------------------------------------------------------------------
def _gpu_gemm_op():
    """Paddle's block-scaled FP8 GEMM callable, or None when this build lacks every candidate."""
    import importlib

    for module, name in _GPU_GEMM_CANDIDATES:
        op = getattr(importlib.import_module(module), name, None)
        if op is not None:
            return op
    return None


def fp8_backend() -> str:
    """'gpu' if CUDA build + visible GPU with compute capability >= 8.9 + a blockwise FP8 GEMM op, else 'emulated'."""
    if not cuda_visible():
        return "emulated"
    if tuple(paddle.device.cuda.get_device_capability()) < _GPU_MIN_CAPABILITY:
        return "emulated"
    return "gpu" if _gpu_gemm_op() is not None else "emulated"


def _gpu_nt(a, a_scale, a_1d: bool, b, b_scale, b_1d: bool) -> paddle.Tensor:
    """a [R, K] @ b [S, K]^T in float32 on the cuBLASLt kernel. Scales come in this module's layout
    (rowwise [R, K/128], blockwise [R/128, K/128]); the kernel wants 1-D scales as [K/128, R].
    Untested here (no GPU on the dev machine); kept small so review is easy.
    """
    a_scale = a_scale.transpose([1, 0]).contiguous() if a_1d else a_scale
    b_scale = b_scale.transpose([1, 0]).contiguous() if b_1d else b_scale
    return _gpu_gemm_op()(a, a_scale, b, b_scale, paddle.float32, is_a_1d_scaled=a_1d, is_b_1d_scaled=b_1d)


def _pad_rows(x: paddle.Tensor, block: int) -> paddle.Tensor:
    """Zero rows up to a multiple of block: zeros add nothing to a product reduced over rows."""
    pad = -x.shape[0] % block
    return x if pad == 0 else paddle.concat([x, paddle.zeros([pad, x.shape[1]], x.dtype)], axis=0)


# ---- the three GEMMs, per backend ---------------------------------------------------------------
def _fwd(x: paddle.Tensor, w: paddle.Tensor, block: int, backend: str) -> paddle.Tensor:
    """Y = X @ W: X 1 x block along K, W block x block."""
    if backend == "gpu":
        xq, xs = quantize_rowwise(x, block)
        wq, ws = quantize_blockwise(w.transpose([1, 0]), block)  # W^T [N, K]
        return _gpu_nt(wq, ws, False, xq, xs, True).transpose([1, 0])
    return paddle.matmul(_fake_quant(x, 1, block), _fake_quant(w, block, block))


def _grad_x(dy: paddle.Tensor, w: paddle.Tensor, block: int, backend: str, fmt: str = "e4m3") -> paddle.Tensor:
    """dX = dY @ W^T: dY 1 x block along N, W^T block x block (the forward's tiles of W)."""
    if backend == "gpu":
        dq, ds = quantize_rowwise(dy, block)
        wq, ws = quantize_blockwise(w, block)  # W [K, N]: K rows, reduction N last
        return _gpu_nt(wq, ws, False, dq, ds, True).transpose([1, 0])
    return paddle.matmul(_fake_quant(dy, 1, block, fmt), _fake_quant(w, block, block), transpose_y=True)


def _grad_w(x: paddle.Tensor, dy: paddle.Tensor, block: int, backend: str, fmt: str = "e4m3") -> paddle.Tensor:
    """dW = X^T @ dY: both tiled along M in block-long runs (M zero-padded to a multiple of block)."""
    xp, dp = _pad_rows(x, block), _pad_rows(dy, block)
    if backend == "gpu":
        xq, xs = quantize_rowwise(xp.transpose([1, 0]), block)  # X^T [K, Mp]
        dq, ds = quantize_rowwise(dp.transpose([1, 0]), block)  # dY^T [N, Mp]
        return _gpu_nt(xq, xs, True, dq, ds, True)
    return paddle.matmul(_fake_quant(xp, block, 1), _fake_quant(dp, block, 1, fmt), transpose_x=True)


class _FP8MatMul(PyLayer):
    """Y = X @ W with all three GEMMs in block-scaled FP8. Saves only the master X and W (what a
    plain matmul keeps too) and re-quantises in backward with the backward GEMMs' own tilings."""

    @staticmethod
    def forward(ctx, x, w, block: int, backend: str, grad_format: str = "e4m3"):
        ctx.block, ctx.backend, ctx.grad_format = block, backend, grad_format
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.need = (not x.stop_gradient, not w.stop_gradient)
        ctx.save_for_backward(x, w)
        y = _fwd(x.astype("float32"), w.astype("float32"), block, backend)
        return y.astype(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensor()
        dy = dy.astype("float32")
        dx = dw = None
        if ctx.need[0]:
            dx = _grad_x(dy, w.astype("float32"), ctx.block, ctx.backend, ctx.grad_format).astype(ctx.dtypes[0])
        if ctx.need[1]:
            dw = _grad_w(x.astype("float32"), dy, ctx.block, ctx.backend, ctx.grad_format).astype(ctx.dtypes[1])
        return dx, dw


def _check_gemm(x: paddle.Tensor, w: paddle.Tensor, block: int, backend: str) -> None:
    if block <= 0:
        raise FP8ShapeError(f"fp8_matmul: block size must be positive, got {block}; {_BLOCK_HINT}")
    if len(w.shape) != 2 or len(x.shape) < 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul: need x [..., K] and w [K, N], got {list(x.shape)} and {list(w.shape)}")
    for name, size in (("K (x.shape[-1], w.shape[0])", w.shape[0]), ("N (w.shape[1])", w.shape[1])):
        if size % block:
            raise FP8ShapeError(
                f"fp8_matmul: {name} = {size} is not a multiple of the FP8 block size {block}; {_BLOCK_HINT}"
            )
    if backend not in ("gpu", "emulated"):
        raise ValueError(f"fp8_matmul: backend must be 'gpu' or 'emulated', got {backend!r}")
    if backend == "gpu" and block != _GPU_BLOCK:
        raise FP8ShapeError(
            f"fp8_matmul: the GPU FP8 kernel only tiles by {_GPU_BLOCK}, got fp8_block_size {block}; "
            f"use 128 or backend='emulated'"
        )


def fp8_matmul(
    x: paddle.Tensor, w: paddle.Tensor, block: int = 128, backend: str | None = None, grad_format: str = "e4m3"
) -> paddle.Tensor:
    """Differentiable x @ w (x [..., K], w [K, N]; float32/bf16 masters) with every GEMM in block-scaled FP8.

    K and N must be multiples of `block` (else FP8ShapeError, a ValueError); the token count M is
    free. Output and gradients come back in the inputs' dtypes. `backend` None picks `fp8_backend()`
    when x lives on a GPU and "emulated" otherwise (a CPU tensor cannot use the GPU kernel).
    Nothing is cached between calls, so updated weights are always re-quantised. `grad_format`
    is the format of the upstream-gradient tiles in both backward GEMMs (GRAD_FORMATS).
    """
    if backend is None:
        backend = fp8_backend() if x.place.is_gpu_place() else "emulated"
    _check_gemm(x, w, block, backend)
    if grad_format not in GRAD_FORMATS:
        raise ConfigError(f"fp8_grad_format={grad_format!r} is not supported; use one of {sorted(GRAD_FORMATS)}")
    if backend == "gpu" and grad_format != "e4m3":
        raise ConfigError(
            f"fp8_grad_format={grad_format}: the GPU blockwise FP8 kernel path takes e4m3 only; "
            "set fp8_grad_format=e4m3 on GPU"
        )
    lead = list(x.shape[:-1])
    m = 1
    for d in lead:
        m *= d
    y = _FP8MatMul.apply(x.reshape([m, x.shape[-1]]), w, block, backend, grad_format)
    return y.reshape(lead + [w.shape[1]])


# ---- grouped GEMM: every expert of one or more projections in one call ----------------------------
def _per_group(
    a: paddle.Tensor, sizes: list[int], w: paddle.Tensor, experts: list[int], transpose_y: bool = False
) -> paddle.Tensor:
    """Row group g of a times w[experts[g]] (w [E, K, N]): one MKL batched call where there is one
    (nn/grouped_gemm.py, the same bits), else a matmul per group."""
    if grouped_gemm.usable(a, [w]):
        return grouped_gemm.group_matmul(a, w, sizes, experts, transpose_y)
    wl = paddle.unbind(w)
    return concat_rows(
        [paddle.matmul(g, wl[e], transpose_y=transpose_y) for g, e in zip(split_rows(a, sizes), experts)]
    )


def _per_expert_weight_grads(
    x: paddle.Tensor, dy: paddle.Tensor, sizes: list[int], experts: list[int], num_experts: int
) -> paddle.Tensor:
    """[E, K, N]: x_g^T @ dy_g for each expert's row group, zeros for experts without rows."""
    if grouped_gemm.usable(x, [dy]):
        return grouped_gemm.group_weight_grads(x, dy, sizes, experts, num_experts)
    per = {
        e: paddle.matmul(a, b, transpose_x=True)
        for a, b, e in zip(split_rows(x, sizes), split_rows(dy, sizes), experts)
    }
    zero = paddle.zeros([x.shape[1], dy.shape[1]], "float32")
    return paddle.stack([per.get(e, zero) for e in range(num_experts)])


class _FP8GroupedMatMuls(PyLayer):
    """Y_i,g = X_g @ W_i[e_g] for consecutive row groups g and weights W_i that share the input
    (an expert MLP's gate and up projections), every GEMM in block-scaled FP8 (emulated).

    Same tiles, so the same numbers, as one `fp8_matmul` per expert and weight, but each operand is
    quantised once for all experts, and X (rowwise for Y, in token runs for dW) once for all
    weights: X and dY tiles are per token row, W tiles per expert block, and dW's token-run tiles
    start at each group's first row (as if every group were zero-padded to a multiple of the
    block, without the copy). This is what makes CPU FP8 training affordable: at
    tiny-moe size the per-expert version spends most of its time on op dispatch.
    """

    @staticmethod
    def forward(ctx, sizes: list[int], experts: list[int], block: int, grad_format: str, x, *ws):
        ctx.sizes, ctx.experts, ctx.block, ctx.fmt = sizes, experts, block, grad_format
        ctx.dtypes = (x.dtype, ws[0].dtype)
        ctx.need = (not x.stop_gradient, [not w.stop_gradient for w in ws])
        xq = _tensor(fake_quant_np(host_array(x), 1, block))
        wqs = []
        for w in ws:
            E, K, N = w.shape
            wqs.append(_tensor(fake_quant_np(host_array(w).reshape(E * K, N), block, block)).reshape([E, K, N]))
        ctx.save_for_backward(x, *wqs)
        ys = tuple(_per_group(xq, sizes, wq, experts).astype(x.dtype) for wq in wqs)
        return ys if len(ys) > 1 else ys[0]

    @staticmethod
    def backward(ctx, *dys):
        x, *wqs = ctx.saved_tensor()
        sizes, experts, block, fmt = ctx.sizes, ctx.experts, ctx.block, ctx.fmt
        dys_np = [None if dy is None else host_array(dy) for dy in dys]
        dx = None
        if ctx.need[0]:
            for dy, wq in zip(dys_np, wqs):
                if dy is None:
                    continue
                part = _per_group(_tensor(fake_quant_np(dy, 1, block, fmt)), sizes, wq, experts, transpose_y=True)
                dx = part if dx is None else dx + part
            dx = (paddle.zeros(x.shape, "float32") if dx is None else dx).astype(ctx.dtypes[0])
        dws = []
        if any(ctx.need[1]):
            xs = _tensor(fake_quant_token_runs_np(host_array(x), sizes, block))
        for need, dy, wq in zip(ctx.need[1], dys_np, wqs):
            if not need:
                dws.append(None)
                continue
            if dy is None:
                dws.append(paddle.zeros(wq.shape, ctx.dtypes[1]))
                continue
            ds = _tensor(fake_quant_token_runs_np(dy, sizes, block, fmt))
            dws.append(_per_expert_weight_grads(xs, ds, sizes, experts, wq.shape[0]).astype(ctx.dtypes[1]))
        return (dx, *dws)


def _check_grouped(x: paddle.Tensor, ws: list[paddle.Tensor], sizes: list[int], experts: list[int]) -> None:
    for w in ws:
        if len(w.shape) != 3 or len(x.shape) != 2 or len(sizes) != len(experts) or sum(sizes) != x.shape[0]:
            raise ValueError(
                f"fp8_grouped_matmul: need x [M, K], w [E, K, N] and one expert per group summing to M, "
                f"got {list(x.shape)}, {list(w.shape)}, sizes {sizes}, experts {experts}"
            )


def fp8_grouped_matmuls(
    x: paddle.Tensor,
    ws: list[paddle.Tensor],
    sizes: list[int],
    experts: list[int],
    block: int = 128,
    grad_format: str = "e4m3",
) -> list[paddle.Tensor]:
    """`fp8_grouped_matmul(x, w, ...)` for every w in ws (weights sharing the input x), as a list.

    Emulated, x is quantised once for all of them (the same numbers as separate calls)."""
    _check_grouped(x, ws, sizes, experts)
    backend = fp8_backend() if x.place.is_gpu_place() else "emulated"
    for w in ws:
        _check_gemm(x, w[0], block, backend)
    if grad_format not in GRAD_FORMATS:
        raise ConfigError(f"fp8_grad_format={grad_format!r} is not supported; use one of {sorted(GRAD_FORMATS)}")
    if backend == "gpu":
        xs = split_rows(x, sizes)
        out = []
        for w in ws:
            wl = paddle.unbind(w)
            out.append(concat_rows([fp8_matmul(xg, wl[e], block, backend, grad_format) for xg, e in zip(xs, experts)]))
        return out
    ys = _FP8GroupedMatMuls.apply(list(sizes), list(experts), block, grad_format, x, *ws)
    return list(ys) if isinstance(ys, (tuple, list)) else [ys]


def fp8_grouped_matmul(
    x: paddle.Tensor,
    w: paddle.Tensor,
    sizes: list[int],
    experts: list[int],
    block: int = 128,
    grad_format: str = "e4m3",
) -> paddle.Tensor:
    """Rows of x [M, K] come in consecutive groups (sizes, summing to M); group g is multiplied by
    w[experts[g]] (w [E, K, N]). Equal to concatenating `fp8_matmul(x_g, w[e_g])`, differentiable
    for x and w. On a GPU with the FP8 kernel it runs exactly that per-group loop."""
    return fp8_grouped_matmuls(x, [w], sizes, experts, block, grad_format)[0]
