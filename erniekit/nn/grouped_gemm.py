"""Grouped GEMM of the MoE experts on CPU: one MKL `cblas_sgemm_batch` call for every expert group.

Paddle has no grouped GEMM on CPU, so StackedExperts ran one eager matmul per expert, wrapped in a
split of the rows, an unbind of the weights and a concat of the outputs, and autograd ran the
mirror image of all of it. Paddle's CPU wheel ships MKL (paddle/libs/libmklml_intel.so), whose
batched GEMM takes every group in one call and runs the groups over its threads. The products
are MKL's sgemm, as Paddle's matmul calls it, but MKL picks its kernel per call from the shapes and
the thread count, so a group can round differently in the batch than alone (1-row groups, which
differ most, are sent alone): the results equal the eager loop's to float32 rounding, most of
them bit for bit.
Without that library (other wheels, other CPUs) `usable()` is False and the eager loop runs.
Forwards without a gradient over at most DECODE_ROWS rows (a decode step, a short prefill or
scoring pass) run their groups of a few rows on small_gemm's kn kernel instead (`run_products`).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native, small_gemm

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
DECODE_ROWS = 64  # see decode_sized
_lib: list = []  # [CDLL | None], filled on first use


def _mkl() -> ctypes.CDLL | None:
    if not _lib:
        path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libmklml_intel.so")
        try:
            lib = ctypes.CDLL(path) if os.path.isfile(path) else None
        except OSError:
            lib = None
        if lib is not None and not hasattr(lib, "cblas_sgemm_batch"):
            lib = None
        if lib is None:
            native.why_not["grouped_gemm"] = f"no MKL cblas_sgemm_batch at {path}"
        _lib.append(lib)
    return _lib[0]


def available() -> bool:
    """MKL's batched GEMM is at hand and the native kernels are on."""
    return native.kernels_enabled() and _mkl() is not None


def usable(x: paddle.Tensor, weights: list[paddle.Tensor]) -> bool:
    """Float32 dense CPU tensors in dynamic mode, contiguous, and MKL's batched GEMM at hand."""
    return available() and native.dense_cpu_float32(x, *weights) and all(t.is_contiguous() for t in (x, *weights))


def run_batch(products: list[tuple[int, int, int, int, int, int, int, bool, bool]]) -> None:
    """One cblas_sgemm_batch over (A, B, C, m, n, k, ldb, trans_a, trans_b) products, C = op(A) op(B),
    row-major with lda / ldc implied by the transposes (A [m, k] or [k, m], C [m, n]); MKL must be
    at hand (`available()`)."""
    products = [q for q in products if min(q[3:6]) > 0]  # an empty group writes nothing (dW: zeros already)
    single = [q for q in products if min(q[3:6]) == 1]
    if single:  # MKL rounds a 1-row product in a batch unlike its sgemm alone (Paddle's): those go alone
        products = [q for q in products if min(q[3:6]) > 1]
        for q in single:
            _batch_call([q])
    _batch_call(products)


def decode_sized(rows: int) -> bool:
    """Whether experts' products over `rows` dispatched rows take `run_products(..., decode=True)`:
    no gradient, and at most DECODE_ROWS rows (a decode step of up to 16 sequences at top-4, but also
    a prefill or scoring pass that small)."""
    return rows <= DECODE_ROWS and not paddle.is_grad_enabled()


