"""The LM head and its cross entropy in chunks of rows (erniekit/nn/linear_cross_entropy.py): the
same per-row losses as the head's logits through the cross-entropy kernel, gradients of the hidden
states and of the weight (tied [V, H] or a Linear's [H, V]) as autograd gives them on the whole
logits and against a float64 formula, for a sum and for row weights, and never more than a chunk's
logits at once."""

import numpy as np
import paddle
import pytest

from erniekit.nn import cross_entropy as ce
from erniekit.nn import kernel_memory
from erniekit.nn import linear_cross_entropy as lce

IGNORE = -100


def _case(seed, N=40, H=16, V=50, vocab_first=True):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((N, H)).astype(np.float32)
    w = (rng.standard_normal((V, H) if vocab_first else (H, V)) * 0.5).astype(np.float32)
    label = rng.integers(0, V, N)
    label[rng.random(N) < 0.2] = IGNORE
    return h, w, label


def _unfused(h, w, label, vocab_first, weights=None):
    ht, wt = paddle.to_tensor(h, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    nll = ce.softmax_cross_entropy(paddle.matmul(ht, wt, transpose_y=vocab_first), label, IGNORE)
    loss = nll.sum() * 0.37 if weights is None else (nll * paddle.to_tensor(weights)).sum()
    loss.backward()
    return nll.numpy(), ht.grad.numpy(), wt.grad.numpy()


def _fused(h, w, label, vocab_first, weights=None, rows=None, w_frozen=False):
    ht, wt = paddle.to_tensor(h, stop_gradient=False), paddle.to_tensor(w, stop_gradient=w_frozen)
    nll = lce.linear_cross_entropy(ht, wt, label, IGNORE, vocab_first, rows)
    loss = nll.sum() * 0.37 if weights is None else (nll * paddle.to_tensor(weights)).sum()
    loss.backward()
    return nll.numpy(), ht.grad.numpy(), None if w_frozen else wt.grad.numpy()


def _formula(h, w, label, vocab_first, g):
    """float64: nll per row, d/dh and d/dw of sum(g * nll)."""
    h64, w64 = h.astype(np.float64), w.astype(np.float64)
    W = w64 if vocab_first else w64.T  # [V, H]
    z = h64 @ W.T
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    keep = label != IGNORE
    nll = np.where(keep, lse - z[np.arange(len(z)), np.where(keep, label, 0)], 0.0)
    dz = np.exp(z - lse[:, None])
    dz[keep, label[keep]] -= 1.0
    dz *= (g * keep)[:, None]
    dW = dz.T @ h64
    return nll, dz @ W, dW if vocab_first else dW.T


@pytest.mark.parametrize("vocab_first", [True, False])
@pytest.mark.parametrize("rows", [None, 16, 7])
@pytest.mark.parametrize("weighted", [False, True])
def test_losses_and_gradients_are_the_unfused_heads(vocab_first, rows, weighted):
    h, w, label = _case(3, vocab_first=vocab_first)
    weights = np.random.default_rng(4).random(len(h)).astype(np.float32) if weighted else None
    got, want = _fused(h, w, label, vocab_first, weights, rows), _unfused(h, w, label, vocab_first, weights)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    g = weights.astype(np.float64) if weighted else np.full(len(h), 0.37)
    for a, b in zip(got, _formula(h, w, label, vocab_first, g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_one_chunk_gives_the_unfused_losses_bit_for_bit(bits):
    h, w, label = _case(5, N=64, V=300)
    got, want = _fused(h, w, label, True), _unfused(h, w, label, True)
    np.testing.assert_array_equal(bits(got[0]), bits(want[0]))


def test_no_chunk_holds_more_rows_than_asked(monkeypatch):
    seen = []
    real = lce._logits
    monkeypatch.setattr(lce, "_logits", lambda h, w, f: seen.append(h.shape[0]) or real(h, w, f))
    h, w, label = _case(6, N=50)
    _fused(h, w, label, True, np.linspace(0.1, 1, 50).astype(np.float32), rows=16)  # row weights: recomputed
    assert seen == [16, 16, 16, 2] * 2  # forward, then the weighted backward's recompute
    seen.clear()
    _fused(h, w, label, True, rows=16)  # a sum: the backward scales what the forward kept
    assert seen == [16, 16, 16, 2]


@pytest.mark.parametrize("vocab_first", [True, False])
def test_the_chunks_add_into_one_weight_gradient_in_place(monkeypatch, vocab_first):
    """With MKL at hand each chunk's dW product adds into the same buffer (beta 0, then 1): no [V, H]
    temporary per chunk; one chunk gives Paddle's matmul bit for bit."""
    from erniekit.nn import grouped_gemm

    if not grouped_gemm.usable(paddle.zeros([2, 2]), [paddle.zeros([2, 2])]):
        pytest.skip("no MKL sgemm here")
    calls, real = [], grouped_gemm.gemm_into
    monkeypatch.setattr(
        grouped_gemm,
        "gemm_into",
        lambda a, b, out, **kw: calls.append((out.data_ptr(), kw["beta"])) or real(a, b, out, **kw),
    )
    h, w, label = _case(9, N=50, vocab_first=vocab_first)
    got = _fused(h, w, label, vocab_first, rows=16)
    assert [b for _, b in calls] == [0.0, 1.0, 1.0, 1.0] and len({p for p, _ in calls}) == 1
    np.testing.assert_allclose(got[2], _unfused(h, w, label, vocab_first)[2], rtol=2e-5, atol=2e-6)
    calls.clear()
    one = _fused(h, w, label, vocab_first)
    monkeypatch.setattr(grouped_gemm, "usable", lambda *_: False)  # Paddle's matmul
    np.testing.assert_array_equal(one[2], _fused(h, w, label, vocab_first)[2])


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_still_do():
    h, w, label = _case(7)
    got = _fused(h, w, label, True, w_frozen=True)
    want = _unfused(h, w, label, True)
    assert got[2] is None
    np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=2e-6)


def test_without_gradients_it_only_computes_the_losses():
    h, w, label = _case(8)
    with paddle.no_grad():
        got = lce.linear_cross_entropy(paddle.to_tensor(h), paddle.to_tensor(w), label, IGNORE, True, 16)
    np.testing.assert_allclose(got.numpy(), _unfused(h, w, label, True)[0], rtol=2e-6, atol=1e-6)


def test_labels_outside_the_vocabulary_or_miscounted_are_refused():
    h, w, label = _case(9)
    bad = label.copy()
    bad[3] = 50
    with pytest.raises(ValueError, match="label 50 is outside the vocabulary of 50"):
        lce.linear_cross_entropy(paddle.to_tensor(h), paddle.to_tensor(w), bad, IGNORE, True)
    with pytest.raises(ValueError, match="39 labels for 40 rows"):
        lce.linear_cross_entropy(paddle.to_tensor(h), paddle.to_tensor(w), label[:-1], IGNORE, True)


def test_chunks_are_bounded_by_bytes_but_never_below_the_minimum():
    assert lce.chunk_rows(1024, 100) == 100  # one chunk when the rows fit
    assert lce.chunk_rows(1024, 10**6) == kernel_memory.CHUNK_BYTES // (4 * 1024)
    assert lce.chunk_rows(103424, 10**6) == kernel_memory.MIN_CHUNK_ROWS
    assert lce.usable(paddle.zeros([4, 8]), paddle.zeros([16, 8]))
    assert not lce.usable(paddle.zeros([4, 8], dtype="float16"), paddle.zeros([16, 8]))
