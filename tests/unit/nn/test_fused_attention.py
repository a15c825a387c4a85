"""The CPU attention in one C kernel each way (erniekit/nn/fused_attention.py, kernels/attention.c):
forward and gradients against the formula in float64 and against the math path (Paddle's GEMMs and
the masked softmax), GQA, masks, KV offsets and row counts that do not fill a block, the same bits
on any thread count, and which inputs take it."""

import numpy as np
import paddle
import pytest

from erniekit.nn import fused_attention as fa
from erniekit.nn import kernel_memory
from erniekit.nn.attention import math_attention

KERNEL_MODULE = fa

NEG = np.float32(-1e30)  # additive_mask's "may not attend"

# B, Sq, Sk, H, KVH, D, bias batched: GQA 2 / 3 / 1 query heads per kv head; Sq not a multiple of
# the kernel's 4-row blocks; Sk not a multiple of 16; a decode row over a cache; heads of 16-128
CASES = [
    (2, 5, 5, 4, 2, 16, False),
    (3, 7, 37, 6, 2, 32, True),
    (2, 1, 23, 3, 3, 16, True),
    (1, 16, 16, 8, 4, 64, False),
    (2, 9, 40, 2, 1, 128, True),
    (2, 3, 19, 4, 2, 80, True),  # with AVX-512 the values' passes: one of 64 columns, then one of 16
]


def _inputs(case, seed=0):
    B, Sq, Sk, H, KVH, D, batched = case
    rng = np.random.default_rng(seed + Sq + Sk + D)
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    k = rng.standard_normal((B, Sk, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, Sk, KVH, D)).astype(np.float32)
    bias = np.zeros((B if batched else 1, 1, Sq, Sk), np.float32)
    causal = np.arange(Sq)[:, None] + (Sk - Sq) < np.arange(Sk)[None, :]  # queries are the last Sq
    bias[:, :, causal] = NEG
    if batched:
        bias[0, :, :, : Sk // 3] = NEG  # row 0's first keys are padding
        bias[0, :, np.arange(Sq), np.arange(Sk - Sq, Sk)] = 0  # each query still sees itself
    do = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    return q, k, v, bias, do


def _reference(q, k, v, bias, do, scale):
    """The formula in float64: o = softmax(q k^T * scale + bias) v, each query head on its kv head."""
    q, k, v, bias, do = (a.astype(np.float64) for a in (q, k, v, bias, do))
    rep = q.shape[2] // k.shape[2]
    kh, vh = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q * scale, kh) + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bjhd->bihd", p, vh)
    dp = np.einsum("bihd,bjhd->bhij", do, vh)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = np.einsum("bhij,bjhd->bihd", ds, kh) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q * scale)
    dv = np.einsum("bhij,bihd->bjhd", p, do)
    fold = lambda g: g.reshape(g.shape[0], g.shape[1], -1, rep, g.shape[3]).sum(3)  # noqa: E731
    return o, dq, fold(dk), fold(dv)


def _run(q, k, v, bias, do, scale, fused=True):
    qt, kt, vt = (paddle.to_tensor(a, stop_gradient=False) for a in (q, k, v))
    bt = paddle.to_tensor(bias)
    if fused:
        assert fa.usable(qt, kt, vt, bt)
        o = fa.fused_attention(qt, kt, vt, bt, scale)
    else:
        o = math_attention(qt, kt, vt, bt, scale)
    o.backward(paddle.to_tensor(do))
    return [o.numpy()] + [t.grad.numpy() for t in (qt, kt, vt)]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_follow_the_formula(kernel, case):
    q, k, v, bias, do = _inputs(case)
    scale = case[5] ** -0.5
    got = _run(q, k, v, bias, do, scale)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, _reference(q, k, v, bias, do, scale)):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_it_agrees_with_the_math_path(kernel, monkeypatch, case):
    q, k, v, bias, do = _inputs(case, seed=1)
    scale = case[5] ** -0.5
    fused = _run(q, k, v, bias, do, scale)
    monkeypatch.setattr(fa, "usable", lambda *_: False)
    plain = _run(q, k, v, bias, do, scale, fused=False)
    for name, a, b in zip(("o", "dq", "dk", "dv"), fused, plain):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)