def run_products(products: list[tuple], decode: bool) -> None:
    """`run_batch`, except that with `decode` every group of at most small_gemm.KN_ROWS rows the kn
    kernel takes runs there (nn/small_gemm.py: the same sums at any thread count).

    Why: MKL's batched GEMM streams groups of 2-5 rows slowly: in a batch-8 decode step of the
    moe16-top4 benchmark model (1 MB experts) the batch calls read ~6 GB/s on an Intel Xeon (2
    threads), the kernel ~16. The kernel sums in its own order, so an expert's output differs from
    MKL's in the last bits: the layers and models/ernie4_5/decode_step.py decide alike
    (`decode_sized`), and a forward with a gradient keeps MKL's. As with the dense projections'
    kernels (at most small_gemm.KN_ROWS rows without a gradient), a no-gradient pass of that size
    (RL's old or reference log-probabilities of a batch of a few tokens) then differs in the last
    bits from the same pass with a gradient; larger passes are MKL's both ways."""
    if decode:
        small: dict[tuple[int, int], list] = {}
        rest = []
        for q in products:  # (a, b, c, m, n, k, ldb, trans_a, trans_b)
            if q[7] or q[8] or q[6] != q[4] or not small_gemm.kn_takes(q[3], q[5], q[4]):
                rest.append(q)
            else:
                small.setdefault((q[5], q[4]), []).append(q[:4])
        for (K, N), group in small.items():
            small_gemm.kn_groups(group, K, N)
        products = rest
    run_batch(products)


def _batch_call(products: list) -> None:
    g = len(products)
    if not g:
        return
    I32, F32, P = ctypes.c_int * g, ctypes.c_float * g, ctypes.c_void_p * g
    a, b, c, m, n, k, ldb, ta, tb = zip(*products)
    lda = [mi if t else ki for mi, ki, t in zip(m, k, ta)]
    _mkl().cblas_sgemm_batch(
        ctypes.c_int(_ROW_MAJOR),
        I32(*[_TRANS if t else _NO_TRANS for t in ta]),
        I32(*[_TRANS if t else _NO_TRANS for t in tb]),
        I32(*m),
        I32(*n),
        I32(*k),
        F32(*[1.0] * g),
        P(*a),
        I32(*lda),
        P(*b),
        I32(*ldb),
        F32(*[0.0] * g),
        P(*c),
        I32(*n),
        ctypes.c_int(g),
        I32(*[1] * g),
    )


def gemm_into(
    a: paddle.Tensor, b: paddle.Tensor, out: paddle.Tensor, trans_a: bool, trans_b: bool, beta: float
) -> None:
    """out = op(a) op(b) + beta * out in place, one MKL cblas_sgemm (contiguous float32 CPU tensors,
    2-D, checked by the caller; `_mkl()` not None): a sum of products without a temporary per term."""
    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    n = b.shape[0] if trans_b else b.shape[1]
    if list(out.shape) != [m, n] or (b.shape[1] if trans_b else b.shape[0]) != k:
        raise ValueError(
            f"gemm_into: {list(a.shape)} x {list(b.shape)} (trans {trans_a}, {trans_b}) into {list(out.shape)}"
        )
    _mkl().cblas_sgemm(
        ctypes.c_int(_ROW_MAJOR),
        ctypes.c_int(_TRANS if trans_a else _NO_TRANS),
        ctypes.c_int(_TRANS if trans_b else _NO_TRANS),
        ctypes.c_int(m),
        ctypes.c_int(n),
        ctypes.c_int(k),
        ctypes.c_float(1.0),
        ctypes.c_void_p(a.data_ptr()),
        ctypes.c_int(a.shape[1]),
        ctypes.c_void_p(b.data_ptr()),
        ctypes.c_int(b.shape[1]),
        ctypes.c_float(beta),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(n),
    )


def linear_call(w: paddle.Tensor, bias: paddle.Tensor | None, rows: int):
    """A function (x, y) of two buffer addresses computing y [rows, N] = x [rows, K] @ w (+ bias) as
    Paddle's CPU linear computes it: MKL's sgemm with these arguments, then the bias added in one
    rounding (a rank-1 update by a column of ones). For decode steps on buffers of their own
    (models/ernie4_5/decode_step.py) where a layer's product goes to Paddle's GEMM: a tiny model's
    projections, or more rows than the kernels take. None without MKL or for a weight that is not a
    contiguous float32 [K, N] on the CPU."""
    tensors = (w,) if bias is None else (w, bias)
    if not (available() and rows > 0 and w.ndim == 2 and native.dense_cpu_float32(*tensors)):
        return None
    if not all(t.is_contiguous() for t in tensors) or (bias is not None and list(bias.shape) != [w.shape[1]]):
        return None
    K, N = w.shape
    lib, P = _mkl(), ctypes.c_void_p
    sgemm, sger = lib.cblas_sgemm, lib.cblas_sger
    one, zero, wp = ctypes.c_float(1.0), ctypes.c_float(0.0), P(w.data_ptr())  # an address, not the tensor
    head = (_ROW_MAJOR, _NO_TRANS, _NO_TRANS, rows, N, K, one)
    if bias is None:
        return lambda x, y: sgemm(*head, P(x), K, wp, N, zero, P(y), N)
    ones, bp = np.ones(rows, np.float32), P(bias.data_ptr())
    op = P(ones.ctypes.data)

    def call(x: int, y: int, _keep=ones) -> None:
        sgemm(*head, P(x), K, wp, N, zero, P(y), N)
        sger(_ROW_MAJOR, rows, N, one, op, 1, bp, 1, P(y), N)

    return call


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *np.cumsum(sizes).tolist()]


