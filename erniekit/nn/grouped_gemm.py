"""Grouped GEMM of the MoE experts on CPU: one MKL `cblas_sgemm_batch` call for every expert group.

Paddle has no grouped GEMM on CPU, so StackedExperts ran one eager matmul per expert, wrapped in a
split of the rows, an unbind of the weights and a concat of the outputs, and autograd ran the
mirror image of all of it. Paddle's CPU wheel ships MKL (paddle/libs/libmklml_intel.so), whose
batched GEMM takes every group in one call and runs the groups over its threads; the per-group
products are MKL's sgemm as Paddle's matmul calls it, so the bits are the same (tests check them).
Without that library (other wheels, other CPUs) `usable()` is False and the eager loop runs.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import paddle
from paddle.autograd import PyLayer

from erniekit.nn import native

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
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


def usable(x: paddle.Tensor, weights: list[paddle.Tensor]) -> bool:
    """Float32 dense CPU tensors in dynamic mode, contiguous, and MKL's batched GEMM at hand."""
    return (
        os.environ.get("ERNIEKIT_NATIVE_KERNELS", "1") != "0"
        and native.dense_cpu_float32(x, *weights)
        and all(t.is_contiguous() for t in (x, *weights))
        and _mkl() is not None
    )


def _batch(products: list[tuple[int, int, int, int, int, int, int, bool, bool]]) -> None:
    """One cblas_sgemm_batch over (A, B, C, m, n, k, ldb, trans_a, trans_b) products, C = op(A) op(B),
    row-major with lda / ldc implied by the transposes (A [m, k] or [k, m], C [m, n])."""
    single = [q for q in products if min(q[3:6]) == 1]
    if single:  # MKL's batch computes a 1-row product with other bits than its own sgemm (Paddle's)
        products = [q for q in products if min(q[3:6]) > 1]
        for q in single:
            _batch_call([q])
    _batch_call(products)


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


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *np.cumsum(sizes).tolist()]


class _GroupedMatmul(PyLayer):
    """outs[p] = rows of group g of x @ ws[p][used[g]], for every projection p sharing x."""

    @staticmethod
    def forward(ctx, x, *args):
        *ws, sizes, used = args
        M, K = x.shape
        offs = _offsets(sizes)
        outs, products = [], []
        for w in ws:
            N = w.shape[2]
            out = paddle.empty([M, N], dtype=x.dtype)
            for g, e in enumerate(used):
                a = x.data_ptr() + offs[g] * K * 4
                products.append(
                    (a, w.data_ptr() + e * K * N * 4, out.data_ptr() + offs[g] * N * 4, sizes[g], N, K, N, False, False)
                )
            outs.append(out)
        _batch(products)
        ctx.save_for_backward(x, *ws)
        ctx.versions = native.versions(x, *ws)
        ctx.groups = (sizes, used, offs)
        ctx.need = (not x.stop_gradient, *(not w.stop_gradient for w in ws))
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *douts):
        x, *ws = ctx.saved_tensor()
        native.check_versions("grouped_matmul", ctx.versions, x, *ws)
        sizes, used, offs = ctx.groups
        M, K = x.shape
        douts = [d.contiguous() for d in douts]
        dxs = [paddle.empty([M, K], dtype=x.dtype) for _ in ws] if ctx.need[0] else []
        dws = [paddle.zeros(w.shape, dtype=w.dtype) if need else None for w, need in zip(ws, ctx.need[1:])]
        products = []
        for p, (w, dy) in enumerate(zip(ws, douts)):
            N = w.shape[2]
            for g, e in enumerate(used):
                rows_x, rows_y = x.data_ptr() + offs[g] * K * 4, dy.data_ptr() + offs[g] * N * 4
                if dxs:  # dx_g = dy_g @ W_e^T
                    products.append(
                        (
                            rows_y,
                            w.data_ptr() + e * K * N * 4,
                            dxs[p].data_ptr() + offs[g] * K * 4,
                            sizes[g],
                            K,
                            N,
                            N,
                            False,
                            True,
                        )
                    )
                if dws[p] is not None:  # dW_e = x_g^T @ dy_g
                    products.append((rows_x, rows_y, dws[p].data_ptr() + e * K * N * 4, K, N, sizes[g], N, True, False))
        _batch(products)
        dx = None
        if dxs:
            dx = dxs[0]
            for d in dxs[1:]:  # the sum autograd forms over the projections sharing x
                dx = dx + d
        return (dx, *dws)


def grouped_matmuls(
    x: paddle.Tensor, weights: list[paddle.Tensor], sizes: list[int], used: list[int]
) -> list[paddle.Tensor]:
    """x [M, K] in consecutive row groups of `sizes` -> for each weight [E, K, N], group g @ W[used[g]]
    as [M, N]; one batched GEMM each way for all projections and groups."""
    out = _GroupedMatmul.apply(x, *weights, list(sizes), list(used))
    return list(out) if isinstance(out, (tuple, list)) else [out]
