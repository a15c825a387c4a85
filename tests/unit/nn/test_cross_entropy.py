"""Softmax cross entropy for float32 CPU logits (erniekit/nn/cross_entropy.py and
kernels/cross_entropy.c): the C kernel and the numpy path give the same bits, both follow the
formula in float64, agree with Paddle's kernel and its gradient, and the LM losses take it."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.nn import cross_entropy as ce
from erniekit.nn import native
from erniekit.train import losses

KERNEL_MODULE = ce
IGNORE = -100


def _case(seed, N, V, scale=4.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, V)) * scale).astype(np.float32)
    label = rng.integers(0, V, N)
    label[rng.random(N) < 0.25] = IGNORE
    g = rng.standard_normal(N).astype(np.float32)
    return x, label, g


def _kernel_run(x, label, g):
    t = paddle.to_tensor(x, stop_gradient=False)
    nll = ce.softmax_cross_entropy(t, label, IGNORE)
    (nll * paddle.to_tensor(g)).sum().backward()
    return nll.numpy(), t.grad.numpy()


SHAPES = [(7, 37), (16, 1024), (3, 1), (1, 16), (5, 100003 % 4099)]


@pytest.mark.parametrize("N,V", SHAPES)
def test_the_c_kernel_and_numpy_give_the_same_bits(kernel, bits, N, V):
    x, label, g = _case(N + V, N, V)
    nll, dx = _kernel_run(x, label, g)
    want_nll, lse = ce.forward_np(x, label, IGNORE)
    np.testing.assert_array_equal(bits(nll), bits(want_nll))
    np.testing.assert_array_equal(bits(dx), bits(ce.backward_np(x, label, lse, g, IGNORE)))


def test_numpy_path_is_the_kernel_when_it_is_off(monkeypatch, bits):
    x, label, g = _case(1, 9, 50)
    with_kernel = _kernel_run(x, label, g)
    monkeypatch.setattr(ce, "_kernels", lambda: None)
    for a, b in zip(_kernel_run(x, label, g), with_kernel):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("N,V", SHAPES)
def test_forward_and_backward_follow_the_formula(N, V):
    x, label, g = _case(7 + N, N, V, scale=20.0)  # logits up to ~80: the max shift matters
    nll, dx = _kernel_run(x, label, g)
    z = x.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    keep = label != IGNORE
    rows = np.flatnonzero(keep)
    want = np.zeros(N)
    want[rows] = lse[rows] - z[rows, label[rows]]
    np.testing.assert_allclose(nll, want, rtol=1e-5, atol=2e-5)
    p = np.exp(z - lse[:, None])
    want_dx = p * g[:, None]
    want_dx[rows, label[rows]] -= g[rows]
    want_dx[~keep] = 0
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)
    assert not dx[~keep].any() and not nll[~keep].any()  # ignored rows: exactly nothing


def test_it_matches_paddles_kernel_and_gradient():
    x, label, g = _case(3, 64, 300)
    nll, dx = _kernel_run(x, label, g)
    t = paddle.to_tensor(x, stop_gradient=False)
    ref = F.cross_entropy(t, paddle.to_tensor(label.reshape(-1, 1)), ignore_index=IGNORE, reduction="none")
    (ref.reshape([-1]) * paddle.to_tensor(g)).sum().backward()
    np.testing.assert_allclose(nll, ref.numpy().reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, t.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_label_outside_the_vocabulary_is_refused_in_one_line():
    x = paddle.zeros([2, 5])
    with pytest.raises(ValueError, match=r"^cross entropy: label 5 is outside the vocabulary of 5 logits; check"):
        ce.softmax_cross_entropy(x, np.array([1, 5]), IGNORE)
    with pytest.raises(ValueError, match=r"^cross entropy: 3 labels for 2 rows of logits$"):
        ce.softmax_cross_entropy(x, np.array([1, 2, 3]), IGNORE)


def test_labels_are_copied_and_must_be_integers():
    """The backward reads the labels after the caller may have reused its array."""
    x, label, g = _case(9, 6, 11)
    label[:] = np.arange(6)
    want = _kernel_run(x, label.copy(), g)[1]
    t = paddle.to_tensor(x, stop_gradient=False)
    nll = ce.softmax_cross_entropy(t, label, IGNORE)
    label[:] = IGNORE  # the caller's array changes before the backward
    (nll * paddle.to_tensor(g)).sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), want)
    with pytest.raises(ValueError, match="labels must be integer class ids, got dtype float64"):
        ce.softmax_cross_entropy(t, np.array([1.9] * 6), IGNORE)


def test_only_dense_float32_cpu_2d_logits_take_it():
    assert ce.usable(paddle.zeros([3, 4]))
    assert not ce.usable(paddle.zeros([2, 3, 4]))
    assert not ce.usable(paddle.zeros([3, 4], dtype="float64"))
    assert not ce.usable(paddle.zeros([0, 4]))


def test_an_input_changed_in_place_after_the_forward_is_refused():
    x = paddle.randn([4, 6])
    x.stop_gradient = False
    y = x * 1
    nll = ce.softmax_cross_entropy(y, np.array([0, 1, 2, 3]), IGNORE)
    with paddle.no_grad():
        y.scale_(2.0)
    with pytest.raises((RuntimeError, OSError), match="cross_entropy: an input was modified in place"):
        nll.sum().backward()


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    x, label, g = _case(5, 256, 513)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _kernel_run(x, label, g)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    three = _kernel_run(x, label, g)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("fn", ["causal", "logps", "balanced"])
def test_the_lm_losses_equal_paddles_kernel_through_it(monkeypatch, fn):
    """causal_lm_loss_sum, token_logps and token_balanced_loss_sum with the kernel and with
    Paddle's cross entropy (kernel unusable): same values and gradients to float32 rounding."""
    rng = np.random.default_rng(11)
    logits_np = rng.standard_normal((3, 8, 40)).astype(np.float32)
    labels = rng.integers(0, 40, (3, 8))
    labels[0, :3] = IGNORE
    segs = np.array([[1] * 8, [1] * 4 + [2] * 4, [1] * 8])
    run = {
        "causal": lambda lg: losses.causal_lm_loss_sum(lg, labels, segs),
        "logps": lambda lg: losses.token_logps(lg, labels, temperature=0.7).sum(),
        "balanced": lambda lg: losses.token_balanced_loss_sum(lg, labels, segs),
    }[fn]
    out = []
    calls = []
    real = ce.softmax_cross_entropy
    monkeypatch.setattr(ce, "softmax_cross_entropy", lambda *a: calls.append(1) or real(*a))
    for kernel_on in (True, False):
        if not kernel_on:
            monkeypatch.setattr(ce, "usable", lambda *_: False)
        lg = paddle.to_tensor(logits_np, stop_gradient=False)
        loss = run(lg)
        loss.backward()
        out.append((float(loss), lg.grad.numpy()))
    assert calls == [1]
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-4, atol=1e-6)