def _products(a, w, out, sizes: list[int], used: list[int], transpose_w: bool) -> list[tuple]:
    """out_g = a_g @ W_e (w [E, K, N], a [M, K], out [M, N]) or a_g @ W_e^T (a [M, N], out [M, K])
    for row group g of expert e = used[g]."""
    return products_at(a.data_ptr(), w, out.data_ptr(), sizes, used, transpose_w)


def products_at(pa: int, w: paddle.Tensor, po: int, sizes: list[int], used: list[int], transpose_w: bool) -> list:
    """`_products` for rows at addresses: a decode step's buffers (models/ernie4_5/decode_step.py)
    hand the same products to `run_batch` as the experts' forward does, so they round alike."""
    E, K, N = w.shape
    width_a, width_out = (N, K) if transpose_w else (K, N)
    offs = _offsets(sizes)
    pw = w.data_ptr()
    return [
        (
            pa + offs[g] * width_a * 4,
            pw + e * K * N * 4,
            po + offs[g] * width_out * 4,
            sizes[g],
            width_out,
            width_a,
            N,
            False,
            transpose_w,
        )
        for g, e in enumerate(used)
    ]


def _weight_grad_products(x, dy, dw, sizes: list[int], used: list[int]) -> list[tuple]:
    """dW_e = x_g^T @ dy_g (x [M, K], dy [M, N], dw [E, K, N]) for row group g of expert e = used[g]."""
    K, N = x.shape[1], dy.shape[1]
    offs = _offsets(sizes)
    px, py, pd = x.data_ptr(), dy.data_ptr(), dw.data_ptr()
    return [
        (px + offs[g] * K * 4, py + offs[g] * N * 4, pd + e * K * N * 4, K, N, sizes[g], N, True, False)
        for g, e in enumerate(used)
    ]


def group_matmul(
    a: paddle.Tensor, w: paddle.Tensor, sizes: list[int], used: list[int], transpose_w: bool = False
) -> paddle.Tensor:
    """Row group g of a times w[used[g]] (transposed with `transpose_w`), outside autograd: for
    kernels that own their backward (the emulated FP8 experts). Contiguous float32 CPU tensors."""
    E, K, N = w.shape
    check_groups(a.shape, [[E, N, K] if transpose_w else [E, K, N]], sizes, used, distinct=False)
    out = paddle.empty([a.shape[0], w.shape[1] if transpose_w else w.shape[2]], dtype="float32")
    run_batch(_products(a, w, out, sizes, used, transpose_w))
    return out


def group_weight_grads(
    x: paddle.Tensor, dy: paddle.Tensor, sizes: list[int], used: list[int], num_experts: int
) -> paddle.Tensor:
    """[E, K, N]: x_g^T @ dy_g for each expert's row group, zeros for experts without rows."""
    check_groups(x.shape, [[num_experts, x.shape[1], 0]], sizes, used)
    if dy.ndim != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"group_weight_grads: dy {list(dy.shape)} must have x's {x.shape[0]} rows")
    dw = paddle.zeros([num_experts, x.shape[1], dy.shape[1]], dtype="float32")
    run_batch(_weight_grad_products(x, dy, dw, sizes, used))
    return dw


