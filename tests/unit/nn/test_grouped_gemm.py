"""The experts' grouped GEMM through MKL's batched sgemm: the eager per-expert loop's results (split,
matmul per expert, concat) to float32 rounding, forward and every gradient, in the MoE block too,
and bad groups refused before any memory is touched."""

import numpy as np
import paddle
import pytest

from erniekit.nn import grouped_gemm, native, small_gemm
from erniekit.nn.moe import StackedExperts
from erniekit.nn.rows import concat_rows, split_rows

pytestmark = pytest.mark.skipif(
    grouped_gemm._mkl() is None or not native.kernels_enabled(),
    reason="no MKL batched GEMM in this Paddle wheel, or ERNIEKIT_NATIVE_KERNELS=0",
)


def _loop(x, ws, sizes, used):
    xs = split_rows(x, sizes)
    return [concat_rows([paddle.matmul(g, paddle.unbind(w)[e]) for g, e in zip(xs, used)]) for w in ws]


def _leaves(seed, M, E, K, Ns):
    rng = np.random.default_rng(seed)
    x = paddle.to_tensor(rng.standard_normal((M, K), dtype=np.float32), stop_gradient=False)
    ws = [paddle.to_tensor(rng.standard_normal((E, K, n), dtype=np.float32), stop_gradient=False) for n in Ns]
    dys = [rng.standard_normal((M, n), dtype=np.float32) for n in Ns]
    return x, ws, dys


def _run(fn, x, ws, dys, sizes, used):
    outs = fn(x, ws, sizes, used)
    paddle.add_n([(o * paddle.to_tensor(d)).sum() for o, d in zip(outs, dys)]).backward()
    got = [o.numpy() for o in outs], x.grad.numpy(), [w.grad.numpy() for w in ws]
    x.clear_gradient()
    for w in ws:
        w.clear_gradient()
    return got


@pytest.mark.parametrize(
    "sizes, used, Ns",
    [
        ([5, 17, 1, 40], [0, 2, 3, 5], [24, 24]),  # gate and up sharing x; experts 1 and 4 get no token
        ([64], [3], [16]),  # one group (no split in the loop)
        ([3, 9, 2, 7, 11, 2], [0, 1, 2, 3, 4, 5], [8]),  # every expert used, the down projection's shape
    ],
)
def test_grouped_matmuls_equal_the_per_expert_loop(sizes, used, Ns):
    """To float32 rounding: MKL picks its kernels per call (shapes, threads), so a group may round
    differently in the batch than alone; most values are the same bits."""
    x, ws, dys = _leaves(0, sum(sizes), 6, 32, Ns)
    want = _run(_loop, x, ws, dys, sizes, used)
    got = _run(grouped_gemm.grouped_matmuls, x, ws, dys, sizes, used)
    for a, b in zip([*got[0], got[1], *got[2]], [*want[0], want[1], *want[2]]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    unused = [e for e in range(6) if e not in used]
    assert all(not g[e].any() for g in got[2] for e in unused)  # an expert without tokens: zero gradient


def test_frozen_weights_get_no_gradient_and_x_still_does():
    x, ws, dys = _leaves(1, 12, 3, 8, [4])
    ws[0].stop_gradient = True
    y = grouped_gemm.grouped_matmuls(x, ws, [5, 7], [0, 2])[0]
    (y * paddle.to_tensor(dys[0])).sum().backward()
    assert ws[0].grad is None and x.grad is not None
    w = ws[0].numpy()
    want = np.concatenate([dys[0][:5] @ w[0].T, dys[0][5:] @ w[2].T])
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_an_input_changed_in_place_after_the_forward_is_refused():
    x, ws, _ = _leaves(2, 6, 2, 4, [4])
    y = grouped_gemm.grouped_matmuls(x, ws, [6], [1])[0]
    with paddle.no_grad():
        ws[0].scale_(2.0)
    with pytest.raises((RuntimeError, OSError), match="grouped_matmul: an input was modified in place"):
        y.sum().backward()


def test_experts_layer_takes_it_and_gives_the_loops_result(monkeypatch):
    """StackedExperts through the batched GEMM and with it unavailable (the eager loop)."""
    paddle.seed(0)
    layer = StackedExperts(num_experts=4, hidden_size=16, intermediate_size=8)
    x = paddle.randn([20, 16])
    x.stop_gradient = False
    idx = paddle.to_tensor(np.random.default_rng(0).integers(0, 3, size=(20, 2)))  # expert 3 idle
    wt = paddle.full([20, 2], 0.5)

    def run():
        y = layer(x, idx, wt)
        y.sum().backward()
        got = [y.numpy(), x.grad.numpy(), *(p.grad.numpy() for p in layer.parameters())]
        layer.clear_gradients()
        x.clear_gradient()
        return got

    calls = []
    real = grouped_gemm.grouped_matmuls
    monkeypatch.setattr(grouped_gemm, "grouped_matmuls", lambda *a: calls.append(1) or real(*a))
    fast = run()
    assert len(calls) == 2  # gate + up in one call, down in another
    monkeypatch.setattr(grouped_gemm, "usable", lambda *a: False)
    slow = run()
    assert len(calls) == 2
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "sizes, used, match",
    [
        ([5, 6], [0, 1], "sizes summing to M"),  # 11 rows for 12
        ([4, 8], [0, 9], r"experts \[0, 9\]"),  # expert out of range
        ([4, 8], [2, 2], "distinct"),  # a repeated expert would overwrite its own weight gradient
        ([12], [0, 1], "one expert"),
    ],
)
def test_groups_that_do_not_fit_are_refused_before_any_call(sizes, used, match):
    x, ws, _ = _leaves(3, 12, 3, 8, [4])
    with pytest.raises(ValueError, match=match):
        grouped_gemm.grouped_matmuls(x, ws, sizes, used)
    with pytest.raises(ValueError, match="weights"):
        grouped_gemm.grouped_matmuls(x[:, :4], ws, [12], [0])  # K does not match


