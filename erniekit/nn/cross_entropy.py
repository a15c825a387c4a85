"""Softmax cross entropy against hard labels for float32 CPU logits, forward and backward in one pass.

Why: Paddle's CPU cross_entropy_with_softmax computes and stores the whole softmax in its forward
(5.6 ms for the embedded default's [2048, 1024] logits at 2 threads, torch's forward 1.1 ms) and
the loss of every language-model step goes through it. kernels/cross_entropy.c keeps one
log-sum-exp per row and recomputes the probabilities in the backward from the logits it saved (the
input itself: no [N, V] buffer of its own). Without a C compiler (or with
ERNIEKIT_NATIVE_KERNELS=0) the numpy path below computes the same arithmetic, operation for
operation, so a run gets the same bits either way, only slower. Paddle's kernel rounds its
exponential differently: for finite logits of moderate size the two agree to ~1e-6, not bit for
bit. Non-finite logits propagate: a NaN logit gives a NaN loss and a label on a -inf logit an
infinite one, where Paddle's kernel returns finite numbers for both.
"""

from __future__ import annotations

import ctypes

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native
from erniekit.utils.dtensor import host_array

_F32 = np.float32


def forward_np(x: np.ndarray, label: np.ndarray, ignore: int) -> tuple[np.ndarray, np.ndarray]:
    """x [N, V], label [N] -> (nll [N], lse [N]) as kernels/cross_entropy.c computes them."""
    m = np.fmax.reduce(x, axis=-1)
    lse = m + np.log(native.sum16(native.exp_neg(x - m[:, None])).astype(np.float64)).astype(_F32)
    keep = label != ignore
    picked = x[np.arange(len(x)), np.where(keep, label, 0)]
    return np.where(keep, lse - picked, _F32(0.0)), lse


def backward_np(x: np.ndarray, label: np.ndarray, lse: np.ndarray, g: np.ndarray, ignore: int) -> np.ndarray:
    """d nll / d x times g: softmax(x) * g, minus g at the label; rows with the ignored label get 0."""
    keep = label != ignore
    dx = native.exp_neg(x - lse[:, None]) * g[:, None]
    rows = np.flatnonzero(keep)
    dx[rows, label[rows]] = dx[rows, label[rows]] - g[rows]
    dx[~keep] = 0.0
    return dx


def _kernels():
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return native.functions(
        "cross_entropy", ("erniekit_ce_fwd", [P] * 4 + [I64] * 4), ("erniekit_ce_bwd", [P] * 5 + [I64] * 4)
    )


def _forward(x: paddle.Tensor, label: np.ndarray, ignore: int) -> tuple[paddle.Tensor, np.ndarray]:
    k = _kernels()
    if k is None:
        nll, lse = forward_np(host_array(x), label, ignore)
        return paddle.from_dlpack(nll), lse  # a CPU tensor, as x
    N, V = x.shape
    nll, lse = paddle.empty([N], dtype="float32"), np.empty(N, _F32)
    native.over_chunks(k[0], N, N * V * 4, x.data_ptr(), label.ctypes.data, nll.data_ptr(), lse.ctypes.data, V, ignore)
    return nll, lse


def _backward(
    x: paddle.Tensor,
    label: np.ndarray,
    lse: np.ndarray,
    g: paddle.Tensor,
    ignore: int,
    out: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """out: where the kernel writes the gradient (x itself may be given: each element is read
    before it is written); the numpy path returns a new tensor."""
    k = _kernels()
    if k is None:
        return paddle.from_dlpack(backward_np(host_array(x), label, lse, host_array(g), ignore))
    N, V = x.shape
    dx = paddle.empty_like(x) if out is None else out
    ptrs = (x.data_ptr(), label.ctypes.data, lse.ctypes.data, g.data_ptr(), dx.data_ptr())
    native.over_chunks(k[1], N, N * V * 4, *ptrs, V, ignore)
    return dx


class _CrossEntropy(PyLayer):
    @staticmethod
    def forward(ctx, x, label: np.ndarray, ignore: int):
        nll, ctx.lse = _forward(x, label, ignore)
        ctx.save_for_backward(x)
        ctx.versions = native.versions(x)
        ctx.label, ctx.ignore = label, ignore
        return nll

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensor()
        native.check_versions("cross_entropy", ctx.versions, x)
        return _backward(x, ctx.label, ctx.lse, g.contiguous(), ctx.ignore)


@native.eager_only
def usable(logits: paddle.Tensor) -> bool:
    """Dense float32 CPU logits [N, V] in dynamic mode; anything else keeps Paddle's kernel."""
    return native.dense_cpu_float32(logits) and logits.ndim == 2 and logits.shape[0] > 0 and logits.shape[1] > 0


@native.eager_only
def softmax_cross_entropy(logits: paddle.Tensor, label: np.ndarray, ignore_index: int) -> paddle.Tensor:
    """-log softmax(logits)[label] per row as [N] (0 where label == ignore_index); logits [N, V]
    float32 on the CPU (callers check `usable`), label an int array of N class ids."""
    label = np.asarray(label)
    if label.dtype.kind not in "iu":
        raise ValueError(f"cross entropy: labels must be integer class ids, got dtype {label.dtype}")
    label = np.array(label, dtype=np.int64, copy=True).reshape(-1)  # the backward reads it: our own copy
    if label.shape[0] != logits.shape[0]:
        raise ValueError(f"cross entropy: {label.shape[0]} labels for {logits.shape[0]} rows of logits")
    bad = (label != ignore_index) & ((label < 0) | (label >= logits.shape[1]))
    if bad.any():
        raise ValueError(
            f"cross entropy: label {int(label[bad][0])} is outside the vocabulary of {logits.shape[1]} "
            "logits; check the tokenizer matches the model's vocab_size"
        )
    x = logits if logits.is_contiguous() else logits.contiguous()
    if not paddle.is_grad_enabled() or x.stop_gradient:
        return _forward(x, label, ignore_index)[0]
    return _CrossEntropy.apply(x, label, ignore_index)
