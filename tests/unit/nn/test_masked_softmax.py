"""The CPU attention's fused softmax(scores + mask) (erniekit/nn/masked_softmax.py and
kernels/masked_softmax.c): the C kernel and the numpy path give the same bits, both agree with
the formula and with Paddle's softmax and its autograd, and the attention is the same with it."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.nn import masked_softmax as ms
from erniekit.nn import native
from erniekit.nn.attention import math_attention

KERNEL_MODULE = ms

NEG = np.float32(-1e30)  # additive_mask's "may not attend"


def _case(rng, shape, batched_bias: bool, masked: float = 0.3):
    B, G, Sq, Sk = shape
    s = (rng.standard_normal(shape) * 4).astype(np.float32)
    bias = np.where(rng.random((B if batched_bias else 1, 1, Sq, Sk)) < masked, NEG, np.float32(0)).astype(np.float32)
    bias[..., 0] = 0  # every row sees something, as the model's masks guarantee
    return s, bias


SHAPES = [
    ((2, 3, 5, 37), True),
    ((1, 4, 3, 16), False),
    ((3, 2, 4, 7), True),
    ((2, 2, 6, 50), False),
    ((1, 1, 1, 1), False),
]


@pytest.mark.parametrize("shape,batched", SHAPES)
def test_the_c_kernel_and_numpy_give_the_same_bits(kernel, bits, shape, batched):
    rng = np.random.default_rng(sum(shape))
    s, bias = _case(rng, shape, batched)
    p_c, p_np = ms.forward(s, bias), ms.forward_np(s, bias)
    np.testing.assert_array_equal(bits(p_c), bits(p_np))
    dp = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(bits(ms.backward(p_c, dp)), bits(ms.backward_np(p_np, dp)))


def test_numpy_path_is_the_kernel_when_it_is_off(monkeypatch):
    """ERNIEKIT_NATIVE_KERNELS=0 or no compiler: the same numbers, from numpy."""
    s, bias = _case(np.random.default_rng(0), (2, 4, 9, 33), True)
    with_kernel = ms.forward(s, bias)
    monkeypatch.setattr(ms, "_kernels", lambda: None)
    np.testing.assert_array_equal(ms.forward(s, bias), ms.forward_np(s, bias))
    np.testing.assert_array_equal(ms.forward(s, bias), with_kernel)


@pytest.mark.parametrize("shape,batched", SHAPES)
def test_forward_and_backward_follow_the_formula(shape, batched):
    rng = np.random.default_rng(7 + sum(shape))
    s, bias = _case(rng, shape, batched)
    z = s.astype(np.float64) + bias.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    p = ms.forward(s, bias)
    np.testing.assert_allclose(p, want, atol=1e-6, rtol=1e-5)
    assert (p[np.broadcast_to(bias, s.shape) == NEG] == 0).all()  # masked keys get exactly nothing
    dp = rng.standard_normal(shape)
    want_ds = want * (dp - (want * dp).sum(-1, keepdims=True))
    np.testing.assert_allclose(ms.backward(p, dp.astype(np.float32)), want_ds, atol=1e-5, rtol=1e-4)


def test_the_exponential_is_within_two_ulp_and_zero_below_its_floor():
    x = np.concatenate([-np.geomspace(1e-8, 87, 20001), [0.0]]).astype(np.float32)
    got = native.exp_neg(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2.0
    assert (native.exp_neg(np.array([-87.5, -1e30, -np.inf], np.float32)) == 0).all()


def test_the_autograd_op_matches_paddles_softmax_and_its_gradient():
    rng = np.random.default_rng(3)
    s_np, bias_np = _case(rng, (2, 4, 12, 40), True)
    w = paddle.to_tensor(rng.standard_normal(s_np.shape).astype(np.float32))
    grads = []
    for fused in (True, False):
        s = paddle.to_tensor(s_np, stop_gradient=False)
        bias = paddle.to_tensor(bias_np)
        assert ms.usable(s, bias)
        p = ms.masked_softmax(s, bias) if fused else F.softmax(s + bias.expand(s.shape), axis=-1)
        (p * w).sum().backward()
        grads.append((p.numpy(), s.grad.numpy()))
    np.testing.assert_allclose(grads[0][0], grads[1][0], atol=1e-6)
    np.testing.assert_allclose(grads[0][1], grads[1][1], atol=1e-5)


def test_only_dense_float32_cpu_scores_with_a_matching_mask_take_it():
    s = paddle.zeros([2, 3, 4, 5])
    assert ms.usable(s, paddle.zeros([1, 1, 4, 5])) and ms.usable(s, paddle.zeros([2, 1, 4, 5]))
    assert not ms.usable(s, paddle.zeros([2, 3, 4, 5]))  # a per-head mask
    assert not ms.usable(s, paddle.zeros([3, 1, 4, 5]))
    assert not ms.usable(s.astype("bfloat16"), paddle.zeros([1, 1, 4, 5]))


def test_the_attention_is_the_same_with_and_without_it(monkeypatch):
    """math_attention through the fused softmax against Paddle's ops (GQA, padding, a KV offset)."""
    rng = np.random.default_rng(11)
    B, Sq, Sk, H, KVH, D = 2, 5, 9, 6, 2, 8
    arrays = [rng.standard_normal(sh).astype(np.float32) for sh in ([B, Sq, H, D], [B, Sk, KVH, D], [B, Sk, KVH, D])]
    bias = np.zeros((B, 1, Sq, Sk), np.float32)
    bias[0, :, :, :3] = NEG  # row 0: three padded keys
    bias[:, :, np.arange(Sq)[:, None] < np.arange(Sk)[None, :] - (Sk - Sq)] = NEG  # causal after 4 cached keys
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ms, "usable", lambda *_: False)
        q, k, v = (paddle.to_tensor(a, stop_gradient=False) for a in arrays)
        o = math_attention(q, k, v, paddle.to_tensor(bias), scale=D**-0.5)
        (o * o).sum().backward()
        outs.append([o.numpy()] + [t.grad.numpy() for t in (q, k, v)])
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    s, bias = _case(np.random.default_rng(5), (4, 8, 64, 64), True)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = ms.forward(s, bias), ms.backward(ms.forward(s, bias), s)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    three = ms.forward(s, bias), ms.backward(ms.forward(s, bias), s)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(bits(a), bits(b))
