"""Decode-sized products in C (kernels/small_gemm.c): a few rows against a whole float32 weight,
with no gradient to take.

Why: a decode step multiplies a handful of rows by every weight of the model, so it only streams
weights, and MKL 2019's small-M sgemm (Paddle's CPU GEMM) streams them slowly at 1-7 rows. On an AMD
EPYC (2 threads, weights out of cache) a 1-row [1024, 3072] product took ~550 us in MKL and ~460
here (~27 GB/s, what two contiguous streams reach), 2-4 rows ~1000 us against ~500; the dense-1024
tied head ([1, 1024] x [32000, 1024]^T) ~6 ms against ~4.5. A whole dense-1024 decode step
(in-process A/B, medians of 6 x 30 steps): batch 2 and 4 28.6 / 27.3 ms -> 20.0 / 20.2 ms. The
kernels run on Paddle's OpenMP team and fix every output's arithmetic, so a thread count never
changes a bit, and `numpy_kn` / `numpy_nk` below reproduce them exactly.

The projections (`matmul_kn`, nn.Linear's [K, N] weight) take the kernel up to KN_ROWS rows: at 8
MKL's sgemm takes a faster path of its own (batch-8 decode step 27.0 ms with MKL's projections,
30.2 with the kernel; batch 7: 31.8 against 29.1). The tied head (`matmul_nk`, the embedding's
[N, K]) takes it up to NK_ROWS (batch 8: 33.6 -> 30.2 ms); at 16-32 rows MKL's blocked GEMM is as
fast or faster. Anything that needs a gradient, other dtypes or devices, or shapes that are not
multiples of 16 keep Paddle's ops, as does ERNIEKIT_NATIVE_KERNELS=0 or a machine without a C
compiler (the results then differ in the last bits: MKL sums in its own order).
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import paddle
from paddle import _C_ops

from erniekit.nn import native

KN_ROWS = 7
NK_ROWS = 8
PACKED_ROWS = 64  # a packed weight (`pack_weights`) takes the kernel up to this many rows
KN_MIN_BYTES = 1 << 18  # smaller projections (a tiny model's) keep MKL: no gain measured there
THREAD_BYTES = 1 << 18  # a weight under this is one thread's: the team's hand-off costs more
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_F32 = paddle.float32
_CPU = paddle.CPUPlace()
_scratch = threading.local()  # the kn kernel's P1 buffer, one per thread (the engine decodes in its own)


_cached: list = []  # [the kernels' functions | None], filled on first use: the lookup costs more than a decode call


def _kernels():
    if not _cached:
        _cached.append(_lookup())
    return _cached[0]


def _lookup():
    fns = native.functions(
        "small_gemm",
        ("erniekit_small_gemm_kn", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64]),
        ("erniekit_small_gemm_nk", [_P, _P, _P, _I64, _I64, _I64, _I64]),
        ("erniekit_small_gemm_pack", [_P, _P, _I64, _I64]),
        ("erniekit_small_gemm_packed", [_P, _P, _P, _P, _I64, _I64, _I64, _I64]),
        ("erniekit_small_gemm_pack_t", [_P, _P, _I64, _I64]),
        ("erniekit_small_gemm_kn_groups", [_P, _P, _P, _P, _I64, _P, _I64, _I64, _I64]),
        ("erniekit_small_gemm_fast_fma", []),
    )
    if fns is None:
        return None
    fns[6].restype = ctypes.c_int
    if not fns[6]():
        # the kernels' sums are fused multiply-adds; without the instruction libm computes each one
        # (the same bits, 15-20x slower than MKL's GEMM): those CPUs keep Paddle's ops
        native.why_not["small_gemm"] = "this CPU (or compiler) has no fused multiply-add instruction"
        return None
    return fns


def _eligible(x: paddle.Tensor, w: paddle.Tensor, bias: paddle.Tensor | None, max_rows: int) -> bool:
    """The checks both kernels share, cheapest first: this runs before every projection (~1 us).
    Dynamic mode before anything reads a shape: a static program's shapes may hold -1 or tensors."""
    if not (native.cpu_build() and paddle.in_dynamic_mode()):
        return False
    shape = x.shape
    rows = math.prod(shape[:-1])
    return (
        0 < rows <= max_rows
        and shape[-1] % 16 == 0
        and w.ndim == 2
        and (
            not paddle.is_grad_enabled()
            or (x.stop_gradient and w.stop_gradient and (bias is None or bias.stop_gradient))
        )
        and w.is_contiguous()
        and native.dense_cpu_float32(x, w, *(() if bias is None else (bias,)))
        and _kernels() is not None
    )


