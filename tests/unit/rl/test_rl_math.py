"""RL formulas against straightforward reference computations: group advantages, GAE, the clipped
objective, k3 KL, value clipping, aggregation and per-token log-probs."""

import math
import statistics

import numpy as np
import paddle
import pytest

from erniekit.rl.advantages import gae, group_advantages
from erniekit.rl.losses import aggregate, clipped_surrogate, clipped_value_loss, k3_kl, token_entropy, units
from erniekit.train.losses import token_logps


def test_group_advantages_match_a_loop():
    rng = np.random.default_rng(0)
    G = 4
    r = rng.integers(0, 3, size=5 * G).astype(float)
    r[:G] = 1.0  # one group with zero variance
    adv, std = group_advantages(r, G, scale=True)
    adv0, _ = group_advantages(r, G, scale=False)
    for g in range(5):
        grp = list(r[g * G : (g + 1) * G])
        mean, sd = statistics.mean(grp), statistics.stdev(grp)  # sample std, as TRL
        for i in range(G):
            assert adv[g * G + i] == pytest.approx((grp[i] - mean) / (sd + 1e-4))
            assert adv0[g * G + i] == pytest.approx(grp[i] - mean)
            assert std[g * G + i] == pytest.approx(sd)
    assert np.all(adv[:G] == 0)


def test_gae_matches_the_reverse_recursion():
    rng = np.random.default_rng(1)
    B, N, gamma, lam = 3, 6, 0.9, 0.8
    lengths = [6, 3, 1]
    mask = np.array([[1] * n + [0] * (N - n) for n in lengths], np.float32)
    rewards = rng.normal(size=(B, N)) * mask
    values = rng.normal(size=(B, N))
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            v_next = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            last = delta + gamma * lam * last
            assert adv[b, t] == pytest.approx(last, abs=1e-9)
            assert ret[b, t] == pytest.approx(last + values[b, t], abs=1e-9)
        assert np.all(adv[b, n:] == 0) and np.all(ret[b, n:] == 0)


def _reference_surrogate(logp, old, adv, lo, hi):
    out = np.zeros_like(logp)
    clipped = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        a = adv[idx[0], 0]
        ratio = math.exp(logp[idx] - old[idx])
        unclipped_obj = ratio * a
        clip_obj = min(max(ratio, 1 - lo), 1 + hi) * a
        out[idx] = -min(unclipped_obj, clip_obj)
        clipped[idx] = float((a > 0 and ratio > 1 + hi) or (a < 0 and ratio < 1 - lo))
    return out, clipped


def test_clipped_surrogate_matches_the_formula_with_clip_higher():
    rng = np.random.default_rng(2)
    logp = rng.normal(-1, 0.5, size=(4, 5)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, size=logp.shape)).astype(np.float32)
    adv = np.array([[1.5], [-0.7], [0.3], [-2.0]], np.float32)
    ref, ref_clip = _reference_surrogate(logp, old, adv, 0.2, 0.28)
    loss, ratio, clipped = clipped_surrogate(
        paddle.to_tensor(logp), paddle.to_tensor(old), paddle.to_tensor(adv), 0.2, 0.28
    )
    np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ratio.numpy(), np.exp(logp - old), rtol=1e-5)
    np.testing.assert_array_equal(clipped.numpy(), ref_clip)
    assert 0 < ref_clip.sum() < ref_clip.size  # the case exercises both clipped and unclipped tokens


def test_clipped_surrogate_gradient_vanishes_only_where_clipped():
    logp = paddle.to_tensor(np.log(np.array([[1.5, 0.5, 1.1]], np.float32)), stop_gradient=False)
    old = paddle.zeros([1, 3])
    loss, _, clipped = clipped_surrogate(logp, old, paddle.to_tensor([[1.0]]), 0.2, 0.2)
    loss.sum().backward()
    g = logp.grad.numpy()[0]
    # ratio 1.5 > 1.2 with A > 0: clipped, no gradient; 0.5 and 1.1: gradient -ratio * A
    np.testing.assert_allclose(g, [0.0, -0.5, -1.1], rtol=1e-5)
    np.testing.assert_array_equal(clipped.numpy()[0], [1, 0, 0])


def test_k3_kl_is_the_formula_and_unbiased_for_kl():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    tokens = rng.choice(6, size=400_000, p=p)
    logp, logq = np.log(p[tokens]).astype(np.float32), np.log(q[tokens]).astype(np.float32)
    k3 = k3_kl(paddle.to_tensor(logp), paddle.to_tensor(logq)).numpy()
    np.testing.assert_allclose(
        k3[:50], np.exp(logq[:50] - logp[:50]) - (logq[:50] - logp[:50]) - 1, rtol=1e-5, atol=1e-7
    )
    assert k3.min() >= 0
    true_kl = float((p * np.log(p / q)).sum())
    assert k3.mean() == pytest.approx(true_kl, rel=0.03)


def test_clipped_value_loss_matches_the_formula():
    v = np.array([1.0, 0.0, 2.0, -1.0], np.float32)
    old = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    ret = np.array([2.0, 0.2, 0.0, 1.0], np.float32)
    c = 0.2
    vc = old + np.clip(v - old, -c, c)
    ref = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    out = clipped_value_loss(*(paddle.to_tensor(a) for a in (v, old, ret)), clip=c).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_aggregation_token_and_sequence():
    per = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    tok = float(aggregate(paddle.to_tensor(per), paddle.to_tensor(mask), "token")) / units(mask, "token")
    seq = float(aggregate(paddle.to_tensor(per), paddle.to_tensor(mask), "sequence")) / units(mask, "sequence")
    assert tok == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert seq == pytest.approx(((1 + 2 + 3) / 3 + 4) / 2)


def test_token_logps_and_entropy_match_log_softmax():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    targets = np.array([[1, -100, 6], [0, 2, -100]], np.int64)
    T = 0.7
    z = logits / T
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref = np.where(targets >= 0, np.take_along_axis(logsm, np.maximum(targets, 0)[..., None], -1)[..., 0], 0.0)
    np.testing.assert_allclose(token_logps(paddle.to_tensor(logits), targets, T).numpy(), ref, rtol=1e-5, atol=1e-6)
    ent = -(np.exp(logsm) * logsm).sum(-1)
    np.testing.assert_allclose(token_entropy(paddle.to_tensor(logits), T).numpy(), ent, rtol=1e-5)
