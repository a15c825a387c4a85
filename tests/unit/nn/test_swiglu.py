"""silu(gate) * up (erniekit/nn/swiglu.py, kernels/swiglu.c): the C kernel and the numpy path give
the same bits at any thread count; both follow the formula in float64 and Paddle's silu and its
autograd; the MLP is the same through it and through Paddle's ops."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.nn import native
from erniekit.nn import swiglu as sw

KERNEL_MODULE = sw


def _case(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    edges = [0.0, -0.0, -100.0, 100.0, -87.5, 20.0]  # both zeros, both tails, the exponential's floor
    g[: min(n, 6)] = edges[:n]
    return g, rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("n", [1, 15, 16, 1000, 40001])
def test_the_c_kernel_and_numpy_give_the_same_bits(kernel, bits, n):
    g, u, dh = _case(n, n)
    G, U, DH = (paddle.to_tensor(a) for a in (g, u, dh))
    np.testing.assert_array_equal(bits(sw._forward(G, U)), bits(sw.forward_np(g, u)))
    for need in [(True, True), (True, False), (False, True)]:
        for got, want in zip(sw._backward(G, U, DH, *need), sw.backward_np(g, u, dh, *need)):
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_array_equal(bits(got), bits(want))


def test_the_formula_in_float64():
    g, u, dh = _case(5000)
    s = 1 / (1 + np.exp(-g.astype(np.float64)))
    h = g * s * u
    dg, du = dh * u * (s + g * s * (1 - s)), dh * g * s
    np.testing.assert_allclose(sw.forward_np(g, u), h, rtol=2e-6, atol=1e-30)
    got_dg, got_du = sw.backward_np(g, u, dh)
    np.testing.assert_allclose(got_du, du, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(got_dg, dg, rtol=1e-5, atol=1e-6)


def test_the_autograd_op_matches_paddles_silu_and_its_gradient():
    g, u, dh = _case(3 * 7 * 64, 4)
    g = np.clip(g, -80, 80)  # below -88 Paddle's silu gradient is NaN (next test)
    outs = []
    for fused in (True, False):
        G = paddle.to_tensor(g.reshape(3, 7, 64), stop_gradient=False)
        U = paddle.to_tensor(u.reshape(3, 7, 64), stop_gradient=False)
        h = sw.swiglu(G, U) if fused else F.silu(G) * U
        h.backward(paddle.to_tensor(dh.reshape(3, 7, 64)))
        outs.append((h.numpy(), G.grad.numpy(), U.grad.numpy()))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_the_gradient_stays_finite_where_paddles_silu_gradient_is_nan():
    """Paddle's CPU silu gradient is NaN (or -inf) for gate <= -88 (exp(-x) overflows in its
    formula); torch's and the kernel's are ~0 there, as the derivative is."""
    g = np.array([-100.0, -90.0, -88.8, -88.0, -50.0, 100.0], np.float32)
    G = paddle.to_tensor(g, stop_gradient=False)
    sw.swiglu(G, paddle.ones([6])).sum().backward()
    got = G.grad.numpy()
    assert np.isfinite(got).all()
    s = 1 / (1 + np.exp(-g.astype(np.float64)))
    np.testing.assert_allclose(got, s * (1 + g * (1 - s)), rtol=1e-5, atol=1e-30)
    P = paddle.to_tensor(g, stop_gradient=False)
    F.silu(P).sum().backward()
    if np.isfinite(P.grad.numpy()).all():  # the day Paddle fixes it, the docstrings should say so
        pytest.fail("Paddle's silu gradient is finite now: update erniekit/nn/swiglu.py's docstring")


def test_a_frozen_input_gets_no_gradient_and_no_grad_is_the_training_forward():
    g, u, _ = _case(64)
    G, U = paddle.to_tensor(g, stop_gradient=False), paddle.to_tensor(u)  # up frozen
    h = sw.swiglu(G, U)
    h.sum().backward()
    assert G.grad is not None and U.grad is None
    with paddle.no_grad():
        np.testing.assert_array_equal(sw.swiglu(G, U).numpy(), h.numpy())


def test_the_numpy_path_is_the_kernel_when_it_is_off(bits, monkeypatch):
    g, u, dh = _case(3000, 5)

    def run():
        G, U = paddle.to_tensor(g, stop_gradient=False), paddle.to_tensor(u, stop_gradient=False)
        h = sw.swiglu(G, U)
        h.backward(paddle.to_tensor(dh))
        return h.numpy(), G.grad.numpy(), U.grad.numpy()

    with_kernel = run()
    monkeypatch.setattr(sw, "_kernels", lambda: None)
    for a, b in zip(run(), with_kernel):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    g, u, dh = _case(100_000, 6)
    G, U, DH = (paddle.to_tensor(a) for a in (g, u, dh))
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    outs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        outs.append([sw._forward(G, U).numpy(), *(t.numpy() for t in sw._backward(G, U, DH, True, True))])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_only_float32_cpu_tensors_of_one_shape_take_the_kernel():
    a = paddle.randn([2, 8])
    assert sw.usable(a, paddle.randn([2, 8]))
    assert not sw.usable(a.astype("bfloat16"), a.astype("bfloat16"))
    assert not sw.usable(a, paddle.randn([1, 8]))
    # and those that do not still compute silu(gate) * up (Paddle has no CPU bfloat16 silu)
    b = paddle.randn([2, 8]).astype("float64")
    np.testing.assert_array_equal(sw.swiglu(b, b).numpy(), (F.silu(b) * b).numpy())


def test_the_mlp_is_the_same_with_and_without_the_kernel(monkeypatch):
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config
    from erniekit.models.ernie4_5.modeling import MLP

    paddle.seed(0)
    mlp = MLP(Ernie4_5Config(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=2))
    x_np = np.random.default_rng(7).standard_normal((2, 5, 32)).astype(np.float32)
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(sw, "usable", lambda *_: False)
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = mlp(x)
        (y * y).sum().backward()
        outs.append((y.numpy(), x.grad.numpy(), mlp.gate_proj.weight.grad.numpy()))
        mlp.clear_gradients()
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_input_modified_in_place_after_the_forward_is_refused():
    g = paddle.randn([4, 16])
    g.stop_gradient = False
    gate = g * 1
    h = sw.swiglu(gate, paddle.randn([4, 16]))
    gate.scale_(2.0)
    with pytest.raises((RuntimeError, OSError), match=r"swiglu: an input was modified in place after the forward"):
        h.sum().backward()


def test_a_function_using_it_converts_with_to_static():
    def f(g, u):
        return sw.swiglu(g, u) * 2

    g, u = paddle.randn([3, 8]), paddle.randn([3, 8])
    want = f(g, u).numpy()
    for full_graph in (False, True):
        np.testing.assert_allclose(paddle.jit.to_static(f, full_graph=full_graph)(g, u).numpy(), want, rtol=1e-6)
