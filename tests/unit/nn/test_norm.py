"""rms_norm's hand-written backward (erniekit/nn/norm.py, kernels/rms_norm.c) against the formula,
differentiated in float64 by hand, and against Paddle's autograd through the plain formula; the C
kernel and its numpy twin give the same bits, at any thread count."""

import numpy as np
import paddle
import pytest

from erniekit.nn import native
from erniekit.nn import norm as nm
from erniekit.nn.norm import rms_norm

KERNEL_MODULE = nm


def _kernel_forward(x, w, eps):
    """The C kernel on numpy arrays (copied into tensors), its results as numpy arrays."""
    y, r = nm._forward(paddle.to_tensor(x), paddle.to_tensor(w), eps)
    return y.numpy(), r


def _kernel_backward(x, w, r, dy, need_dx, need_p):
    got = nm._backward(*(paddle.to_tensor(a) for a in (x, w)), r, paddle.to_tensor(dy), need_dx, need_p)
    return tuple(None if t is None else t.numpy() for t in got)


def _reference(x, w, dy, eps):
    """y = w * x * r, r = (mean(x^2) + eps)^-1/2; gradients by the chain rule, in float64."""
    x, w, dy = (a.astype(np.float64) for a in (x, w, dy))
    H = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = w * x * r
    dw = (dy * x * r).reshape(-1, H).sum(0)
    g = dy * w  # dL/d(x r)
    dx = g * r - x * r**3 * (g * x).sum(-1, keepdims=True) / H
    return y, dx, dw


@pytest.fixture(params=["native", "eager"])
def path(request, monkeypatch):
    """Each test runs through the float32 CPU kernel path and through the eager PyLayer (what other
    dtypes and devices take)."""
    if request.param == "eager":
        monkeypatch.setattr(nm, "usable", lambda *_: False)
    return request.param


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 32), (4, 37)])
def test_rms_norm_forward_and_backward_match_the_formula(shape, path):
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(shape) * 3).astype(np.float32)
    w_np = rng.standard_normal(shape[-1]).astype(np.float32)
    dy_np = rng.standard_normal(shape).astype(np.float32)
    x, w = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    y = rms_norm(x, w, 1e-5)
    y.backward(paddle.to_tensor(dy_np))
    y_ref, dx_ref, dw_ref = _reference(x_np, w_np, dy_np, 1e-5)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), dx_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), dw_ref, rtol=1e-4, atol=1e-5)

    # the same as Paddle's autograd through the plain formula
    x2, w2 = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    y2 = w2 * (x2 * paddle.rsqrt((x2 * x2).mean(-1, keepdim=True) + 1e-5))
    y2.backward(paddle.to_tensor(dy_np))
    if path == "eager":  # the same ops as the plain formula; the kernel sums in another order
        np.testing.assert_array_equal(y.numpy(), y2.numpy())
    np.testing.assert_allclose(y.numpy(), y2.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), x2.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), w2.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_rms_norm_with_a_frozen_weight_or_input(path):
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    w = paddle.ones([8])  # frozen (a LoRA run's norms)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None
    w2 = paddle.create_parameter([8], "float32")
    rms_norm(paddle.randn([4, 8]), w2, 1e-6).sum().backward()
    assert w2.grad is not None


def test_an_overflowing_norm_gives_a_nan_gradient_as_autograd_does(path):
    """mean(x^2) = inf makes r = 0 and the output 0; the gradient is undefined and must show as nan
    (the trainer stops on a nan gradient norm) rather than a quiet 0."""
    x = paddle.to_tensor(np.full((2, 4), 1e30, np.float32), stop_gradient=False)
    w = paddle.create_parameter([4], "float32")
    y = rms_norm(x, w, 1e-6)
    assert (y.numpy() == 0).all()
    y.sum().backward()
    assert np.isnan(x.grad.numpy()).all()