@native.eager_only  # to_static leaves the checks unconverted: in a program they answer False
def takes_kn(x: paddle.Tensor, w: paddle.Tensor, bias: paddle.Tensor | None) -> bool:
    """Whether x @ w (+ bias) runs in a kernel: CPU float32, no gradient, a weight of KN_MIN_BYTES or
    more, and <= KN_ROWS rows (<= PACKED_ROWS with the weight packed by `pack_weights`)."""
    rows = PACKED_ROWS if _packed_of(w) is not None else KN_ROWS
    return _eligible(x, w, bias, rows) and x.shape[-1] == w.shape[0] and _kn_shape(w)


def _kn_shape(w: paddle.Tensor) -> bool:
    return w.shape[1] % 16 == 0 and 4 * w.shape[0] * w.shape[1] >= KN_MIN_BYTES


def product(w: paddle.Tensor, bias: paddle.Tensor | None, rows: int):
    """A function (x, y) of two buffer addresses computing y [rows, N] = x [rows, K] @ w (+ bias) as
    `matmul_kn` would for a float32 x of that shape under no_grad, or None where `takes_kn` would say
    no (the product then goes to Paddle's GEMM, which sums in its own order). For callers that run a
    step on buffers of their own (models/ernie4_5/decode_step.py)."""
    packed = _packed_of(w)
    if not (0 < rows <= (KN_ROWS if packed is None else PACKED_ROWS) and w.ndim == 2 and w.shape[0] % 16 == 0):
        return None
    if not (native.cpu_build() and _kn_shape(w) and w.is_contiguous() and _kernels() is not None):
        return None
    if not native.dense_cpu_float32(w, *(() if bias is None else (bias,))):
        return None
    return _kn_call(w, bias, packed, rows)


@native.eager_only
def takes_nk(x: paddle.Tensor, w: paddle.Tensor) -> bool:
    """Whether x @ w^T runs in a kernel: CPU float32, no gradient, <= NK_ROWS rows (<= PACKED_ROWS
    with w packed by `pack_weights`)."""
    rows = PACKED_ROWS if _packed_of(w) is not None else NK_ROWS
    return _eligible(x, w, None, rows) and x.shape[-1] == w.shape[1]


def kn_groups(products: list[tuple[int, int, int, int]], K: int, N: int) -> None:
    """y_g [rows_g, N] = x_g [rows_g, K] @ w_g [K, N] by the kn kernel for each (x, w, y, rows) of
    buffer addresses (float32, rows contiguous), in one call: a MoE block's expert groups of a few
    rows (nn/grouped_gemm.py, `run_products`). Each product's bits are `matmul_kn`'s; `kn_takes`
    must hold for every one."""
    if not products:
        return
    x, w, y, rows = (np.array(c, np.int64) for c in zip(*products))
    tmp = _scratch_for(int(rows.sum()) * N)
    p = ctypes.c_void_p
    fn = _kernels()[5]
    fn(*(p(a.ctypes.data) for a in (x, w, y, rows)), len(products), tmp, K, N, native.threads())


def kn_takes(rows: int, K: int, N: int) -> bool:
    """Whether `kn_groups` takes a product of these sizes (the kernels' limits on a weight)."""
    return 0 < rows <= KN_ROWS and K % 16 == 0 and N % 16 == 0 and 4 * K * N >= KN_MIN_BYTES and _kernels() is not None


def _threads(w: paddle.Tensor) -> int:
    return native.threads() if 4 * w.shape[0] * w.shape[1] >= THREAD_BYTES else 1


def _scratch_for(n: int) -> int:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, np.float32)
    return buf.ctypes.data


