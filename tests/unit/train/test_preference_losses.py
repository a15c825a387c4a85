"""DPO-family losses against the papers' formulas written out independently in numpy."""

import numpy as np
import paddle
import pytest

from erniekit.errors import ConfigError
from erniekit.train.preference_losses import LOSS_TYPES, needs_reference, preference_loss, sequence_logps

B, BETA = 8, 0.3


def _np_logsig(x):
    return -np.logaddexp(0.0, -x)


def _np_sig(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    d = {
        "pw": -rng.uniform(1, 40, B),
        "pl": -rng.uniform(1, 40, B),  # summed policy log-probs
        "rw": -rng.uniform(1, 40, B),
        "rl": -rng.uniform(1, 40, B),  # summed reference log-probs
        "nw": rng.integers(1, 20, B).astype(np.float64),
        "nl": rng.integers(1, 20, B).astype(np.float64),
    }
    return d


def _run(loss_type, d, **kw):
    t = {k: paddle.to_tensor(v.astype("float32")) for k, v in d.items()}
    losses, cw, cl = preference_loss(
        loss_type,
        t["pw"],
        t["pl"],
        t["rw"],
        t["rl"],
        beta=kw.pop("beta", BETA),
        chosen_lengths=t["nw"],
        rejected_lengths=t["nl"],
        **kw,
    )
    return losses.numpy().astype(np.float64), cw.numpy(), cl.numpy()


def _reference(loss_type, d, ls=0.0, gamma=0.5, lam=50.0):
    """The formulas as printed in the papers / TRL, in float64 numpy."""
    b = BETA
    pw, pl, rw, rl = d["pw"], d["pl"], d["rw"], d["rl"]
    if loss_type in ("ipo", "simpo", "orpo"):  # length-averaged log-probs
        pw, rw, pl, rl = pw / d["nw"], rw / d["nw"], pl / d["nl"], rl / d["nl"]
    h = (pw - rw) - (pl - rl)
    if loss_type == "sigmoid":  # DPO eq. 7; cDPO (Mitchell 2023) for ls > 0
        return -(1 - ls) * _np_logsig(b * h) - ls * _np_logsig(-b * h)
    if loss_type == "hinge":  # SLiC-HF: max(0, delta - beta*h) with delta = 1
        return np.maximum(0.0, 1 - b * h)
    if loss_type == "ipo":  # IPO eq. 17: (h - 1/(2 tau))^2
        return (h - 1 / (2 * b)) ** 2
    if loss_type == "simpo":  # SimPO eq. 6: -log s(beta/|yw| log pi(yw) - beta/|yl| log pi(yl) - gamma)
        z = b * pw - b * pl - gamma
        return -(1 - ls) * _np_logsig(z) - ls * _np_logsig(-z)
    if loss_type == "orpo":  # ORPO eq. 6-7: odds(y) = P / (1 - P), P = exp(mean log-prob)
        odds_w, odds_l = np.exp(pw) / (1 - np.exp(pw)), np.exp(pl) / (1 - np.exp(pl))
        return -b * _np_logsig(np.log(odds_w / odds_l))
    if loss_type == "kto_pair":  # HALOs/KTO paired: KL of each half estimated from the other, batch mean
        kl_w, kl_l = max((pw - rw).mean(), 0), max((pl - rl).mean(), 0)
        halves = np.concatenate([1 - _np_sig(b * ((pw - rw) - kl_l)), 1 - _np_sig(b * (kl_w - (pl - rl)))])
        return halves  # TRL returns the 2B halves
    if loss_type == "sppo_hard":  # SPPO eq. 4.7 with P(win) = 1, P(lose) = 0
        return ((pw - rw) - 1 / (2 * b)) ** 2 + ((pl - rl) + 1 / (2 * b)) ** 2
    if loss_type == "nca_pair":  # NCA (Chen 2024) paired
        return -_np_logsig(b * (pw - rw)) - 0.5 * _np_logsig(-b * (pw - rw)) - 0.5 * _np_logsig(-b * (pl - rl))
    if loss_type == "dpop":  # Smaug eq. 3: -log s(beta (h - lambda max(0, log ref(yw)/pi(yw))))
        return -_np_logsig(b * (h - lam * np.maximum(0.0, rw - pw)))
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_matches_its_formula(loss_type, data):
    losses, _, _ = _run(loss_type, data)
    ref = _reference(loss_type, data)
    assert losses.shape == (B,)
    if loss_type == "kto_pair":  # per pair: mean of its two halves; batch mean equals TRL's mean over 2B
        np.testing.assert_allclose(losses, (ref[:B] + ref[B:]) / 2, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(losses.mean(), ref.mean(), rtol=2e-5)
    else:
        np.testing.assert_allclose(losses, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.1), ("simpo", 0.2)])
