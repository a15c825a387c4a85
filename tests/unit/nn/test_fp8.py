"""Block-scaled FP8 matmul (erniekit/nn/fp8.py) against a naive numpy reference.

The reference loops over tiles explicitly and rounds to e4m3 with its own numpy implementation
(round half to even on the e4m3 grid), so it shares no code with the module under test.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from erniekit.errors import ConfigError
from erniekit.nn import fp8 as fp8_mod
from erniekit.nn.fp8 import (
    FP8ShapeError,
    dequantize_blockwise,
    dequantize_rowwise,
    e4m3_relative_bound,
    e4m3_subnormal_half_spacing,
    fp8_backend,
    fp8_matmul,
    quantize_blockwise,
    quantize_rowwise,
)

F32 = np.float32


# ---- naive reference -------------------------------------------------------------------------
def round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float32 values (|v| <= 448) to the nearest e4m3fn value, ties to even."""
    v = v.astype(np.float64)
    a = np.abs(v)
    exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    spacing = 2.0 ** (np.maximum(exp, -6) - 3)  # 3 mantissa bits; subnormals share 2^-6's spacing
    r = np.round(v / spacing) * spacing  # np.round: half to even; v / spacing is exact
    return np.clip(r, -448, 448).astype(F32)


def ref_quant(x: np.ndarray, rows: int, cols: int):
    """(dequantised x, q values, scale per tile, tile shape) with an explicit loop over tiles."""
    R, C = x.shape
    deq, q = np.zeros_like(x), np.zeros_like(x)
    scale = np.zeros((R // rows, C // cols), F32)
    for i in range(R // rows):
        for j in range(C // cols):
            sl = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            amax = np.abs(x[sl]).max()
            s = F32(amax) / F32(448.0) if amax > 0 else F32(2.0**-126)
            q[sl] = round_e4m3(x[sl] / s)
            deq[sl] = q[sl] * s
            scale[i, j] = s
    return deq, q, scale


def pad_rows(x: np.ndarray, block: int) -> np.ndarray:
    pad = -x.shape[0] % block
    return np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)]) if pad else x


def ref_forward(x, w, block):
    """y = sum over K blocks of (q_x . q_w) * s_x * s_w, literally."""
    _, qx, sx = ref_quant(x, 1, block)
    _, qw, sw = ref_quant(w, block, block)
    M, K = x.shape
    N = w.shape[1]
    y = np.zeros((M, N), np.float64)
    for kb in range(K // block):
        ks = slice(kb * block, (kb + 1) * block)
        for nb in range(N // block):
            ns = slice(nb * block, (nb + 1) * block)
            part = qx[:, ks].astype(np.float64) @ qw[ks, ns].astype(np.float64)
            y[:, ns] += part * sx[:, kb : kb + 1] * sw[kb, nb]
    return y


def ref_backward(x, w, g, block):
    """dX = Q(dY, 1 x b along N) @ Q(W, b x b)^T; dW = Q(X, b x 1 along M)^T @ Q(dY, b x 1 along M)."""
    dx = ref_quant(g, 1, block)[0].astype(np.float64) @ ref_quant(w, block, block)[0].astype(np.float64).T
    xq = ref_quant(pad_rows(x, block), block, 1)[0].astype(np.float64)
    gq = ref_quant(pad_rows(g, block), block, 1)[0].astype(np.float64)
    return dx, xq.T @ gq


def rel(a, ref) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def varied(rng, shape, tile):
    """Normal data with each tile scaled by 10^U(-3, 3): block magnitudes spanning 6 decades."""
    x = rng.standard_normal(shape)
    r, c = tile
    mag = 10.0 ** rng.uniform(-3, 3, (shape[0] // r, shape[1] // c))
    return (x * np.repeat(np.repeat(mag, r, 0), c, 1)).astype(F32)


def run(x_np, w_np, g_np, block, **kw):
    x = paddle.to_tensor(x_np, stop_gradient=False)
    w = paddle.to_tensor(w_np, stop_gradient=False)
    y = fp8_matmul(x, w, block=block, **kw)
    y.backward(paddle.to_tensor(g_np))
    return y.numpy(), x.grad.numpy(), w.grad.numpy()


# ---- the platform facts the emulation relies on --------------------------------------------------
def test_paddle_cast_rounds_to_nearest_even_and_matches_reference():
    ties = np.array([1.0625, 1.1875, 3 * 2.0**-10, 2.0**-10, 1.0625 + 2**-20, 448.0, 463.0, 2.0**-9], F32)
    got = paddle.to_tensor(ties).astype(paddle.float8_e4m3fn).astype("float32").numpy()
    np.testing.assert_array_equal(got, [1.0, 1.25, 2.0**-8, 0.0, 1.125, 448.0, 448.0, 2.0**-9])
    v = np.random.default_rng(0).standard_normal(20000) * 10.0 ** np.random.default_rng(1).uniform(-4, 2.6, 20000)
    v = np.clip(v, -448, 448).astype(F32)
    cast = paddle.to_tensor(v).astype(paddle.float8_e4m3fn).astype("float32").numpy()
    np.testing.assert_array_equal(cast, round_e4m3(v))


# ---- quantise / dequantise ----------------------------------------------------------------------
def _check_tiles(x, q, s, deq, rows, cols):
    ref_deq, ref_q, ref_s = ref_quant(x, rows, cols)
    np.testing.assert_array_equal(s, ref_s)  # scale == amax / 448 exactly, per tile
    np.testing.assert_array_equal(q, ref_q)  # round-to-nearest-even on the e4m3 grid
    np.testing.assert_array_equal(deq, ref_deq)
    s_full = np.repeat(np.repeat(s, rows, 0), cols, 1)
    bound = np.maximum(np.abs(x) * e4m3_relative_bound(), s_full * 2.0**-10) + np.abs(x) * 2.0**-22
    assert np.all(np.abs(deq - x) <= bound)
    assert np.abs(deq - x).max() > 0  # something was actually rounded
    for i in range(x.shape[0] // rows):  # each tile's largest element maps to exactly +-448
        for j in range(x.shape[1] // cols):
            t = q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            assert np.abs(t).max() == 448.0


@pytest.mark.parametrize("block", [128, 32])
def test_rowwise_quantisation_bound_scales_and_saturation(block):
    x = varied(np.random.default_rng(block), (48, 256), (1, block))
    q, s = quantize_rowwise(paddle.to_tensor(x), block)
    assert q.dtype == paddle.float8_e4m3fn and s.shape == [48, 256 // block]
    deq = dequantize_rowwise(q, s, block).numpy()
    _check_tiles(x, q.astype("float32").numpy(), s.numpy(), deq, 1, block)


@pytest.mark.parametrize("block", [128, 32])
def test_blockwise_quantisation_bound_scales_and_saturation(block):
    x = varied(np.random.default_rng(block + 1), (256, 128), (block, block))
    q, s = quantize_blockwise(paddle.to_tensor(x), block)
    assert q.dtype == paddle.float8_e4m3fn and s.shape == [256 // block, 128 // block]
    deq = dequantize_blockwise(q, s, block).numpy()
    _check_tiles(x, q.astype("float32").numpy(), s.numpy(), deq, block, block)


def test_e4m3_bounds():
    assert e4m3_relative_bound() == 2.0**-4 and e4m3_subnormal_half_spacing() == 2.0**-10


# ---- the GEMMs ----------------------------------------------------------------------------------
CASES = [(37, 256, 128, 128), (300, 128, 256, 32), (64, 128, 128, 128)]


@pytest.mark.parametrize("M,K,N,block", CASES)
def test_forward_and_backward_match_naive_reference(M, K, N, block):
    rng = np.random.default_rng(M)
    x, w, g = varied(rng, (M, K), (1, block)), varied(rng, (K, N), (block, block)), varied(rng, (M, N), (1, 1))
    y, dx, dw = run(x, w, g, block)
    ref_dx, ref_dw = ref_backward(x, w, g, block)
    assert rel(y, ref_forward(x, w, block)) < 1e-6
    assert rel(dx, ref_dx) < 1e-6
    assert rel(dw, ref_dw) < 1e-6


@pytest.mark.parametrize("M,K,N,block", CASES)
def test_close_to_fp32_but_really_quantised(M, K, N, block):
    """Measured ~3.6% relative Frobenius error on y, dX and dW (docs/fp8.md); > 1% proves no fp32 fallback."""
    rng = np.random.default_rng(M + 1)
    x, w, g = (rng.standard_normal(s).astype(F32) for s in ((M, K), (K, N), (M, N)))
    y, dx, dw = run(x, w, g, block)
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), g.astype(np.float64)
    for got, ref in ((y, x64 @ w64), (dx, g64 @ w64.T), (dw, x64.T @ g64)):
        assert 0.01 < rel(got, ref) < 0.05


def test_bf16_masters_give_bf16_results():
    rng = np.random.default_rng(5)
    x_np, w_np, g_np = (rng.standard_normal(s).astype(F32) for s in ((40, 128), (128, 128), (40, 128)))
    x = paddle.to_tensor(x_np).astype("bfloat16")
    w = paddle.to_tensor(w_np).astype("bfloat16")
    x.stop_gradient = w.stop_gradient = False
    y = fp8_matmul(x, w)
    y.backward(paddle.to_tensor(g_np).astype("bfloat16"))
    assert y.dtype == x.grad.dtype == w.grad.dtype == paddle.bfloat16
    assert rel(y.astype("float32").numpy(), x_np.astype(np.float64) @ w_np) < 0.05
    assert rel(w.grad.astype("float32").numpy(), x_np.T.astype(np.float64) @ g_np) < 0.05


def test_leading_dims_and_empty_expert():
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((2, 5, 128)).astype(F32), rng.standard_normal((128, 128)).astype(F32)
    y3 = fp8_matmul(paddle.to_tensor(x), paddle.to_tensor(w)).numpy()
    y2 = fp8_matmul(paddle.to_tensor(x.reshape(10, 128)), paddle.to_tensor(w)).numpy()
    np.testing.assert_array_equal(y3.reshape(10, 128), y2)
    y, dx, dw = run(np.zeros((0, 128), F32), w, np.zeros((0, 128), F32), 128)  # expert got no tokens
    assert y.shape == (0, 128) and dx.shape == (0, 128) and np.all(dw == 0)


def test_weights_are_requantised_every_call():
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((16, 128)).astype(F32), rng.standard_normal((128, 128)).astype(F32)
    wt = paddle.to_tensor(w)
    fp8_matmul(paddle.to_tensor(x), wt)
    wt.set_value(paddle.to_tensor(w * 3.0))  # an optimizer step, in place
    got = fp8_matmul(paddle.to_tensor(x), wt).numpy()
    assert rel(got, ref_forward(x, w * 3.0, 128)) < 1e-6


# ---- edge cases and errors ----------------------------------------------------------------------
@pytest.mark.parametrize("K,N", [(100, 128), (128, 200)])
def test_dims_not_multiple_of_block_raise(K, N):
    x, w = paddle.randn([4, K]), paddle.randn([K, N])
    with pytest.raises(ValueError, match=rf"{K if K % 128 else N}.*128.*fp8_block_size"):
        fp8_matmul(x, w, block=128)


def test_gpu_backend_refuses_other_block_sizes():
    with pytest.raises(FP8ShapeError, match="64"):
        fp8_matmul(paddle.randn([4, 128]), paddle.randn([128, 128]), block=64, backend="gpu")


def test_zeros_and_zero_blocks_stay_finite_and_zero():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((37, 64)).astype(F32)
    x[:, :32] = 0.0  # a zero 1x32 tile in every row
    x[5] = 0.0
    w = rng.standard_normal((64, 64)).astype(F32)
    w[:32, 32:] = 0.0  # a zero 32x32 tile
    y, dx, dw = run(x, w, np.ones((37, 64), F32), 32)
    assert all(np.isfinite(t).all() for t in (y, dx, dw))
    assert np.all(y[5] == 0)
    q, s = quantize_rowwise(paddle.to_tensor(x), 32)  # zero tile: finite positive scale, q = 0 (not 0/0)
    assert np.all(q.astype("float32").numpy()[:, :32] == 0) and np.all(s.numpy()[:, 0] == 2.0**-126)
    assert np.all(dequantize_rowwise(q, s, 32).numpy()[:, :32] == 0)
    qw, sw = quantize_blockwise(paddle.to_tensor(w), 32)
    assert np.all(qw.astype("float32").numpy()[:32, 32:] == 0) and sw.numpy()[0, 1] == 2.0**-126
    y0, dx0, dw0 = run(np.zeros((8, 64), F32), np.zeros((64, 64), F32), np.zeros((8, 64), F32), 32)
    assert not (y0.any() or dx0.any() or dw0.any())


def test_nan_is_not_hidden_by_the_cast():
    """Paddle's CPU cast turns NaN into 448; the tile scale must carry the NaN through."""
    x = np.ones((4, 128), F32)
    x[1, 3] = np.nan
    y = fp8_matmul(paddle.to_tensor(x), paddle.ones([128, 128])).numpy()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2, 3]]).all()


def test_frozen_weight_gets_no_grad_and_input_does():
    x = paddle.randn([37, 128])
    w = paddle.randn([128, 128])
    x.stop_gradient, w.stop_gradient = False, True
    fp8_matmul(x, w).sum().backward()
    assert x.grad is not None and w.grad is None
    x2, w2 = paddle.randn([37, 128]), paddle.randn([128, 128])
    w2.stop_gradient = False
    fp8_matmul(x2, w2).sum().backward()
    assert w2.grad is not None and x2.grad is None


# ---- backend selection --------------------------------------------------------------------------
def test_cpu_uses_emulation_and_never_touches_the_gpu_op(monkeypatch):
    assert fp8_backend() == "emulated"

    def boom():
        raise AssertionError("GPU op probed on CPU")

    monkeypatch.setattr(fp8_mod, "_gpu_gemm_op", boom)
    fp8_matmul(paddle.randn([4, 128]), paddle.randn([128, 128]))


@pytest.mark.parametrize(
    "cap,has_op,want",
    [((9, 0), True, "gpu"), ((8, 9), True, "gpu"), ((8, 6), True, "emulated"), ((9, 0), False, "emulated")],
)
def test_backend_selection_rules(monkeypatch, cap, has_op, want):
    monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: True)  # what cuda_visible reads
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(fp8_mod, "_gpu_gemm_op", lambda: (lambda *a, **k: None) if has_op else None)
    assert fp8_backend() == want


def _fake_kernel(a, a_scale, b, b_scale, out_dtype, is_a_1d_scaled, is_b_1d_scaled):
    """Paddle's fp8_gemm_blockwise contract, as in Paddle's own unit test: a [R, K] @ b [S, K]^T;
    a 1-D-scaled operand has scales [K/128, R], a 2-D-scaled one [R/128, K/128]."""

    def deq(q, s, one_d):
        q = q.astype("float32").numpy().astype(np.float64)
        s = s.numpy()
        full = np.repeat(s.T, 128, 1) if one_d else np.repeat(np.repeat(s, 128, 0), 128, 1)
        return q * full

    assert a.dtype == b.dtype == paddle.float8_e4m3fn and out_dtype == paddle.float32
    return paddle.to_tensor((deq(a, a_scale, is_a_1d_scaled) @ deq(b, b_scale, is_b_1d_scaled).T).astype(F32))


def test_gpu_path_plumbing_agrees_with_emulation(monkeypatch):
    """The GPU branch (layouts, transposes, scale layouts) against the kernel's documented contract."""
    monkeypatch.setattr(fp8_mod, "_gpu_gemm_op", lambda: _fake_kernel)
    rng = np.random.default_rng(9)
    x, w, g = (rng.standard_normal(s).astype(F32) for s in ((37, 256), (256, 128), (37, 128)))
    gpu = run(x, w, g, 128, backend="gpu")
    emu = run(x, w, g, 128, backend="emulated")
    for a, b in zip(gpu, emu):
        assert rel(a, b.astype(np.float64)) < 1e-6


# ---- e5m2 gradient tiles (the "hybrid" recipe) ----------------------------------------------------
def _ref_quant_fmt(x: np.ndarray, rows: int, cols: int, dtype, fmax: float) -> np.ndarray:
    """Dequantised x with one scale per tile (loop over tiles); rounding by Paddle's cast."""
    out = np.zeros_like(x)
    for i in range(x.shape[0] // rows):
        for j in range(x.shape[1] // cols):
            sl = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            amax = np.abs(x[sl]).max()
            s = F32(amax) / F32(fmax) if amax > 0 else F32(2.0**-126)
            q = paddle.to_tensor(x[sl] / s).astype(dtype).astype("float32").numpy()
            out[sl] = q * s
    return out


def test_e5m2_gradient_tiles_match_reference():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((200, 128)).astype(F32), rng.standard_normal((128, 256)).astype(F32)
    g = (rng.standard_normal((200, 256)) * 10.0 ** rng.uniform(-6, 0, (200, 1))).astype(F32)
    _, dx, dw = run(x, w, g, 128, grad_format="e5m2")
    e5, e4 = paddle.float8_e5m2, paddle.float8_e4m3fn
    ref_dx = _ref_quant_fmt(g, 1, 128, e5, 57344.0).astype(np.float64) @ _ref_quant_fmt(w, 128, 128, e4, 448.0).T
    xq = _ref_quant_fmt(pad_rows(x, 128), 128, 1, e4, 448.0).astype(np.float64)
    gq = _ref_quant_fmt(pad_rows(g, 128), 128, 1, e5, 57344.0).astype(np.float64)
    assert rel(dx, ref_dx) < 1e-5 and rel(dw, xq.T @ gq) < 1e-5


def test_e5m2_keeps_small_token_gradients_that_e4m3_flushes():
    # one token with a large gradient and no input; 127 tokens with tiny gradients carry all of dW
    rng = np.random.default_rng(4)
    x = rng.standard_normal((128, 128)).astype(F32)
    x[0] = 0.0
    g = (rng.standard_normal((128, 128)) * 1e-7).astype(F32)
    g[0] = 1.0
    w = rng.standard_normal((128, 128)).astype(F32)
    exact = x.astype(np.float64).T @ g
    dw4 = run(x, w, g, 128)[2]
    dw5 = run(x, w, g, 128, grad_format="e5m2")[2]
    assert rel(dw4, exact) > 0.99  # e4m3: 1e-7 / 448-scaled tiles fall below the subnormal range
    assert rel(dw5, exact) < 0.2


def test_unknown_gradient_format_is_one_line_error():
    x, w = paddle.ones([4, 128]), paddle.ones([128, 128])
    with pytest.raises(ConfigError, match="fp8_grad_format='e3m4'"):
        fp8_matmul(x, w, grad_format="e3m4")


# ---- the numpy emulation and the grouped (all experts at once) GEMM ------------------------------
@pytest.mark.parametrize("fmt, dtype", [("e4m3", paddle.float8_e4m3fn), ("e5m2", paddle.float8_e5m2)])
def test_float32_rounding_equals_the_float8_cast(fmt, dtype):
    """round_to_format_np (the fast emulation) against Paddle's own cast, normals, subnormals and ties."""
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    rng = np.random.default_rng(3)
    v = rng.standard_normal(50000) * 10.0 ** rng.uniform(-9, np.log10(fmax) - 0.5, 50000)
    grid = paddle.to_tensor(np.linspace(-4, 4, 4097, dtype=F32)).astype(dtype).astype("float32").numpy()
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway between neighbours: must go to the even one
    v = np.clip(np.concatenate([v, ties, ties * 2.0**-12, [0.0, fmax, -fmax]]), -fmax, fmax).astype(F32)
    want = paddle.to_tensor(v).astype(dtype).astype("float32").numpy()
    np.testing.assert_array_equal(fp8_mod.round_to_format_np(v, fmt), want)


@pytest.fixture(params=["c-kernel", "numpy"])
def quant_path(request, monkeypatch):
    """Both CPU quantisation paths: the C kernel (erniekit/nn/native.py) and numpy without it."""
    from erniekit.nn import native

    if request.param == "numpy":
        monkeypatch.setattr(native, "fake_quant_runs", lambda: None)
    else:
        assert native.fake_quant_runs() is not None, native.why_not
    return request.param


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rows, cols", [(1, 64), (64, 64), (64, 1)])
def test_numpy_fake_quant_equals_the_cast_path(quant_path, fmt, rows, cols):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((192, 128)) * 10.0 ** rng.uniform(-6, 6, (192, 1))).astype(F32)
    x[3] = 0.0
    x[7, 5] = np.nan
    a = fp8_mod._fake_quant(paddle.to_tensor(x), rows, cols, fmt).numpy()
    b = fp8_mod._fake_quant_cast(paddle.to_tensor(x), rows, cols, fmt).numpy()
    np.testing.assert_array_equal(a, b)  # NaN in the same places, every other value equal
    assert np.isnan(a).any() and (a != x)[np.isfinite(x)].any()


@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("rows, cols", [(1, 64), (64, 64), (64, 1)])
def test_numpy_fake_quant_does_not_depend_on_the_thread_count(quant_path, monkeypatch, threads, rows, cols):
    """fake_quant_np cuts big operands into one chunk of whole tiles per thread: the values must be
    the cast path's whatever the cut."""
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    monkeypatch.setattr(fp8_mod, "_PARALLEL_BYTES", 1)  # cut even this small operand
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((320, 192)) * 10.0 ** rng.uniform(-5, 5, (320, 1))).astype(F32)
    want = fp8_mod._fake_quant_cast(paddle.to_tensor(x), rows, cols, "e5m2").numpy()
    np.testing.assert_array_equal(fp8_mod.fake_quant_np(x, rows, cols, "e5m2"), want)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_token_runs_equal_quantising_a_zero_padded_layout(quant_path, monkeypatch, threads):
    """dW's block x 1 tiles start at each expert group's first row: the reference pads every group
    with zero rows to a multiple of the block, quantises, and drops the padding again."""
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    monkeypatch.setattr(fp8_mod, "_PARALLEL_BYTES", 1)
    rng = np.random.default_rng(7)
    sizes, block = [1, 63, 64, 65, 130, 0, 7], 64
    a = (rng.standard_normal((sum(sizes), 128)) * 10.0 ** rng.uniform(-4, 4, (sum(sizes), 1))).astype(F32)
    padded_sizes = [-(-n // block) * block for n in sizes]
    padded = np.zeros((sum(padded_sizes), 128), F32)
    src = dst = 0
    keep = []
    for n, p in zip(sizes, padded_sizes):
        padded[dst : dst + n] = a[src : src + n]
        keep.extend(range(dst, dst + n))
        src, dst = src + n, dst + p
    want = fp8_mod._fake_quant_cast(paddle.to_tensor(padded), block, 1, "e4m3").numpy()[keep]
    np.testing.assert_array_equal(fp8_mod.fake_quant_token_runs_np(a, sizes, block), want)


def test_grouped_matmuls_sharing_an_input_equal_separate_calls():
    """gate and up projections in one call (x quantised once) give the outputs and gradients of
    two fp8_grouped_matmul calls."""
    rng = np.random.default_rng(8)
    sizes, experts, E, K, N = [70, 1, 129], [2, 0, 3], 4, 128, 64
    x_np = rng.standard_normal((sum(sizes), K)).astype(F32)
    w_np = [rng.standard_normal((E, K, N)).astype(F32) for _ in range(2)]
    g_np = [rng.standard_normal((sum(sizes), N)).astype(F32) for _ in range(2)]

    def run(together: bool):
        x = paddle.to_tensor(x_np, stop_gradient=False)
        ws = [paddle.to_tensor(w, stop_gradient=False) for w in w_np]
        if together:
            ys = fp8_mod.fp8_grouped_matmuls(x, ws, sizes, experts, block=64, grad_format="e5m2")
        else:
            ys = [fp8_mod.fp8_grouped_matmul(x, w, sizes, experts, block=64, grad_format="e5m2") for w in ws]
        (ys[0] * paddle.to_tensor(g_np[0]) + ys[1] * paddle.to_tensor(g_np[1])).sum().backward()
        return [y.numpy() for y in ys] + [x.grad.numpy()] + [w.grad.numpy() for w in ws]

    for a, b in zip(run(True), run(False)):
        np.testing.assert_array_equal(a, b)


def _grouped_vs_loop(sizes, experts, E, block, fmt, w_frozen=False):
    rng = np.random.default_rng(5)
    K, N, M = 128, 64, sum(sizes)
    x_np = rng.standard_normal((M, K)).astype(F32)
    w_np = rng.standard_normal((E, K, N)).astype(F32)
    g_np = (rng.standard_normal((M, N)) * 10.0 ** rng.uniform(-4, 1, (M, 1))).astype(F32)
    x1, w1 = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=w_frozen)
    y1 = fp8_mod.fp8_grouped_matmul(x1, w1, sizes, experts, block=block, grad_format=fmt)
    y1.backward(paddle.to_tensor(g_np))
    x2, w2 = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=w_frozen)
    ws = paddle.unbind(w2)
    parts = paddle.split(x2, sizes) if len(sizes) > 1 else [x2]
    y2 = paddle.concat([fp8_matmul(p, ws[e], block=block, grad_format=fmt) for p, e in zip(parts, experts)])
    y2.backward(paddle.to_tensor(g_np))
    np.testing.assert_allclose(y1.numpy(), y2.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x1.grad.numpy(), x2.grad.numpy(), rtol=1e-6, atol=1e-6)
    if w_frozen:
        assert w1.grad is None
        return None
    # dW sums over each group's tokens, padded to whole tiles in the grouped path: the same terms, but
    # the BLAS may order a sum of 64 rows otherwise than one of 63 (bit-equal with AVX-512's kernels,
    # ~1e-5 apart without AVX-512: measured). Bound: float32 rounding of that sum, a few ulps of the
    # sum of |terms|; a wrong tile or scale is off by the values themselves, far above it.
    terms = np.zeros((E, K, N))
    for e, xs, gs in zip(experts, np.split(x_np, np.cumsum(sizes)[:-1]), np.split(g_np, np.cumsum(sizes)[:-1])):
        terms[e] += np.abs(xs.astype(np.float64)).T @ np.abs(gs.astype(np.float64))
    diff = np.abs(w1.grad.numpy().astype(np.float64) - w2.grad.numpy())
    assert (diff <= 16 * np.finfo(F32).eps * terms + 1e-30).all(), float((diff / (terms + 1e-30)).max())
    return w1.grad.numpy()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_grouped_fp8_matmul_equals_one_fp8_matmul_per_expert(quant_path, fmt):
    """Same tiles, so the same numbers: groups of 1, 63, 64, 65 and 130 rows (dW's token tiles are
    padded per group), experts out of order, two experts without tokens."""
    dw = _grouped_vs_loop([1, 63, 64, 65, 130], [4, 0, 2, 6, 1], E=7, block=64, fmt=fmt)
    assert not dw[[3, 5]].any() and (np.abs(dw[[0, 1, 2, 4, 6]]).sum(axis=(1, 2)) > 0).all()


def test_grouped_fp8_matmul_with_one_group_and_a_frozen_weight():
    _grouped_vs_loop([37], [1], E=2, block=64, fmt="e4m3", w_frozen=True)


def test_grouped_fp8_matmul_rejects_groups_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="one expert per group summing to M"):
        fp8_mod.fp8_grouped_matmul(paddle.randn([10, 128]), paddle.randn([2, 128, 128]), [4, 5], [0, 1])
    with pytest.raises(FP8ShapeError, match="fp8_block_size"):
        fp8_mod.fp8_grouped_matmul(paddle.randn([10, 96]), paddle.randn([2, 96, 128]), [10], [0], block=64)