def test_masked_keys_take_no_part(kernel):
    """Values behind the mask cannot change the output or receive gradient."""
    case = (2, 6, 20, 4, 2, 16, True)
    q, k, v, bias, do = _inputs(case)
    v2 = v.copy()
    v2[0, : 20 // 3] = 1e3  # row 0's padded keys
    a, b = _run(q, k, v, bias, do, 0.25), _run(q, k, v2, bias, do, 0.25)
    np.testing.assert_array_equal(a[0], b[0])
    assert (a[3][0, : 20 // 3] == 0).all() and (a[2][0, : 20 // 3] == 0).all()


def test_skipping_masked_key_blocks_changes_no_bit(kernel, bits):
    """Key blocks every row of a block masks (-1e30, as additive_mask writes) are skipped; a mask of
    -1e29 is not recognised, so the same attention then runs over every key: the same bits."""
    case = (2, 40, 40, 4, 2, 16, True)
    q, k, v, bias, do = _inputs(case)
    loose = np.where(bias <= NEG, np.float32(-1e29), bias).astype(np.float32)
    skipped, full = _run(q, k, v, bias, do, 0.25), _run(q, k, v, loose, do, 0.25)
    for a, b in zip(skipped, full):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_inference_gives_the_training_forward_bits(kernel, bits):
    """Without gradients the probabilities stay in scratch rows; the output is the same."""
    q, k, v, bias, _ = _inputs(CASES[1])
    with paddle.no_grad():
        infer = fa.fused_attention(*(paddle.to_tensor(a) for a in (q, k, v, bias)), 0.125)
    qt = paddle.to_tensor(q, stop_gradient=False)
    train = fa.fused_attention(qt, *(paddle.to_tensor(a) for a in (k, v, bias)), 0.125)
    np.testing.assert_array_equal(bits(infer), bits(train))


@pytest.mark.parametrize("rep", [1, 3, 4, 5, 8])  # query heads per kv head: blocks of 4 heads, full or not
def test_a_decode_row_gives_the_bits_of_a_row_of_a_longer_query(kernel, bits, monkeypatch, rep):
    """A decode step (one query row) runs its query heads as one block's rows; a query of two equal
    rows runs them one head at a time. Row 0 of the latter must be the former, bit for bit: outputs,
    probabilities and softmax statistics, with padding, a fully masked row and a per-row mask."""
    rng = np.random.default_rng(rep)
    B, Sk, KVH, D = 3, 41, 2, 32
    H = KVH * rep
    q1 = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Sk, KVH, D)).astype(np.float32) for _ in range(2))
    bias1 = rng.standard_normal((B, 1, 1, Sk)).astype(np.float32)
    bias1[0, ..., :17] = NEG  # padding over a whole key block and part of the next
    bias1[1] = NEG  # a row that may see nothing
    q2 = np.repeat(q1, 2, axis=1)

    def both(row_bias):
        one = fa._forward(*(paddle.to_tensor(a) for a in (q1, k, v, row_bias)), 0.125, keep=True)
        two = fa._forward(*(paddle.to_tensor(a) for a in (q2, k, v, np.repeat(row_bias, 2, axis=2))), 0.125, keep=True)
        np.testing.assert_array_equal(bits(one[0].numpy()), bits(two[0].numpy()[:, :1]))
        return one, two

    for row_bias in (bias1, bias1[:1]):  # batched and shared
        one, two = both(row_bias)
        assert one[1] is not None  # the probabilities are kept at these sizes
        np.testing.assert_array_equal(bits(one[1].numpy()), bits(two[1].numpy()[:, :, :1]))
    monkeypatch.setattr(kernel_memory, "keeps_probs", lambda *_: False)  # long rows: softmax statistics
    one, two = both(bias1)
    np.testing.assert_array_equal(bits(one[2].numpy()), bits(two[2].numpy()[:, :, :1]))


def test_threads_do_not_change_the_bits(kernel, bits, monkeypatch):
    case = (4, 64, 64, 4, 2, 32, True)  # big enough to be cut over the threads
    q, k, v, bias, do = _inputs(case)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _run(q, k, v, bias, do, 32**-0.5)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    three = _run(q, k, v, bias, do, 32**-0.5)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_an_input_changed_in_place_after_the_forward_is_refused(kernel):
    q, k, v, bias, do = _inputs(CASES[0])
    qt, kt, vt = (paddle.to_tensor(a, stop_gradient=False) for a in (q, k, v))
    o = fa.fused_attention(qt, kt, vt, paddle.to_tensor(bias), 0.25)
    with paddle.no_grad():
        paddle.assign(kt * 2, output=kt)
    with pytest.raises((RuntimeError, OSError), match="attention: an input was modified in place"):
        o.backward(paddle.to_tensor(do))


def test_only_shapes_the_kernel_handles_take_it(kernel):
    q, k, bias = paddle.zeros([2, 3, 4, 16]), paddle.zeros([2, 5, 2, 16]), paddle.zeros([1, 1, 3, 5])
    assert fa.usable(q, k, k, bias) and fa.usable(q, k, k, paddle.zeros([2, 1, 3, 5]))
    assert not fa.usable(paddle.zeros([2, 3, 4, 8]), paddle.zeros([2, 5, 2, 8]), paddle.zeros([2, 5, 2, 8]), bias)
    assert not fa.usable(paddle.zeros([2, 3, 3, 16]), k, k, bias)  # 3 query heads over 2 kv heads
    assert not fa.usable(q, k, k, paddle.zeros([2, 4, 3, 5]))  # a per-head mask
    assert not fa.usable(q.astype("bfloat16"), k.astype("bfloat16"), k.astype("bfloat16"), bias)


