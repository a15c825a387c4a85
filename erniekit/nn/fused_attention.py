"""Softmax attention for float32 on the CPU in one C kernel each way (kernels/attention.c).

Why: the math path (nn/attention.py `math_attention`) transposes q, k and v to heads-major, runs two
batched GEMMs and the masked softmax, transposes back, and autograd mirrors all of it. At the
embedded default's shapes (64 x 32 tokens, 8 heads of 16) those copies and small GEMMs took more time
than their arithmetic and none of them used the second thread. The kernel reads the model's
[B, S, heads, D] layout as it is, one (batch, kv head) per task, with the tasks cut over the
threads; no sum crosses a task, so every thread count gives the same bits.

For the backward it keeps the probabilities when they are small, else each row's softmax max and
reciprocal sum (nn/kernel_memory.py), from which the backward computes them again bit for bit:
flash attention's trade, so long sequences do not hold [heads, S, S] per layer.

The kernel sums in its own order, so it agrees with the math path (MKL's GEMMs) to float32
rounding, not bit for bit; a machine without a C compiler (or ERNIEKIT_NATIVE_KERNELS=0) takes the
math path. GPU, other dtypes, static graphs and distributed tensors keep the math path too.
"""

from __future__ import annotations

import ctypes
import math

import paddle
from paddle.autograd import PyLayer

from erniekit.nn import kernel_memory, native


def _kernels():
    P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    return native.functions(
        "attention",
        ("erniekit_attention_fwd", [P] * 7 + [F32] + [I64] * 9),
        ("erniekit_attention_bwd", [P] * 10 + [F32] + [I64] * 8),
    )


def _forward(q, k, v, bias, scale: float, keep: bool):
    """o, and for a backward (`keep`) either the probabilities or the rows' softmax statistics."""
    B, Sq, H, D = q.shape
    Sk, KVH = k.shape[1], k.shape[2]
    o = paddle.empty_like(q)
    p = stats = None
    if keep and kernel_memory.keeps_probs(B, H, Sq, Sk):
        p = paddle.empty([B, H, Sq, Sk], dtype=q.dtype)
    elif keep:
        stats = paddle.empty([B, H, Sq, 2], dtype=q.dtype)
    shape = (scale, Sq, Sk, Sk, H, KVH, D, int(bias.shape[0] > 1))
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr(), o.data_ptr())
    native.over_chunks(
        _kernels()[0],
        B * KVH,
        math.prod(q.shape) * 4 + math.prod(k.shape) * 8,
        *ptrs,
        native.address(p),
        native.address(stats),
        *shape,
        # a decode step's rows are a few us of work each: under ~1 MB the pool's hand-off costs more
        # (1 row, 160 keys: 168 us on two threads against 55 on one; 16 rows: 410 against 577)
        min_bytes=1 << 16 if Sq > 1 else native.PARALLEL_BYTES,
    )
    return o, p, stats


def decode_ready(head_dim: int) -> bool:
    """Whether `decode_forward` can run heads this wide (the kernel built, `usable`'s head check)."""
    return native.cpu_build() and kernel_memory.kernel_head_dim(head_dim) and _kernels() is not None


def decode_forward(
    q: int,
    k: int,
    v: int,
    bias: int,
    o: int,
    B: int,
    Sk: int,
    kv_rows: int,
    H: int,
    KVH: int,
    D: int,
    scale: float,
    bias_batched: bool,
) -> None:
    """`_forward` of one new token per sequence (Sq = 1, nothing kept) on buffers given by address:
    q, o [B, 1, H, D]; k, v [B, kv_rows, KVH, D] of which the first Sk rows of each entry are read (a
    KV cache's buffers in place); bias [B if bias_batched else 1, 1, 1, Sk]. The kernel must be built
    (`usable`); the same arithmetic as `fused_attention`, so the same bits."""
    native.over_chunks(
        _kernels()[0],
        B * KVH,
        B * H * D * 4 + B * Sk * KVH * D * 8,
        q,
        k,
        v,
        bias,
        o,
        None,
        None,
        scale,
        1,
        Sk,
        kv_rows,
        H,
        KVH,
        D,
        int(bias_batched),
        min_bytes=native.PARALLEL_BYTES,
    )


class _FusedAttention(PyLayer):
    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        o, p, stats = _forward(q, k, v, bias, scale, keep=True)
        ctx.save_for_backward(q, k, v, bias, p, stats)
        ctx.scale = scale
        ctx.versions = native.versions(q, k, v, *([bias] if p is None else []))  # the mask: read again
        # a LoRA adapter on q_proj alone leaves k and v of a frozen layer's input without a gradient:
        # Paddle refuses a gradient for them (the kernel computes all three; the unwanted are dropped)
        ctx.need = tuple(not t.stop_gradient for t in (q, k, v))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, p, stats = ctx.saved_tensor()
        native.check_versions("attention", ctx.versions, q, k, v, *([bias] if p is None else []))
        do = do.contiguous()
        B, Sq, H, D = q.shape
        Sk, KVH = k.shape[1], k.shape[2]
        dq, dk, dv = paddle.empty_like(q), paddle.empty_like(k), paddle.empty_like(v)
        ptrs = [native.address(t) for t in (q, k, v, bias, p, stats, do, dq, dk, dv)]
        native.over_chunks(
            _kernels()[1],
            B * KVH,
            math.prod(q.shape) * (8 if p is not None else 12) + math.prod(k.shape) * 16,
            *ptrs,
            ctx.scale,
            Sq,
            Sk,
            H,
            KVH,
            D,
            int(bias.shape[0] > 1),
            min_bytes=1 << 16,
        )
        return (*(g if need else None for g, need in zip((dq, dk, dv), ctx.need)), None)


@native.eager_only
def usable(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: paddle.Tensor) -> bool:
    """Dense float32 CPU q [B, Sq, H, D], k / v [B, Sk, KVH, D] (H a multiple of KVH, D of 16) and an
    additive mask [1|B, 1, Sq, Sk] taking no gradient, in dynamic mode, with the kernel built."""
    if not (native.dense_cpu_float32(q, k, v, bias) and q.ndim == 4 and k.ndim == 4 and bias.ndim == 4):
        return False
    B, Sq, H, D = q.shape
    Sk, KVH = k.shape[1], k.shape[2]
    return (
        list(k.shape) == list(v.shape) == [B, Sk, KVH, D]
        and KVH > 0
        and H % KVH == 0
        and kernel_memory.kernel_head_dim(D)
        and list(bias.shape) in ([1, 1, Sq, Sk], [B, 1, Sq, Sk])
        and bias.stop_gradient
        and 0 not in q.shape
        and Sk > 0
        and _kernels() is not None
    )


@native.eager_only
def fused_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """softmax((q * scale) k^T + bias) v with GQA, q [B, Sq, H, D], k / v [B, Sk, KVH, D] ->
    [B, Sq, H, D]; callers check `usable` first."""
    q, k, v, bias = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v, bias))  # read by address
    needs_grad = paddle.is_grad_enabled() and not (q.stop_gradient and k.stop_gradient and v.stop_gradient)
    if not needs_grad:
        return _forward(q, k, v, bias, scale, keep=False)[0]
    return _FusedAttention.apply(q, k, v, bias, scale)