def test_label_smoothing(loss_type, ls, data):
    np.testing.assert_allclose(
        _run(loss_type, data, label_smoothing=ls)[0], _reference(loss_type, data, ls=ls), rtol=2e-5, atol=1e-6
    )


def test_loss_parameters(data):
    np.testing.assert_allclose(
        _run("simpo", data, simpo_gamma=1.7)[0], _reference("simpo", data, gamma=1.7), rtol=2e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        _run("dpop", data, dpop_lambda=5.0)[0], _reference("dpop", data, lam=5.0), rtol=2e-5, atol=1e-6
    )
    # the DPOP penalty only bites when the policy lowers the chosen log-prob below the reference
    d = dict(data, pw=data["rw"] + 1.0)
    np.testing.assert_allclose(_run("dpop", d)[0], _run("sigmoid", d)[0], rtol=1e-6)


def test_sigmoid_is_minus_log_sigmoid_of_the_scaled_margin(data):
    margin = (data["pw"] - data["rw"]) - (data["pl"] - data["rl"])
    losses, cw, cl = _run("sigmoid", data)
    np.testing.assert_allclose(losses, -np.log(_np_sig(BETA * margin)), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(cw, BETA * (data["pw"] - data["rw"]), rtol=1e-5)
    np.testing.assert_allclose(cl, BETA * (data["pl"] - data["rl"]), rtol=1e-5)
    np.testing.assert_allclose(cw - cl, BETA * margin, rtol=1e-4, atol=1e-4)


def test_reference_free_losses_reward_the_policy_average(data):
    _, cw, cl = _run("simpo", data)
    np.testing.assert_allclose(cw, BETA * data["pw"] / data["nw"], rtol=1e-5)
    np.testing.assert_allclose(cl, BETA * data["pl"] / data["nl"], rtol=1e-5)
    assert not needs_reference("simpo") and not needs_reference("orpo")
    assert needs_reference("sigmoid") and not needs_reference("sigmoid", reference_free=True)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_free_ignores_reference_inputs(loss_type, data):
    free = _run(loss_type, data, reference_free=True)
    other = _run(loss_type, dict(data, rw=data["rw"] * 3 + 1, rl=data["rl"] - 7), reference_free=True)
    zero = _reference(loss_type, dict(data, rw=np.zeros(B), rl=np.zeros(B)))
    if loss_type == "kto_pair":
        zero = (zero[:B] + zero[B:]) / 2
    for a, b in zip(free, other):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(free[0], zero, rtol=2e-5, atol=1e-6)
    t = {k: paddle.to_tensor(v.astype("float32")) for k, v in data.items()}
    none = preference_loss(
        loss_type,
        t["pw"],
        t["pl"],
        None,
        None,
        BETA,
        reference_free=True,
        chosen_lengths=t["nw"],
        rejected_lengths=t["nl"],
    )
    np.testing.assert_array_equal(none[0].numpy(), free[0].astype("float32"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradients_flow_to_the_policy_only(loss_type, data):
    pw = paddle.to_tensor(data["pw"].astype("float32") / 4, stop_gradient=False)  # /4 keeps hinge/dpop active
    pl = paddle.to_tensor(data["pl"].astype("float32") / 4, stop_gradient=False)
    rw = paddle.to_tensor(data["rw"].astype("float32") / 4)
    rl = paddle.to_tensor(data["rl"].astype("float32") / 4)
    losses, cw, cl = preference_loss(
        loss_type, pw, pl, rw, rl, BETA, chosen_lengths=data["nw"], rejected_lengths=data["nl"]
    )
    losses.mean().backward()
    for g in (pw.grad, pl.grad):
        assert g is not None and np.isfinite(g.numpy()).all() and np.abs(g.numpy()).sum() > 0
    assert cw.stop_gradient and cl.stop_gradient  # rewards are metrics


def test_bad_arguments(data):
    t = {k: paddle.to_tensor(v.astype("float32")) for k, v in data.items()}
    with pytest.raises(ConfigError, match="unknown loss_type 'dpo'"):
        preference_loss("dpo", t["pw"], t["pl"], t["rw"], t["rl"])
    with pytest.raises(ConfigError, match="label_smoothing applies"):
        preference_loss("hinge", t["pw"], t["pl"], t["rw"], t["rl"], label_smoothing=0.1)
    with pytest.raises(ConfigError, match="beta"):
        preference_loss("sigmoid", t["pw"], t["pl"], t["rw"], t["rl"], beta=0.0)
    with pytest.raises(ValueError, match="chosen_lengths"):
        preference_loss("ipo", t["pw"], t["pl"], t["rw"], t["rl"])
    with pytest.raises(ValueError, match="reference"):
        preference_loss("sigmoid", t["pw"], t["pl"])
    # inputs that are already averages
    avg = preference_loss(
        "ipo", t["pw"] / t["nw"], t["pl"] / t["nl"], t["rw"] / t["nw"], t["rl"] / t["nl"], BETA, length_normalize=False
    )[0]
    np.testing.assert_allclose(avg.numpy(), _reference("ipo", data), rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------ sequence log-probs
def _naive_logps(logits, labels, segment_ids=None):
    B_, S, _ = logits.shape
    total, count = np.zeros(B_), np.zeros(B_)
    for b in range(B_):
        for t in range(S - 1):
            y = labels[b, t + 1]
            if y == -100 or (segment_ids is not None and segment_ids[b, t + 1] != segment_ids[b, t]):
                continue
            row = logits[b, t].astype(np.float64)
            total[b] += row[y] - (np.log(np.exp(row - row.max()).sum()) + row.max())
            count[b] += 1
    return total, count


def test_sequence_logps_matches_a_per_token_loop():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 9, 13)).astype("float32") * 3
    labels = rng.integers(0, 13, size=(3, 9))
    labels[0, :4] = -100  # prompt
    labels[1, 6:] = -100  # padding
    labels[2, ::2] = -100
    x = paddle.to_tensor(logits, stop_gradient=False)
    logp, n = sequence_logps(x, labels)
    want, count = _naive_logps(logits, labels)
    np.testing.assert_allclose(logp.numpy(), want, rtol=1e-5)
    np.testing.assert_array_equal(n.numpy(), count)
    # paddle labels and packed segments too
    seg = np.repeat([[1] * 5 + [2] * 4], 3, axis=0)
    logp2, n2 = sequence_logps(x, paddle.to_tensor(labels), segment_ids=seg)
    want2, count2 = _naive_logps(logits, labels, seg)
    np.testing.assert_allclose(logp2.numpy(), want2, rtol=1e-5)
    np.testing.assert_array_equal(n2.numpy(), count2)
    # gradient reaches exactly the positions whose next token is trained
    logp.sum().backward()
    g = np.abs(x.grad.numpy()).sum(-1)
    np.testing.assert_array_equal(g[:, :-1] > 0, labels[:, 1:] != -100)
    assert (g[:, -1] == 0).all()