def test_the_no_autograd_helpers_handle_empty_and_repeated_groups():
    """group_matmul (the FP8 experts' forward and dx) allows an empty group and a repeated expert;
    group_weight_grads leaves experts without rows at zero."""
    rng = np.random.default_rng(4)
    a = paddle.to_tensor(rng.standard_normal((9, 8), dtype=np.float32))
    w = paddle.to_tensor(rng.standard_normal((3, 8, 5), dtype=np.float32))
    y = grouped_gemm.group_matmul(a, w, [4, 0, 5], [1, 0, 1]).numpy()
    np.testing.assert_allclose(y, a.numpy() @ w.numpy()[1], rtol=1e-5, atol=1e-5)
    dy = rng.standard_normal((9, 5), dtype=np.float32)
    back = grouped_gemm.group_matmul(paddle.to_tensor(dy), w, [2, 7], [2, 0], transpose_w=True).numpy()
    np.testing.assert_allclose(back[:2], dy[:2] @ w.numpy()[2].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(back[2:], dy[2:] @ w.numpy()[0].T, rtol=1e-5, atol=1e-5)
    dw = grouped_gemm.group_weight_grads(a, paddle.to_tensor(y), [4, 5], [2, 0], 3).numpy()
    np.testing.assert_allclose(dw[2], a.numpy()[:4].T @ y[:4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw[0], a.numpy()[4:].T @ y[4:], rtol=1e-5, atol=1e-5)
    assert not dw[1].any()


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_into_adds_a_product_into_its_output_in_place(trans_a, trans_b, beta):
    if grouped_gemm._mkl() is None:
        pytest.skip(native.why_not.get("grouped_gemm", "no MKL"))
    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 5) if trans_a else (5, 7)).astype(np.float32)
    b = rng.standard_normal((3, 7) if trans_b else (7, 3)).astype(np.float32)
    c = rng.standard_normal((5, 3)).astype(np.float32)
    out = paddle.to_tensor(c if beta else np.full_like(c, np.nan))  # beta 0 never reads the output
    where = out.data_ptr()
    grouped_gemm.gemm_into(paddle.to_tensor(a), paddle.to_tensor(b), out, trans_a, trans_b, beta)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b) + (beta * c if beta else 0.0)
    assert out.data_ptr() == where
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"gemm_into: \[5, 7\] x \[5, 3\]"):
        grouped_gemm.gemm_into(paddle.to_tensor(a if not trans_a else a.T), paddle.to_tensor(c), out, False, False, 0.0)