def _forward(x: paddle.Tensor, ws: list[paddle.Tensor], sizes: list[int], used: list[int], decode: bool) -> list:
    """Each weight's [M, N] output of x's row groups (`_products`), run by `run_products`."""
    outs = [paddle.empty([x.shape[0], w.shape[2]], dtype=x.dtype) for w in ws]
    run_products([q for w, out in zip(ws, outs) for q in _products(x, w, out, sizes, used, False)], decode)
    return outs


class _GroupedMatmul(PyLayer):
    """outs[p] = rows of group g of x @ ws[p][used[g]], for every projection p sharing x."""

    @staticmethod
    def forward(ctx, x, *args):
        *ws, sizes, used = args
        outs = _forward(x, ws, sizes, used, decode=False)
        ctx.save_for_backward(x, *ws)
        ctx.versions = native.versions(x, *ws)
        ctx.groups = (sizes, used)
        ctx.need = (not x.stop_gradient, *(not w.stop_gradient for w in ws))
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *douts):
        x, *ws = ctx.saved_tensor()
        native.check_versions("grouped_matmul", ctx.versions, x, *ws)
        sizes, used = ctx.groups
        douts = [None if d is None else d.contiguous() for d in douts]
        dxs = [paddle.empty(x.shape, dtype=x.dtype) if ctx.need[0] and d is not None else None for d in douts]
        dws = [paddle.zeros(w.shape, dtype=w.dtype) if need else None for w, need in zip(ws, ctx.need[1:])]
        products = []
        for w, dy, dx, dw in zip(ws, douts, dxs, dws):
            if dy is None:
                continue
            if dx is not None:  # dx_g = dy_g @ W_e^T
                products += _products(dy, w, dx, sizes, used, True)
            if dw is not None:
                products += _weight_grad_products(x, dy, dw, sizes, used)
        run_batch(products)
        dx = None
        for d in dxs:  # the sum autograd forms over the projections sharing x
            if d is not None:
                dx = d if dx is None else dx + d
        if dx is None and ctx.need[0]:
            dx = paddle.zeros(x.shape, dtype=x.dtype)
        return (dx, *dws)


def check_groups(
    x: list[int], weights: list[list[int]], sizes: list[int], used: list[int], distinct: bool = True
) -> None:
    """The kernels address memory from these numbers, so they are checked before any call: groups
    covering x's rows exactly, one in-range expert each (distinct where weight gradients are
    written: a repeated expert's would be overwritten, not summed), weights [E, K, N] matching x
    (shapes, as lists)."""
    E = weights[0][0] if weights else 0
    ok = (
        len(x) == 2
        and len(sizes) == len(used)
        and all(s >= 0 for s in sizes)
        and sum(sizes) == x[0]
        and (not distinct or len(set(used)) == len(used))
        and all(0 <= e < E for e in used)
        and all(len(w) == 3 and w[0] == E and w[1] == x[1] for w in weights)
    )
    if not ok:
        raise ValueError(
            f"grouped GEMM: need x [M, K], weights [E, K, N] and one expert in [0, E) per group "
            f"({'distinct, ' if distinct else ''}sizes summing to M); got x {list(x)}, weights "
            f"{[list(w) for w in weights]}, sizes {list(sizes)}, experts {list(used)}"
        )


def grouped_matmuls(
    x: paddle.Tensor, weights: list[paddle.Tensor], sizes: list[int], used: list[int]
) -> list[paddle.Tensor]:
    """x [M, K] in consecutive row groups of `sizes` -> for each weight [E, K, N], group g @ W[used[g]]
    as [M, N]; one batched GEMM each way for all projections and groups (without a gradient, at
    most DECODE_ROWS rows: `run_products`, the small groups on the kn kernel)."""
    check_groups(x.shape, [w.shape for w in weights], sizes, used)
    if decode_sized(x.shape[0]):  # no gradient: the products alone, a few rows' on the kernel
        return _forward(x.contiguous(), weights, sizes, used, decode=True)
    out = _GroupedMatmul.apply(x, *weights, list(sizes), list(used))
    return list(out) if isinstance(out, (tuple, list)) else [out]
