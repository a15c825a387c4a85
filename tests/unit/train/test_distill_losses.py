"""The distillation losses (erniekit/train/distill_losses.py) against a naive float64 loop over
tokens, against TRL's published generalised-JSD computation (GKD) in torch, and their gradients
against torch autograd of the same formula."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from erniekit.train.distill_losses import distill_loss_sum, top_k, trained_positions

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _batch(seed: int = 0, B: int = 2, S: int = 7, V: int = 11):
    rng = np.random.default_rng(seed)
    zs = rng.normal(size=(B, S, V)).astype(np.float32) * 2
    zt = rng.normal(size=(B, S, V)).astype(np.float32) * 2
    labels = rng.integers(0, V, size=(B, S))
    labels[0, :3] = -100  # a prompt: not trained
    labels[1, -2:] = -100  # padding
    segs = np.ones((B, S), dtype=np.int64)
    segs[1, 3:] = 2  # two packed documents: position 2 -> 3 crosses them
    return zs, zt, labels, segs


def _naive(zs, zt, labels, segs, kind, beta, T) -> float:
    """One position at a time, in float64, from the definitions."""
    total = 0.0
    B, S, V = zs.shape
    for b in range(B):
        for t in range(S - 1):
            if labels[b, t + 1] == -100 or segs[b, t + 1] != segs[b, t]:
                continue
            ps = np.exp(zs[b, t] / T - np.logaddexp.reduce(zs[b, t] / T))
            pt = np.exp(zt[b, t] / T - np.logaddexp.reduce(zt[b, t] / T))

            def kl(p, q):
                return float(np.sum(p * (np.log(p) - np.log(q))))

            if kind == "forward_kl" or (kind == "jsd" and beta == 0):
                d = kl(pt, ps)
            elif kind == "reverse_kl" or (kind == "jsd" and beta == 1):
                d = kl(ps, pt)
            else:
                m = (1 - beta) * ps + beta * pt
                d = beta * kl(pt, m) + (1 - beta) * kl(ps, m)
            total += T * T * d
    return total


@pytest.mark.parametrize(
    "kind, beta, T",
    [
        ("forward_kl", 0.5, 1.0),
        ("forward_kl", 0.5, 2.0),
        ("reverse_kl", 0.5, 1.0),
        ("reverse_kl", 0.5, 0.7),
        ("jsd", 0.5, 1.0),
        ("jsd", 0.1, 1.5),
        ("jsd", 0.9, 1.0),
        ("jsd", 0.0, 1.0),
        ("jsd", 1.0, 1.0),
    ],
)
def test_losses_equal_a_naive_loop_over_positions(kind, beta, T):
    zs, zt, labels, segs = _batch()
    got = float(distill_loss_sum(paddle.to_tensor(zs), labels, paddle.to_tensor(zt), kind, beta, T, segs))
    assert got == pytest.approx(_naive(zs, zt, labels, segs, kind, beta, T), rel=1e-5)


def _trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature):
    """TRL's GKDTrainer.generalized_jsd_loss (trl/trainer/gkd_trainer.py), reduction 'sum' over
    the positions with labels != -100 (labels already aligned with the logits)."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log(1 - beta_t), teacher_log_probs + torch.log(beta_t)]), dim=0
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    mask = labels != -100
    return jsd[mask].sum()


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_jsd_is_trls_gkd_loss_times_t_squared_with_the_same_gradient(beta, T):
    zs, zt, labels, _ = _batch(1)
    aligned = np.full_like(labels, -100)
    aligned[:, :-1] = labels[:, 1:]  # TRL's labels sit at the predicting position
    xs = torch.tensor(zs, requires_grad=True)
    ref = _trl_generalized_jsd(xs, torch.tensor(zt), torch.tensor(aligned), beta, T) * T * T
    ref.backward()
    ps = paddle.to_tensor(zs, stop_gradient=False)
    got = distill_loss_sum(ps, labels, paddle.to_tensor(zt), "jsd", beta, T)
    got.backward()
    assert float(got) == pytest.approx(float(ref), rel=1e-5)
    np.testing.assert_allclose(ps.grad.numpy(), xs.grad.numpy(), atol=1e-5)


def test_teacher_gets_no_gradient_and_equal_distributions_cost_nothing():
    zs, zt, labels, _ = _batch(2)
    s = paddle.to_tensor(zs, stop_gradient=False)
    t = paddle.to_tensor(zt, stop_gradient=False)
    distill_loss_sum(s, labels, t, "jsd", 0.5, 1.0).backward()
    assert t.grad is None and s.grad is not None
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert float(distill_loss_sum(paddle.to_tensor(zs), labels, paddle.to_tensor(zs), kind)) == pytest.approx(
            0.0, abs=1e-5
        )


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_top_k_teacher_is_exact_at_full_k_and_equals_bucketed_definition_below(kind):
    zs, zt, labels, segs = _batch(3)
    flat = trained_positions(labels, segs)
    teacher_rows = paddle.to_tensor(zt.reshape(-1, zt.shape[-1])[flat])
    full = distill_loss_sum(paddle.to_tensor(zs), labels, paddle.to_tensor(zt), kind, 0.4, 1.5, segs)
    every = distill_loss_sum(paddle.to_tensor(zs), labels, top_k(teacher_rows, zt.shape[-1], 1.5), kind, 0.4, 1.5, segs)
    assert float(every) == pytest.approx(float(full), rel=1e-4)
    k = 3
    cached = top_k(teacher_rows, k, 1.5)
    got = float(distill_loss_sum(paddle.to_tensor(zs), labels, cached, kind, 0.4, 1.5, segs))
    # the definition: both distributions over {the teacher's k tokens, the rest}
    want = 0.0
    for row, pos in enumerate(flat):
        b, t = divmod(int(pos), zs.shape[1])
        ps = np.exp(zs[b, t] / 1.5 - np.logaddexp.reduce(zs[b, t] / 1.5))
        pt = np.exp(zt[b, t] / 1.5 - np.logaddexp.reduce(zt[b, t] / 1.5))
        ids = cached.ids[row]
        assert set(ids) == set(np.argsort(-pt)[:k])
        bs = np.append(ps[ids], 1 - ps[ids].sum())
        bt = np.append(pt[ids], 1 - pt[ids].sum())
        kl = lambda p, q: float(np.sum(p * (np.log(p) - np.log(q))))  # noqa: E731
        if kind == "forward_kl":
            d = kl(bt, bs)
        elif kind == "reverse_kl":
            d = kl(bs, bt)
        else:
            m = 0.6 * bs + 0.4 * bt
            d = 0.4 * kl(bt, m) + 0.6 * kl(bs, m)
        want += 1.5**2 * d
    assert got == pytest.approx(want, rel=1e-4)


def test_a_cache_for_other_data_is_refused():
    zs, zt, labels, _ = _batch(4)
    wrong = top_k(paddle.to_tensor(zt.reshape(-1, zt.shape[-1])[:3]), 2)
    with pytest.raises(ValueError, match="rebuild the cache"):
        distill_loss_sum(paddle.to_tensor(zs), labels, wrong)


def test_no_trained_position_is_a_zero_loss_that_still_backpropagates():
    zs, zt, labels, _ = _batch(5)
    labels[:] = -100
    s = paddle.to_tensor(zs, stop_gradient=False)
    loss = distill_loss_sum(s, labels, paddle.to_tensor(zt))
    loss.backward()
    assert float(loss) == 0.0 and not math.isnan(float(s.grad.sum()))
