"""softmax(scores + additive mask) for the CPU attention, forward and backward in one pass each.

Why: at 320 tokens the attention's expand + add + softmax and their backward were about half of a
layer's attention time (the tool-calling demo's step was ~80% attention); kernels/masked_softmax.c
does each direction in one pass per row and reads the mask unexpanded. Without a C compiler (or
with ERNIEKIT_NATIVE_KERNELS=0) the numpy path below computes the same arithmetic, operation for
operation, so a run gets the same bits either way, only slower. Paddle's own softmax rounds its
exponential differently: the two agree to ~1e-7, not bit for bit.
"""

from __future__ import annotations

import ctypes

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native
from erniekit.utils.dtensor import host_array

_F32 = np.float32


def forward_np(s: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """s [B, G, Sq, Sk], bias [1|B, 1, Sq, Sk] -> softmax(s + bias) over the last axis."""
    z = s + bias
    m = np.fmax.reduce(z, axis=-1, keepdims=True)  # a NaN is skipped, as the kernel's compare does
    e = native.exp_neg(z - m)
    return e * (_F32(1.0) / native.sum16(e))[..., None]


def backward_np(p: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """The scores' gradient p * (dp - sum(p * dp)) (rows over the last axis)."""
    return p * (dp - native.sum16(p * dp)[..., None])


def _kernels():
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return native.functions(
        "masked_softmax",
        ("erniekit_masked_softmax_fwd", [P] * 3 + [I64] * 6),
        ("erniekit_masked_softmax_bwd", [P] * 3 + [I64] * 3),
    )


def forward(s: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """`forward_np` by the C kernel when there is one, its planes cut over the threads."""
    k = _kernels()
    if k is None:
        return forward_np(s, bias)
    B, G, Sq, Sk = s.shape
    p = np.empty_like(s)
    args = (s.ctypes.data, bias.ctypes.data, p.ctypes.data, G, Sq, Sk, int(bias.shape[0] > 1))
    native.over_chunks(k[0], B * G, s.nbytes, *args)
    return p


def backward(p: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """`backward_np` by the C kernel when there is one, its rows cut over the threads."""
    k = _kernels()
    if k is None:
        return backward_np(p, dp)
    Sk = p.shape[-1]
    rows = p.size // Sk
    ds = np.empty_like(p)
    native.over_chunks(k[1], rows, p.nbytes, p.ctypes.data, dp.ctypes.data, ds.ctypes.data, Sk)
    return ds


class _MaskedSoftmax(PyLayer):
    @staticmethod
    def forward(ctx, s, bias):
        p = paddle.from_dlpack(forward(host_array(s), host_array(bias)))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, dp):
        (p,) = ctx.saved_tensor()
        return paddle.from_dlpack(backward(host_array(p), host_array(dp.contiguous()))), None


@native.eager_only
def usable(s: paddle.Tensor, bias: paddle.Tensor) -> bool:
    """Dense float32 CPU scores [B, G, Sq, Sk] and mask [1|B, 1, Sq, Sk] in dynamic mode; anything
    else (GPU, static graphs, half precision, distributed tensors) keeps Paddle's ops."""
    return (
        native.dense_cpu_float32(s, bias)
        and s.ndim == 4
        and bias.ndim == 4
        and bias.shape[1] == 1
        and bias.shape[0] in (1, s.shape[0])
        and list(bias.shape[2:]) == list(s.shape[2:])
        and s.size > 0
    )


@native.eager_only
def masked_softmax(s: paddle.Tensor, bias: paddle.Tensor) -> paddle.Tensor:
    """softmax(s + bias, axis=-1), s [B, G, Sq, Sk] float32 on the CPU, bias [1|B, 1, Sq, Sk]
    (no gradient: an attention mask). Callers check `usable` first."""
    if not paddle.is_grad_enabled() or s.stop_gradient:
        return paddle.from_dlpack(forward(host_array(s), host_array(bias)))
    return _MaskedSoftmax.apply(s, bias)