@pytest.mark.parametrize("K,N", [(64, 128), (128, 384), (384, 128), (100, 36)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_call_gives_paddles_linear_bits(K, N, bias):
    """The decode step's stand-in for a product Paddle's GEMM takes (a tiny model's projections, more
    rows than the kernels take): the bits of `_C_ops.linear` on the layer's [rows, 1, K] input, at
    1-70 rows, with and without a bias (one rounding after the product)."""
    from paddle import _C_ops

    from erniekit.models.ernie4_5.decode_step import _aligned

    rng = np.random.default_rng(K + N)
    w = paddle.to_tensor(rng.standard_normal((K, N), dtype=np.float32))
    b = paddle.to_tensor(rng.standard_normal(N, dtype=np.float32)) if bias else None
    for rows in (1, 2, 5, 8, 17, 64, 70):
        x, y = _aligned((rows, K)), _aligned((rows, N))
        x[:] = rng.standard_normal((rows, K))
        grouped_gemm.linear_call(w, b, rows)(x.ctypes.data, y.ctypes.data)
        with paddle.no_grad():
            want = _C_ops.linear(paddle.to_tensor(x).reshape([rows, 1, K]), w, b).numpy().reshape(rows, N)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def test_linear_call_refuses_what_it_cannot_reproduce():
    w = paddle.randn([16, 8])
    assert grouped_gemm.linear_call(w.astype("float64"), None, 1) is None
    assert grouped_gemm.linear_call(w, paddle.randn([4]), 1) is None  # a bias of another width
    assert grouped_gemm.linear_call(w, None, 0) is None
    assert grouped_gemm.linear_call(w.reshape([2, 8, 8]), None, 1) is None
    assert grouped_gemm.linear_call(w, paddle.randn([8]), 3) is not None


def _bits(a) -> np.ndarray:
    return np.asarray(a.numpy() if hasattr(a, "numpy") else a).view(np.uint32)


def _mkl_products(x, ws, sizes, used):
    """The MKL batch's outputs (what a gradient's forward computes)."""
    outs = [paddle.empty([x.shape[0], w.shape[2]]) for w in ws]
    grouped_gemm.run_batch([q for w, o in zip(ws, outs) for q in grouped_gemm._products(x, w, o, sizes, used, False)])
    return outs


@pytest.mark.skipif(small_gemm._kernels() is None, reason="no C kernels here")
def test_a_decode_steps_small_groups_take_the_kn_kernel_and_larger_ones_mkl(monkeypatch):
    """Without a gradient and with at most DECODE_ROWS rows, every group of at most KN_ROWS rows is
    matmul_kn's sum (numpy_kn's bits) at any thread count; a larger group, a gradient or more rows
    keep MKL's batch (a gradient's forward: training and RL log-probabilities)."""
    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", 0)
    sizes, used = [1, 3, 7, 8, 2], [4, 0, 2, 1, 5]  # 21 rows; the 8-row group stays MKL's
    rng = np.random.default_rng(3)
    x = paddle.to_tensor(rng.standard_normal((21, 96), dtype=np.float32))
    ws = [paddle.to_tensor(rng.standard_normal((6, 96, n), dtype=np.float32)) for n in (160, 160)]
    mkl = [_bits(o) for o in _mkl_products(x, ws, sizes, used)]
    offs = np.cumsum([0, *sizes])
    big = [i for i, s in enumerate(sizes) if s > small_gemm.KN_ROWS]  # their batch alone, as run_products calls it
    rows_big = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in big])
    alone = _mkl_products(x[rows_big], ws, [sizes[i] for i in big], [used[i] for i in big])
    for m, a in zip(mkl, alone):
        at = 0
        for i in big:
            m[offs[i] : offs[i + 1]] = _bits(a)[at : at + sizes[i]]
            at += sizes[i]
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "threads", lambda t=threads: t)
        with paddle.no_grad():
            assert grouped_gemm.decode_sized(21)
            got = [_bits(o) for o in grouped_gemm.grouped_matmuls(x, ws, sizes, used)]
        for w, g, m in zip(ws, got, mkl):
            for i, (s, e) in enumerate(zip(sizes, used)):
                rows = slice(offs[i], offs[i + 1])
                want = m[rows] if s > small_gemm.KN_ROWS else _bits(small_gemm.numpy_kn(x.numpy()[rows], w.numpy()[e]))
                np.testing.assert_array_equal(g[rows], want, err_msg=f"group {i}, {threads} threads")
    x.stop_gradient = False
    whole = [_bits(o) for o in _mkl_products(x, ws, sizes, used)]
    for o, m in zip(grouped_gemm.grouped_matmuls(x, ws, sizes, used), whole):  # a gradient: MKL's batch
        np.testing.assert_array_equal(_bits(o), m)
    assert not grouped_gemm.decode_sized(21)
    with paddle.no_grad():
        assert not grouped_gemm.decode_sized(grouped_gemm.DECODE_ROWS + 1)


@pytest.mark.skipif(small_gemm._kernels() is None, reason="no C kernels here")
def test_run_products_leaves_transposed_and_strided_products_to_mkl(monkeypatch):
    """Only plain x @ W products of a contiguous weight go to the kernel: a transposed one (dx's) is
    MKL's whatever its rows."""
    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", 0)
    rng = np.random.default_rng(4)
    dy = paddle.to_tensor(rng.standard_normal((3, 64), dtype=np.float32))
    w = paddle.to_tensor(rng.standard_normal((2, 32, 64), dtype=np.float32))
    want, got = paddle.empty([3, 32]), paddle.empty([3, 32])
    grouped_gemm.run_batch(grouped_gemm._products(dy, w, want, [3], [1], True))
    grouped_gemm.run_products(grouped_gemm._products(dy, w, got, [3], [1], True), decode=True)
    np.testing.assert_array_equal(_bits(got), _bits(want))
