"""rms_norm's hand-written backward (erniekit/nn/norm.py) against the formula, differentiated in
float64 by hand, and against Paddle's autograd through the plain formula."""

import numpy as np
import paddle
import pytest

from erniekit.nn.norm import rms_norm


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


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 32)])
def test_rms_norm_forward_and_backward_match_the_formula(shape):
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
    np.testing.assert_array_equal(y.numpy(), y2.numpy())
    np.testing.assert_allclose(x.grad.numpy(), x2.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), w2.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_rms_norm_with_a_frozen_weight_or_input():
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    w = paddle.ones([8])  # frozen (a LoRA run's norms)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None
    w2 = paddle.create_parameter([8], "float32")
    rms_norm(paddle.randn([4, 8]), w2, 1e-6).sum().backward()
    assert w2.grad is not None


def test_an_overflowing_norm_gives_a_nan_gradient_as_autograd_does():
    """mean(x^2) = inf makes r = 0 and the output 0; the gradient is undefined and must show as nan
    (the trainer stops on a nan gradient norm) rather than a quiet 0."""
    x = paddle.to_tensor(np.full((2, 4), 1e30, np.float32), stop_gradient=False)
    w = paddle.create_parameter([4], "float32")
    y = rms_norm(x, w, 1e-6)
    assert (y.numpy() == 0).all()
    y.sum().backward()
    assert np.isnan(x.grad.numpy()).all()