@pytest.mark.parametrize("rows,H", [(5, 16), (3, 37), (8, 128), (1, 1), (2, 1000)])
def test_the_c_kernel_and_numpy_give_the_same_bits(kernel, bits, rows, H):
    rng = np.random.default_rng(rows * H)
    x = (rng.standard_normal((rows, H)) * 3).astype(np.float32)
    w, dy = rng.standard_normal(H).astype(np.float32), rng.standard_normal((rows, H)).astype(np.float32)
    (y, r), (y_np, r_np) = _kernel_forward(x, w, 1e-5), nm.forward_np(x, w, 1e-5)
    np.testing.assert_array_equal(bits(y), bits(y_np))
    np.testing.assert_array_equal(bits(r), bits(r_np))
    for need in [(True, True), (True, False), (False, True)]:
        got, want = _kernel_backward(x, w, r, dy, *need), nm.backward_np(x, w, r, dy, *need)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(bits(a), bits(b))


def test_the_numpy_path_is_the_kernel_when_it_is_off(bits, monkeypatch):
    """ERNIEKIT_NATIVE_KERNELS=0 or no compiler: the same numbers from numpy, through the layer."""
    rng = np.random.default_rng(3)
    x_np, w_np = rng.standard_normal((6, 4, 48)).astype(np.float32), rng.standard_normal(48).astype(np.float32)

    def run():
        x, w = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
        y = rms_norm(x, w, 1e-6)
        (y * y).sum().backward()
        return y.numpy(), x.grad.numpy(), w.grad.numpy()

    with_kernel = run()
    monkeypatch.setattr(nm, "_kernels", lambda: None)
    for a, b in zip(run(), with_kernel):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((300, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    outs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        y, r = _kernel_forward(x, w, 1e-5)
        outs.append((y, r, *_kernel_backward(x, w, r, x, True, True)))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_the_no_grad_forward_is_the_training_forward():
    """Evaluation and decoding (no_grad) normalise exactly as the training forward does."""
    x = paddle.randn([3, 7, 40])
    w = paddle.create_parameter([40], "float32")
    x.stop_gradient = False
    train = rms_norm(x, w, 1e-6).numpy()
    with paddle.no_grad():
        np.testing.assert_array_equal(rms_norm(x, w, 1e-6).numpy(), train)


def test_only_dense_float32_cpu_tensors_take_the_kernel():
    w = paddle.ones([8])
    assert nm.usable(paddle.randn([2, 8]), w)
    assert not nm.usable(paddle.randn([2, 8]).astype("bfloat16"), w)
    assert not nm.usable(paddle.randn([2, 8]), w.astype("bfloat16"))
    assert not nm.usable(paddle.randn([2, 4]), w)


def test_an_input_modified_in_place_after_the_forward_is_refused():
    """The PyLayer saves x itself: a later in-place change would give a wrong gradient silently."""
    x = paddle.randn([4, 16])
    x.stop_gradient = False
    h = x * 1
    y = rms_norm(h, paddle.create_parameter([16], "float32"), 1e-6)
    h.scale_(3.0)
    with pytest.raises((RuntimeError, OSError), match=r"rms_norm: an input was modified in place after the forward"):
        y.sum().backward()


def test_a_layer_using_it_converts_with_to_static():
    """SOT (to_static's default) breaks the graph at the dispatch; full-graph takes the plain formula."""
    from erniekit.models.ernie4_5.modeling import RMSNorm

    layer = RMSNorm(16, 1e-6)
    x = paddle.randn([2, 3, 16])
    want = layer(x).numpy()
    for full_graph in (False, True):
        got = paddle.jit.to_static(RMSNorm(16, 1e-6), full_graph=full_graph)
        got.set_state_dict(layer.state_dict())
        np.testing.assert_allclose(got(x).numpy(), want, rtol=1e-6, atol=1e-6)


def test_a_row_of_negative_zeros_sums_as_the_kernel_sums_it(kernel, bits):
    """The kernels' lanes start at +0.0, so a row of -0.0 sums to +0.0; native.sum16 does too."""
    assert bits(native.sum16(np.full((2, 19), -0.0, np.float32))).tolist() == [0, 0]
    x, w, dy = np.ones((1, 16), np.float32), -np.ones(16, np.float32), np.zeros((1, 16), np.float32)
    _, r = _kernel_forward(x, w, 1e-6)
    np.testing.assert_array_equal(
        bits(_kernel_backward(x, w, r, dy, True, False)[0]), bits(nm.backward_np(x, w, r, dy, True, False)[0])
    )
