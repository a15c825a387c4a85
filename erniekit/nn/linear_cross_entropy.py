"""The LM head and its cross entropy in chunks of rows, without the [N, V] logits of the whole batch.

Why: a training step's logits and their gradient are the largest tensors it makes. ERNIE 4.5's
vocabulary of 103,424 at 8,192 tokens a step is 3.4 GB of float32 logits and 3.4 GB again for their
gradient, more than the 0.3B model's weights, gradients and Adam moments together. Here each chunk
of rows gets its logits, their loss and the loss's gradient (written over the logits, one buffer
per chunk), and the head's two products of that gradient: into the hidden states' gradient and
into the weight's, accumulated over the chunks. The forward so does the backward's work while the
chunk is at hand (as Liger's fused linear cross entropy does), and the backward scales what it
kept. No GEMM is added; a row-weighted loss (a gradient that is not the same for every row)
recomputes each chunk's logits in the backward instead.

The loss of every row is what `nn.cross_entropy.softmax_cross_entropy` gives on the full logits
(the same kernel on the same values); the gradients differ from the unfused path only in the order
in which the weight's gradient adds up the chunks (MKL's GEMM adds each chunk's product into it in
place, so dW needs no second [V, H] buffer).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import cross_entropy, grouped_gemm, native
from erniekit.nn.kernel_memory import chunk_rows


@native.eager_only
def usable(h: paddle.Tensor, w: paddle.Tensor) -> bool:
    """Dense float32 CPU hidden states [N, H] and weight in dynamic mode (the CPU loss kernel's
    conditions); anything else computes the logits whole."""
    return native.dense_cpu_float32(h, w) and h.ndim == 2 and w.ndim == 2 and h.shape[0] > 0


def _logits(h: paddle.Tensor, w: paddle.Tensor, w_vocab_first: bool) -> paddle.Tensor:
    return paddle.matmul(h, w, transpose_y=w_vocab_first)


def _check_labels(label: np.ndarray, rows: int, vocab: int, ignore: int) -> np.ndarray:
    label = np.array(np.asarray(label), dtype=np.int64, copy=True).reshape(-1)  # the backward may read it
    if label.shape[0] != rows:
        raise ValueError(f"linear cross entropy: {label.shape[0]} labels for {rows} rows of hidden states")
    bad = (label != ignore) & ((label < 0) | (label >= vocab))
    if bad.any():
        raise ValueError(
            f"linear cross entropy: label {int(label[bad][0])} is outside the vocabulary of {vocab} "
            "logits; check the tokenizer matches the model's vocab_size"
        )
    return label


def _add_chunk_dw(dw, h_c, dlogits, w_vocab_first: bool):
    """dW (None before the first chunk) plus this chunk's product: W [V, H] takes dlogits^T h, W [H, V]
    h^T dlogits. With MKL at hand the product adds into dW in place (no [V, H] temporary per chunk)."""
    a, b = (dlogits, h_c) if w_vocab_first else (h_c, dlogits)
    if not grouped_gemm.usable(a, [b]):
        dw_c = paddle.matmul(a, b, transpose_x=True)
        return dw_c if dw is None else dw.add_(dw_c)
    first = dw is None
    if first:
        dw = paddle.empty([a.shape[1], b.shape[1]], dtype="float32")
    grouped_gemm.gemm_into(a, b, dw, trans_a=True, trans_b=False, beta=0.0 if first else 1.0)
    return dw


def _chunk_pass(h, w, label, ignore, w_vocab_first, rows, g=None, nll=None, want_h=False, want_w=False):
    """Over the chunks of rows: each one's logits, its losses into `nll` (when given) and, when a
    gradient is wanted, the losses' gradient times g (None: 1 for every row) written over the
    logits and its products into (d h, d w) accumulated over the chunks."""
    dh = paddle.empty_like(h) if want_h else None
    dw = None
    with paddle.no_grad():
        for s in range(0, h.shape[0], rows):
            h_c, lab = h[s : s + rows], label[s : s + rows]
            logits = _logits(h_c, w, w_vocab_first)
            nll_c, lse = cross_entropy._forward(logits, lab, ignore)
            if nll is not None:
                nll[s : s + rows] = nll_c
            if not (want_h or want_w):
                continue
            g_c = paddle.ones([h_c.shape[0]], dtype="float32") if g is None else g[s : s + rows]
            dlogits = cross_entropy._backward(logits, lab, lse, g_c, ignore, out=logits)
            del logits
            if want_h:  # [c, V] x W -> [c, H]
                dh[s : s + rows] = paddle.matmul(dlogits, w, transpose_y=not w_vocab_first)
            if want_w:
                dw = _add_chunk_dw(dw, h_c, dlogits, w_vocab_first)
    return dh, dw


class _LinearCrossEntropy(PyLayer):
    @staticmethod
    def forward(ctx, h, w, label: np.ndarray, ignore: int, w_vocab_first: bool, rows: int):
        nll = paddle.empty([h.shape[0]], dtype="float32")
        want = {"want_h": not h.stop_gradient, "want_w": not w.stop_gradient}
        ctx.kept = _chunk_pass(h, w, label, ignore, w_vocab_first, rows, nll=nll, **want)
        ctx.save_for_backward(h, w)
        ctx.versions = native.versions(h, w)
        ctx.label, ctx.ignore, ctx.w_vocab_first, ctx.rows, ctx.want = label, ignore, w_vocab_first, rows, want
        return nll

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensor()
        native.check_versions("linear cross entropy", ctx.versions, h, w)
        dh, dw = ctx.kept  # one backward per forward, as Paddle's PyLayers here (retain_graph: not supported)
        ctx.kept = None
        g = g.contiguous()
        first = g[:1]
        if bool((g == first).all()):  # a sum of the rows' losses (times a scale): scale what the forward kept
            scale = float(first.numpy()[0])
            for t in (dh, dw):
                if t is not None and scale != 1.0:
                    t.scale_(scale)  # in place: a second [V, H] would cost what the chunks saved
            return dh, dw
        # each row's loss has a weight of its own: the chunks' logits again, their gradient times g
        return _chunk_pass(h, w, ctx.label, ctx.ignore, ctx.w_vocab_first, ctx.rows, g=g, **ctx.want)


@native.eager_only
def linear_cross_entropy(
    h: paddle.Tensor,
    w: paddle.Tensor,
    label: np.ndarray,
    ignore_index: int,
    w_vocab_first: bool,
    rows: int | None = None,
) -> paddle.Tensor:
    """-log softmax(h W)[label] per row as [N] (0 where label == ignore_index), without the
    [N, V] logits: h [N, H]; w [V, H] when w_vocab_first (a tied embedding), else [H, V] (a
    Linear's weight). Callers check `usable`. rows: per chunk (default `chunk_rows`)."""
    V = w.shape[0] if w_vocab_first else w.shape[1]
    label = _check_labels(label, h.shape[0], V, ignore_index)
    rows = rows or chunk_rows(V, h.shape[0])
    h = h if h.is_contiguous() else h.contiguous()
    if not paddle.is_grad_enabled() or (h.stop_gradient and w.stop_gradient):
        nll = paddle.empty([h.shape[0]], dtype="float32")
        _chunk_pass(h, w, label, ignore_index, w_vocab_first, rows, nll=nll)
        return nll
    return _LinearCrossEntropy.apply(h, w, label, ignore_index, w_vocab_first, rows)
