"""The rotary embedding's CPU kernel (erniekit/nn/rope.py, kernels/rope.c): the same bits as the
eager rope it replaces (expand, pair-rotation matmul, products) forward and backward, the numpy
path the same as the kernel, any thread count the same, and the attention layer takes it."""

import numpy as np
import paddle
import pytest

from erniekit.nn import attention, native, rope
from erniekit.nn.attention import rope_cos_sin

KERNEL_MODULE = rope


def _case(seed, B, S, H, D, theta=100.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((B, S, H, D)) * 3).astype(np.float32)
    pos = paddle.to_tensor(rng.integers(0, 4 * S, (B, S)))
    cos, sin = rope_cos_sin(pos, D, theta)
    g = rng.standard_normal((B, S, H, D)).astype(np.float32)
    return x, cos, sin, g


def _grad_run(x, cos, sin, g, monkeypatch=None, eager=False):
    if eager:
        monkeypatch.setattr(rope, "usable", lambda *_: False)
    t = paddle.to_tensor(x, stop_gradient=False)
    y = attention.apply_rope(t, cos, sin)
    (y * paddle.to_tensor(g)).sum().backward()
    return y.numpy(), t.grad.numpy()


SHAPES = [(2, 5, 3, 16), (1, 1, 4, 64), (3, 7, 2, 2), (2, 4, 8, 128)]


@pytest.mark.parametrize("shape", SHAPES)
def test_it_gives_the_eager_ropes_bits_forward_and_backward(monkeypatch, bits, shape):
    x, cos, sin, g = _case(sum(shape), *shape)
    assert rope.usable(paddle.to_tensor(x), cos, sin)
    fast = _grad_run(x, cos, sin, g)
    slow = _grad_run(x, cos, sin, g, monkeypatch, eager=True)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(bits(a) & 0x7FFFFFFF, bits(b) & 0x7FFFFFFF)  # zeros may differ in sign
        np.testing.assert_array_equal(a, b)


def test_it_rotates_each_interleaved_pair_by_its_angle():
    """The formula in float64: pair (x[2i], x[2i+1]) turned by pos * theta^(-2i/D)."""
    B, S, H, D, theta = 2, 6, 3, 8, 50.0
    x, cos, sin, _ = _case(4, B, S, H, D, theta)
    y = rope.apply_rope(paddle.to_tensor(x), cos, sin).numpy().astype(np.float64)
    ang = np.arctan2(sin.numpy()[:, :, :, 0::2], cos.numpy()[:, :, :, 0::2]).astype(np.float64)
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    np.testing.assert_allclose(y[..., 0::2], a * np.cos(ang) - b * np.sin(ang), atol=1e-5)
    np.testing.assert_allclose(y[..., 1::2], b * np.cos(ang) + a * np.sin(ang), atol=1e-5)


def test_numpy_path_is_the_kernel_when_it_is_off(kernel, monkeypatch, bits):
    x, cos, sin, g = _case(1, 2, 9, 4, 32)
    with_kernel = _grad_run(x, cos, sin, g)
    monkeypatch.setattr(rope, "_kernels", lambda: None)
    for a, b in zip(_grad_run(x, cos, sin, g), with_kernel):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    x, cos, sin, g = _case(5, 4, 64, 8, 64)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _grad_run(x, cos, sin, g)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for a, b in zip(one, _grad_run(x, cos, sin, g)):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_only_float32_cpu_with_per_position_cos_sin_take_it():
    x, cos, sin, _ = _case(2, 2, 3, 4, 8)
    t = paddle.to_tensor(x)
    assert rope.usable(t, cos, sin)
    assert not rope.usable(t, cos[:1], sin[:1])  # a cos shared by the batch: the eager broadcast
    assert not rope.usable(t.astype("float64"), cos, sin)
    moving = cos.clone()
    moving.stop_gradient = False
    assert not rope.usable(t, moving, sin)


def test_a_distributed_tensor_keeps_cos_and_sin_unexpanded_for_the_backward():
    """On DistTensors (tp ranks, and GPUs) cos / sin broadcast over the heads: expanded, the products
    kept [B, S, heads, D] copies for the backward, replicated on every tp rank (2 (q + kv) floats a
    token and layer, measured by tools/measure_saved_activations.py --launch --list). The values are
    the expanded path's."""
    import paddle.distributed as dist

    x, cos, sin, g = _case(5, 2, 6, 4, 16)
    mesh = dist.ProcessMesh([0], dim_names=["tp"])
    t = dist.shard_tensor(paddle.to_tensor(x), mesh, [dist.Replicate()])
    t.stop_gradient = False
    cos, sin = (dist.shard_tensor(c, mesh, [dist.Replicate()]) for c in (cos, sin))  # as a tp rank has them
    kept = []
    with paddle.autograd.saved_tensors_hooks(lambda s: kept.append(list(s.shape)) or s, lambda s: s):
        y = attention.apply_rope(t, cos, sin)
    assert [2, 6, 1, 16] in kept and kept.count([2, 6, 4, 16]) <= 2  # x and its rotated pairs, not cos / sin
    (y * paddle.to_tensor(g)).sum().backward()
    with pytest.MonkeyPatch.context() as mp:
        want_y, want_grad = _grad_run(x, *_case(5, 2, 6, 4, 16)[1:3], g, mp, eager=True)
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(t.grad.numpy(), want_grad, rtol=1e-6, atol=1e-6)
