"""ERNIE 4.5's rotary embedding (interleaved pairs) with a fused CPU kernel, forward and backward.

Why: the eager rope (nn/attention.py `apply_rope`) expands cos and sin to the heads, rotates the
pairs by a 2x2 matmul and takes two products and a sum, and autograd mirrors each: ~1.5 ms per call
on the embedded default's q at 2 threads, two calls a layer. kernels/rope.c does each direction in
one pass over x, reading cos and sin unexpanded. The arithmetic is the eager ops' operation for
operation (the rotation matmul only moves and negates values), so finite inputs give the same bits
(up to the sign of a zero; an infinite input gives inf here where the matmul gives NaN);
the numpy path below computes the same when there is no C compiler (or with
ERNIEKIT_NATIVE_KERNELS=0). Other dtypes, devices, static graphs and distributed tensors keep the
eager ops.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native
from erniekit.utils.dtensor import host_array


def forward_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [R, H, D], cos / sin [R, 1, D] -> the rotated x, as kernels/rope.c computes it."""
    a, b = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = a * cos[..., 0::2] + (-b) * sin[..., 0::2]
    y[..., 1::2] = b * cos[..., 1::2] + a * sin[..., 1::2]
    return y


def backward_np(g: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x's gradient: the transposed rotation of g."""
    a, b = g[..., 0::2], g[..., 1::2]
    dx = np.empty_like(g)
    dx[..., 0::2] = a * cos[..., 0::2] + b * sin[..., 1::2]
    dx[..., 1::2] = b * cos[..., 1::2] + (-a) * sin[..., 0::2]
    return dx


def _kernels():
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    args = [P] * 4 + [I64] * 4
    return native.functions("rope", ("erniekit_rope_fwd", args), ("erniekit_rope_bwd", args))


def forward_kernel():
    """kernels/rope.c's forward (x, cos, sin, y, H, D, r0, r1), or None without the build (as norm.py's)."""
    k = _kernels()
    return None if k is None else k[0]


def _run(which: int, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    R, H, D = math.prod(x.shape[:2]), x.shape[2], x.shape[3]
    k = _kernels()
    if k is None:
        fn = (forward_np, backward_np)[which]
        rows = [host_array(t).reshape(R, -1, D) for t in (x, cos, sin)]
        return paddle.from_dlpack(fn(*rows)).reshape(x.shape)  # a CPU tensor, as x
    y = paddle.empty_like(x)
    native.over_chunks(k[which], R, R * H * D * 4, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), H, D)
    return y


class _NativeRope(PyLayer):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.versions = native.versions(cos, sin)
        return _run(0, x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensor()
        native.check_versions("rope", ctx.versions, cos, sin)
        return _run(1, dy.contiguous(), cos, sin), None, None


@native.eager_only
def usable(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> bool:
    """Dense float32 CPU x [B, S, H, D] (D even) with cos / sin [B, S, 1, D] as `rope_cos_sin`
    makes them, in dynamic mode, cos and sin taking no gradient."""
    return (
        native.dense_cpu_float32(x, cos, sin)
        and x.ndim == 4
        and x.shape[-1] % 2 == 0
        and list(cos.shape) == list(sin.shape) == [x.shape[0], x.shape[1], 1, x.shape[3]]
        and cos.stop_gradient
        and sin.stop_gradient
        and 0 not in x.shape
    )


@native.eager_only  # full-graph programs take the eager ops
def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x [B, S, H, D] rotated by cos / sin [B, S, 1, D]; callers check `usable` first."""
    x, cos, sin = (t if t.is_contiguous() else t.contiguous() for t in (x, cos, sin))  # read by address
    if not paddle.is_grad_enabled() or x.stop_gradient:
        return _run(0, x, cos, sin)
    return _NativeRope.apply(x, cos, sin)