def matmul_kn(x: paddle.Tensor, w: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """x [..., K] @ w [K, N] (+ bias [N]) -> [..., N] (`takes_kn` must hold)."""
    K, N = w.shape
    x = x.contiguous()
    rows = math.prod(x.shape[:-1])
    y = _C_ops.empty([*x.shape[:-1], N], _F32, _CPU)
    _kn_call(w, bias, _packed_of(w), rows)(x.data_ptr(), y.data_ptr())
    return y


def _kn_call(w: paddle.Tensor, bias: paddle.Tensor | None, packed: paddle.Tensor | None, rows: int):
    """The kernel call of x [rows, K] @ w (+ bias) as a function of x's and y's addresses, through
    w's packed copy when there is one. It holds addresses, not tensors (decode_step.py keeps these
    calls and must not keep a packed copy alive after `unpack_weights`)."""
    K, N = w.shape
    b = None if bias is None else bias.data_ptr()
    if packed is not None:
        fn, p, threads = _kernels()[3], packed.data_ptr(), native.threads()
        return lambda x, y: fn(x, p, b, y, rows, K, N, threads)
    fn, wp, threads = _kernels()[0], w.data_ptr(), _threads(w)
    # the scratch looked up per call: a later, wider product may have replaced (freed) the buffer
    return lambda x, y: fn(x, wp, b, y, _scratch_for(rows * N), rows, K, N, threads)


# weight id -> (the weight, its in-place version when packed, the packed copy); see pack_weights
_PACKED: dict[int, tuple[paddle.Tensor, int, paddle.Tensor]] = {}


def _packed_of(w: paddle.Tensor) -> paddle.Tensor | None:
    """w's packed copy while it is current: one of Paddle's in-place ops on w since (which bump its
    version) drops it. `set_value` and the optimizers' updates do not bump it (Paddle 3.3), so a
    process that trains must `unpack_weights` first; packing is for the server and chat."""
    entry = _PACKED.get(id(w))
    if entry is None or entry[0] is not w:
        return None
    if entry[1] != w._inplace_version():
        del _PACKED[id(w)]
        return None
    return entry[2]


def packed_of(w: paddle.Tensor) -> paddle.Tensor | None:
    """w's packed copy (`pack_weights`) while it is current, else None."""
    return _packed_of(w)


def pack_weights(model) -> int:
    """Keep a packed copy (kernels/small_gemm.c's panels) of every projection of `model` the kernels
    can take, so batches of up to PACKED_ROWS rows decode through the packed kernel; the bytes added.

    Why: at 8-32 rows a projection is bound by how it reads its weight, and panels read in order
    with the accumulators in registers: a [16, 1024] x [1024, 3072] product 1071 -> 699 us, at 8
    rows 1271 -> 448 (AMD EPYC, 2 threads, weights out of cache). The cost is a second copy of
    those weights (and of a tied head's embedding, whose panels hold its transpose), so the server
    and chat take it where memory allows (erniekit/infer/weight_packing.py, `--packed-weights`)."""
    kernels = _kernels()
    return sum(_pack(w, kernels[k], K, N) for w, k, K, N in _pack_plan(model))


def packable_bytes(model) -> int:
    """The bytes `pack_weights(model)` would add (0 where the kernels do not apply)."""
    return sum(4 * K * N for _, _, K, N in _pack_plan(model))


def _pack_plan(model) -> list[tuple[paddle.Tensor, int, int, int]]:
    """(weight, packing kernel's index, K, N) of each weight not yet packed that the kernels take."""
    if _kernels() is None:
        return []
    plan = []
    for layer in model.sublayers():
        w = getattr(layer, "weight", None)
        if not isinstance(layer, paddle.nn.Linear) or w is None or w.dtype != _F32 or w.ndim != 2:
            continue
        K, N = w.shape
        if N % 64 or K % 16 or 4 * K * N < KN_MIN_BYTES or _packed_of(w) is not None:
            continue
        plan.append((w, 2, K, N))
    head = _tied_head(model)
    if head is not None and head.shape[0] % 64 == 0 and head.shape[1] % 16 == 0 and _packed_of(head) is None:
        plan.append((head, 4, head.shape[1], head.shape[0]))  # panels of head^T: [H, V]
    return plan


def _pack(w: paddle.Tensor, pack_fn, K: int, N: int) -> int:
    packed = _C_ops.empty([K * N], _F32, _CPU)
    pack_fn(w.contiguous().data_ptr(), packed.data_ptr(), K, N)
    _PACKED[id(w)] = (w, w._inplace_version(), packed)
    return 4 * K * N


def _tied_head(model) -> paddle.Tensor | None:
    """The [V, H] embedding a tied causal LM's head multiplies by (None for other models)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if not getattr(config, "tie_word_embeddings", False) or inner is None or not hasattr(inner, "embed_tokens"):
        return None
    w = inner.embed_tokens.weight
    return w if w.dtype == _F32 and w.ndim == 2 else None


def unpack_weights(model) -> None:
    """Drop `model`'s packed copies (pack_weights)."""
    for p in model.parameters():
        _PACKED.pop(id(p), None)


def matmul_nk(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] (`takes_nk` must hold)."""
    N, K = w.shape
    x = x.contiguous()
    y = _C_ops.empty([*x.shape[:-1], N], _F32, _CPU)
    rows = math.prod(x.shape[:-1])
    packed = _packed_of(w)
    if packed is not None:  # panels of w^T: kn's arithmetic, not the 16 lanes (docs/deploy.md)
        _kernels()[3](x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), rows, K, N, native.threads())
        return y
    _kernels()[1](x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, K, N, _threads(w))
    return y


def numpy_kn(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The kn kernel's arithmetic in numpy (a reference: one fused multiply-add pass per k)."""
    x, w = x.reshape(-1, w.shape[0]).astype(np.float32), w.astype(np.float32)
    halves = []
    for k0, k1 in ((0, w.shape[0] // 2), (w.shape[0] // 2, w.shape[0])):
        acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
        for k in range(k0, k1):
            acc = native.fma32(x[:, k : k + 1], w[k], acc)
        halves.append(acc)
    y = halves[0] + halves[1]
    return y if bias is None else y + bias.astype(np.float32)


def numpy_nk(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The nk kernel's arithmetic in numpy (a reference)."""
    x = x.reshape(-1, w.shape[1]).astype(np.float32)
    return native.sum16(x[:, None, :] * w.astype(np.float32)[None, :, :])
