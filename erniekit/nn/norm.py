"""RMSNorm with a hand-written backward.

Paddle's CPU autograd through the plain formula spends most of the norm's time in broadcasting
multiply-grads, and even the closed-form backward below is ~12 eager passes over the activation
(~4 ms a backward at the embedded default's [64, 32, 128] on one thread, 9 norms a step). Float32
CPU tensors therefore take kernels/rms_norm.c: one pass per row each way, saving x and the [N]
vector r instead of n and an expanded r. Without a C compiler (or with ERNIEKIT_NATIVE_KERNELS=0)
the numpy path below computes the same arithmetic, operation for operation, so a run gets the same
bits either way. Other dtypes and devices take the eager PyLayer; distributed tensors and static
graphs keep the plain formula.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native
from erniekit.utils.dtensor import host_array, is_dist

_F32 = np.float32


def forward_np(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """x [N, H], w [H] -> (y [N, H], r [N]) as kernels/rms_norm.c computes them."""
    r = _F32(1.0) / np.sqrt(native.sum16(x * x) / _F32(x.shape[-1]) + _F32(eps))
    return (x * r[:, None]) * w, r


def backward_np(
    x: np.ndarray, w: np.ndarray, r: np.ndarray, dy: np.ndarray, need_dx: bool, need_p: bool
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(dx, p = dy * n) as kernels/rms_norm.c computes them; the weight's gradient is p's column sums."""
    n = x * r[:, None]
    p = dy * n if need_p else None
    if not need_dx:
        return None, p
    dn = dy * w
    t = native.sum16(dn * n) / _F32(x.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):  # r = 0 (overflow) gives NaN on purpose
        rr = r * (r / r)
    return (dn - n * t[:, None]) * rr[:, None], p


def _kernels():
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return native.functions(
        "rms_norm",
        ("erniekit_rms_norm_fwd", [P, P, P, P, I64, ctypes.c_float, I64, I64]),
        ("erniekit_rms_norm_bwd", [P] * 6 + [I64] * 3),
    )


def forward_kernel():
    """kernels/rms_norm.c's forward (x, w, y, r, H, eps, r0, r1), or None without the build: for a
    caller running it on buffers of its own (models/ernie4_5/decode_step.py)."""
    k = _kernels()
    return None if k is None else k[0]


def _rows(t: paddle.Tensor) -> np.ndarray:
    a = host_array(t)
    return a.reshape(-1, a.shape[-1])