def test_without_the_kernel_the_math_path_runs(monkeypatch):
    monkeypatch.setattr(fa, "_kernels", lambda: None)
    q, k, bias = paddle.zeros([2, 3, 4, 16]), paddle.zeros([2, 5, 2, 16]), paddle.zeros([1, 1, 3, 5])
    assert not fa.usable(q, k, k, bias)
    assert math_attention(q, k, k, bias, 0.25).shape == [2, 3, 4, 16]


@pytest.mark.parametrize(
    "case,sharp", [(c, 1.0) for c in CASES] + [((2, 33, 70, 4, 2, 16, True), 1.0), (CASES[3], 60.0)]
)
def test_long_rows_keep_softmax_statistics_and_give_the_same_bits(kernel, bits, monkeypatch, case, sharp):
    """Above kernel_memory.KEEP_PROBS_BYTES the forward keeps 2 floats a row instead of the
    probabilities and the backward computes them again: the same output and gradients, bit for bit.
    `sharp` scales q so that probabilities inside the mask underflow to 0: the saved path then skips
    keys the recomputing one (which reads the mask) does not."""
    q, k, v, bias, do = _inputs(case)
    q = (q * sharp).astype(np.float32)
    kept, forward = [], fa._forward

    def spy(*a, **kw):
        out = forward(*a, **kw)
        kept.append(out[1:])
        return out

    monkeypatch.setattr(fa, "_forward", spy)
    saved = _run(q, k, v, bias, do, 0.25)
    monkeypatch.setattr(kernel_memory, "KEEP_PROBS_BYTES", 0)
    again = _run(q, k, v, bias, do, 0.25)
    B, Sq, H = case[0], case[1], case[3]
    (p, none), (none2, stats) = kept[0], kept[-1]
    assert none is None and none2 is None
    assert p.shape == [B, H, Sq, case[2]] and stats.shape == [B, H, Sq, 2]
    for name, a, b in zip(("o", "dq", "dk", "dv"), saved, again):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


def test_which_calls_keep_the_probabilities():
    limit = kernel_memory.KEEP_PROBS_BYTES
    assert kernel_memory.keeps_probs(1, 1, 1, limit // 4)
    assert not kernel_memory.keeps_probs(1, 1, 1, limit // 4 + 1)
    assert kernel_memory.keeps_probs(64, 8, 32, 32)  # the embedded default: 2 MiB a layer
    assert not kernel_memory.keeps_probs(1, 16, 4096, 4096)  # 1 GiB a layer


def test_the_statistics_path_refuses_a_mask_changed_in_place(kernel, monkeypatch):
    """The backward reads the mask again to find the forward's keys; a changed mask is refused."""
    monkeypatch.setattr(kernel_memory, "KEEP_PROBS_BYTES", 0)
    q, k, v, bias, do = _inputs(CASES[1])
    qt, kt, vt = (paddle.to_tensor(a, stop_gradient=False) for a in (q, k, v))
    bt = paddle.to_tensor(bias)
    o = fa.fused_attention(qt, kt, vt, bt, 0.25)
    with paddle.no_grad():
        paddle.assign(bt * 0, output=bt)
    with pytest.raises((RuntimeError, OSError), match="attention: an input was modified in place"):
        o.backward(paddle.to_tensor(do))


@pytest.mark.parametrize("scale_of", ["default", "other"])
def test_sdpa_path_leaves_the_default_scale_unnamed_and_matches_the_math(monkeypatch, scale_of):
    """The GPU path (nn/attention.attention, Paddle's SDPA): naming the default 1/sqrt(D) would rule
    flash attention out, so it is passed as None; another scale is passed as it is. Either way the
    output is softmax(q k^T * scale) v, checked here on the CPU against math_attention."""
    import paddle.nn.functional as F

    from erniekit.nn import attention as A

    rng = np.random.default_rng(0)
    q, k, v = (paddle.to_tensor(rng.standard_normal((2, 5, h, 16)).astype("float32")) for h in (4, 2, 2))
    scale = 0.25 if scale_of == "default" else 0.1
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(kw["scale"]) or real(*a, **kw))
    got = A.attention(q, k, v, None, True, scale)
    assert seen == [None if scale_of == "default" else 0.1]
    bias = A.additive_mask(None, 5, 5, paddle.float32)
    want = math_attention(q, k, v, bias, scale)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wants", [(True, False, False), (True, False, True), (False, True, False)])
def test_inputs_without_a_gradient_get_none(kernel, wants):
    """LoRA on q_proj alone (or q and v, PEFT's classic targets) over a frozen first layer: k (and v)
    take no gradient, and Paddle refused the kernel's gradient for them at the first backward. Those
    that want one get the formula's."""
    q, k, v, bias, do = _inputs(CASES[1])
    ts = [paddle.to_tensor(a, stop_gradient=not want) for a, want in zip((q, k, v), wants)]
    o = fa.fused_attention(*ts, paddle.to_tensor(bias), 0.25)
    o.backward(paddle.to_tensor(do))
    ref = _reference(q, k, v, bias, do, 0.25)
    for t, want, r in zip(ts, wants, ref[1:]):
        if want:
            np.testing.assert_allclose(t.grad.numpy(), r, rtol=2e-4, atol=2e-4)
        else:
            assert t.grad is None