def _forward(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> tuple[paddle.Tensor, np.ndarray]:
    """(y, r) for contiguous float32 CPU tensors. The kernel reads and writes Paddle's buffers by
    address: a decode step's 1-row norm is then ~40 us (the eager ops: ~30) instead of ~100 through
    DLPack views."""
    k = _kernels()
    if k is None:
        y, r = forward_np(_rows(x), host_array(w), eps)
        return paddle.from_dlpack(y).reshape(x.shape), r
    H = x.shape[-1]
    N = math.prod(x.shape[:-1])
    y, r = paddle.empty_like(x), np.empty(N, _F32)
    native.over_chunks(k[0], N, N * H * 4, x.data_ptr(), w.data_ptr(), y.data_ptr(), r.ctypes.data, H, eps)
    return y, r


def _backward(x, w, r, dy, need_dx: bool, need_p: bool) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
    k = _kernels()
    if k is None:
        dx, p = backward_np(_rows(x), host_array(w), r, _rows(dy), need_dx, need_p)
        return tuple(paddle.from_dlpack(a).reshape(x.shape) if a is not None else None for a in (dx, p))
    N, H = r.shape[0], x.shape[-1]
    dx = paddle.empty_like(x) if need_dx else None
    p = paddle.empty_like(x) if need_p else None
    ptrs = (x.data_ptr(), w.data_ptr(), r.ctypes.data, dy.data_ptr(), native.address(dx), native.address(p))
    native.over_chunks(k[1], N, N * H * 4, *ptrs, H)
    return dx, p


class _NativeRMSNorm(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, ctx.r = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.versions = native.versions(x, weight)
        ctx.need = (not x.stop_gradient, not weight.stop_gradient)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensor()
        native.check_versions("rms_norm", ctx.versions, x, weight)
        dx, p = _backward(x, weight, ctx.r, dy.contiguous(), *ctx.need)
        dw = None
        if p is not None:  # column sums by one GEMM, as the eager backward does
            p = p.reshape([-1, p.shape[-1]])
            dw = paddle.matmul(paddle.ones([1, p.shape[0]], p.dtype), p).reshape(weight.shape)
        return dx, dw


def usable(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    """Dense float32 CPU tensors in dynamic mode; anything else (GPU, static graphs, half
    precision, distributed tensors) keeps Paddle's ops."""
    return (
        native.dense_cpu_float32(x, weight)
        and weight.is_contiguous()
        and len(weight.shape) == 1
        and len(x.shape) >= 1
        and x.shape[-1] == weight.shape[0]
        and 0 not in x.shape
    )


class _RMSNorm(PyLayer):
    """y = w * n, n = h * r, r = 1 / sqrt(mean(h^2) + eps), h = x in float32.

    Backward by the closed form dh = r * (dn - n * mean(dn * n)), dn = dy * w, dw = sum over rows
    of dy * n (one GEMM): 8 eager ops where autograd through the forward runs ~14, several of them
    Paddle's slow broadcasting grads; broadcasts are expanded first (Paddle's CPU multiply of a
    [N, 1] by a [N, H] tensor takes 0.62 ms, 0.05 ms expanded). 1.9 -> 0.6 ms per norm forward +
    backward at [64, 32, 128] (2 threads)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        h = x.astype("float32")
        r = paddle.rsqrt((h * h).mean(-1, keepdim=True) + eps).expand(h.shape)  # same-shape products
        n = h * r
        ctx.save_for_backward(weight, n, r)
        ctx.x_dtype = x.dtype
        ctx.need = (not x.stop_gradient, not weight.stop_gradient)
        return n.astype(x.dtype) * weight.expand(n.shape)

    @staticmethod
    def backward(ctx, dy):
        weight, n, r = ctx.saved_tensor()
        dy = dy.astype("float32")
        dx = dw = None
        if ctx.need[1]:
            rows = (dy * n).reshape([-1, n.shape[-1]])
            dw = paddle.matmul(paddle.ones([1, rows.shape[0]], rows.dtype), rows).reshape(weight.shape)
            dw = dw.astype(weight.dtype)
        if ctx.need[0]:
            dn = dy * weight.astype("float32").expand(dy.shape)
            # r / r: 1, or NaN where mean(h^2) overflowed (r = 0), as autograd's rsqrt grad gives, so a
            # blown-up run still shows a nan gradient norm instead of training on zeros
            r = r * (r / r)
            dx = ((dn - n * (dn * n).mean(-1, keepdim=True).expand(n.shape)) * r).astype(ctx.x_dtype)
        return dx, dw


@native.eager_only  # full-graph programs take the plain formula
def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, computed in float32 whatever x's
    dtype (as the reference does), returned in x's dtype."""
    if usable(x, weight):
        x = x if x.is_contiguous() else x.contiguous()  # the kernel reads rows by address
        if not paddle.is_grad_enabled() or (x.stop_gradient and weight.stop_gradient):
            return _forward(x, weight, eps)[0]
        return _NativeRMSNorm.apply(x, weight, eps)
    plain = not paddle.in_dynamic_mode() or is_dist(x) or is_dist(weight)
    # nothing to differentiate (inference under no_grad, frozen inputs): the PyLayer's bookkeeping
    # would be pure overhead (decode steps)
    if plain or not paddle.is_grad_enabled() or (x.stop_gradient and weight.stop_gradient):
        h = x.astype("float32")
        h = h * paddle.rsqrt((h * h).mean(-1, keepdim=True) + eps)  # h*h: Paddle's CPU pow is ~30x slower
        return weight * h.astype(x.dtype)
    return _RMSNorm.apply(x, weight, eps)
