"""MoE layer: dispatch, capacity dropping, router losses, bias correction, elastic masking, GPAS.

Every value is checked against a direct (loop or numpy) computation of its formula.
"""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.nn.gpas import GPAS
from erniekit.nn.moe import (
    MoEBlock,
    StackedExperts,
    TopKRouter,
    capacity_keep,
    expert_capacity,
    load_balancing_loss,
    router_orthogonal_loss,
    router_z_loss,
)


def _silu(x):
    return x / (1 + np.exp(-x))


def _naive_experts(x, topk_idx, topk_w, experts, keep=None):
    """Loop over tokens and slots: y_t = sum_k w_tk * expert_{e_tk}(x_t)."""
    g, u, d = (getattr(experts, p).numpy() for p in StackedExperts.PROJS)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(topk_idx.shape[1]):
            if keep is not None and not keep[t, s]:
                continue
            e = topk_idx[t, s]
            h = _silu(x[t] @ g[e]) * (x[t] @ u[e])
            y[t] += topk_w[t, s] * (h @ d[e])
    return y


def test_grouped_dispatch_matches_token_loop():
    paddle.seed(0)
    ex = StackedExperts(4, 16, 8)
    for p in StackedExperts.PROJS:
        getattr(ex, p).set_value(paddle.randn(getattr(ex, p).shape) * 0.3)
    x = paddle.randn([13, 16])
    idx = paddle.to_tensor(np.random.RandomState(0).randint(0, 4, size=(13, 2)).astype("int64"))
    w = paddle.rand([13, 2])
    ref = _naive_experts(x.numpy(), idx.numpy(), w.numpy(), ex)
    np.testing.assert_allclose(ex(x, idx, w).numpy(), ref, rtol=1e-5, atol=1e-5)
    keep = np.random.RandomState(1).rand(13, 2) > 0.4
    got = ex(x, idx, w, paddle.to_tensor(keep))
    np.testing.assert_allclose(
        got.numpy(), _naive_experts(x.numpy(), idx.numpy(), w.numpy(), ex, keep), rtol=1e-5, atol=1e-5
    )
    nothing = ex(x, idx, w, paddle.zeros([13, 2], dtype="bool"))
    assert float(paddle.abs(nothing).max()) == 0.0


def _naive_capacity_keep(idx, E, cap):
    T, k = idx.shape
    used = [0] * E
    keep = np.zeros((T, k), bool)
    for s in range(k):  # first choices before second choices, then token order
        for t in range(T):
            e = idx[t, s]
            if used[e] < cap:
                keep[t, s] = True
                used[e] += 1
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capacity_keep_matches_priority_loop(seed):
    rs = np.random.RandomState(seed)
    idx = np.stack([rs.choice(5, 2, replace=False) for _ in range(23)]).astype("int64")
    idx[:9, 0] = 3  # an overloaded expert
    for cap in (1, 3, expert_capacity(23, 2, 5, 1.0)):
        got = capacity_keep(paddle.to_tensor(idx), 5, cap).numpy()
        np.testing.assert_array_equal(got, _naive_capacity_keep(idx, 5, cap))
    assert expert_capacity(23, 2, 5, 1.0) == 10 and expert_capacity(23, 2, 5, 1.25) == 12


def test_capacity_factor_drops_tokens_in_block():
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=2, moe_capacity_factor=0.5)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(cfg)
    model.train()
    model(paddle.randint(0, 1000, [2, 32]))
    block = model.moe_layers()[0]
    # capacity ceil(0.5*64*2/8)=8 per expert, 64 slots of 128 at most: at least half dropped
    assert block.last_dropped >= 0.5


def test_router_losses_match_formulas():
    rs = np.random.RandomState(0)
    logits = rs.randn(7, 5).astype("float32") * 3
    z_ref = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(router_z_loss(paddle.to_tensor(logits))), z_ref, rtol=1e-5)

    w = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]], "float32")  # unit e0, e1 at 45 degrees
    np.testing.assert_allclose(float(router_orthogonal_loss(paddle.to_tensor(w))), 0.25, rtol=1e-6)
    w = rs.randn(16, 6).astype("float32")
    wn = w / np.linalg.norm(w, axis=0, keepdims=True)
    ref = np.mean((wn.T @ wn - np.eye(6)) ** 2)
    np.testing.assert_allclose(float(router_orthogonal_loss(paddle.to_tensor(w))), ref, rtol=1e-5)
    ref4 = np.mean((wn[:, :4].T @ wn[:, :4] - np.eye(4)) ** 2)
    np.testing.assert_allclose(float(router_orthogonal_loss(paddle.to_tensor(w), 4)), ref4, rtol=1e-5)
    assert float(router_orthogonal_loss(paddle.eye(6))) < 1e-12

    probs = F.softmax(paddle.to_tensor(logits), axis=-1)
    idx = paddle.topk(probs, 2, axis=-1)[1]
    f = np.bincount(idx.numpy().ravel(), minlength=5) / 14
    ref = 5 * np.sum(f * probs.numpy().mean(0))
    np.testing.assert_allclose(float(load_balancing_loss(probs, idx, 5)), ref, rtol=1e-5)


def test_block_router_loss_is_weighted_sum_and_trains_router():
    cfg = get_preset("tiny-moe").replace(
        num_hidden_layers=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01, router_orthogonal_loss_coef=1.0
    )
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(cfg)
    model.train()
    out = model(paddle.randint(0, 1000, [2, 16]))
    blocks = model.moe_layers()
    expect = sum(
        0.1 * float(b.loss_parts["aux"]) + 0.01 * float(b.loss_parts["z"]) + float(b.loss_parts["orthogonal"])
        for b in blocks
    )
    np.testing.assert_allclose(float(out.aux_loss), expect, rtol=1e-5)
    out.aux_loss.backward()
    assert float(blocks[0].gate.weight.grad.abs().sum()) > 0
    # the orthogonal loss alone, minimised, makes router vectors orthogonal
    gate = TopKRouter(32, 4, 2, 1e-12)
    opt = paddle.optimizer.SGD(0.5, parameters=[gate.weight])
    before = float(router_orthogonal_loss(gate.weight))
    for _ in range(50):
        loss = router_orthogonal_loss(gate.weight)
        loss.backward()
        opt.step()
        opt.clear_grad()
    assert float(router_orthogonal_loss(gate.weight)) < before / 10


def test_correction_bias_update_moves_toward_balance():
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=2)
    model = Ernie4_5ForCausalLM(cfg)
    block = model.moe_layers()[0]
    block.load_counts.set_value(paddle.to_tensor([10, 0, 5, 5, 5, 5, 5, 5], dtype="float32"))
    block.update_correction_bias(0.01)
    np.testing.assert_allclose(
        block.gate.e_score_correction_bias.numpy()[0], [-0.01, 0.01, 0, 0, 0, 0, 0, 0], atol=1e-7
    )
    assert float(block.load_counts.sum()) == 0  # counting restarts
    # the bias changes selection, never the weights: weights stay the unbiased renormalised probs
    gate = block.gate
    x = paddle.randn([6, cfg.hidden_size])
    gate.e_score_correction_bias.set_value(paddle.to_tensor([[0, 0, 0, 0, 0, 0, 0, 5.0]]))
    r = gate(x)
    assert (r.topk_idx.numpy() == 7).any(axis=1).all()
    p = r.probs.numpy()
    sel = np.take_along_axis(p, r.topk_idx.numpy(), 1)
    np.testing.assert_allclose(r.topk_weight.numpy(), sel / sel.sum(1, keepdims=True), rtol=1e-5)


def test_elastic_router_masks_experts_and_changes_k():
    gate = TopKRouter(16, 8, 2, 1e-12)
    gate.active_experts, gate.active_k = 3, 1
    gate.e_score_correction_bias.set_value(paddle.full([1, 8], 10.0))
    r = gate(paddle.randn([20, 16]))
    assert r.topk_idx.shape == [20, 1] and int(r.topk_idx.max()) < 3
    assert float(r.probs[:, 3:].abs().max()) < 1e-20  # -1e9 logits: 0 up to exp underflow
    np.testing.assert_allclose(r.probs.sum(-1).numpy(), 1.0, rtol=1e-6)


def test_gpas_forward_value_and_gradients():
    g = GPAS()
    g.alpha.set_value(paddle.to_tensor([0.7]))
    x = paddle.randn([3, 5])
    x.stop_gradient = False
    y = g(x)
    s = 0.7 / (1 + np.exp(-0.7))
    np.testing.assert_allclose(y.numpy(), (1 - s) * x.numpy(), rtol=1e-6)
    up = paddle.randn([3, 5])
    (y * up).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), up.numpy(), rtol=1e-6)  # gradient preserved
    sig = 1 / (1 + np.exp(-0.7))
    dsilu = sig * (1 + 0.7 * (1 - sig))
    np.testing.assert_allclose(g.alpha.grad.numpy(), [-dsilu * np.sum(x.numpy() * up.numpy())], rtol=1e-5)
    assert float(GPAS()(x).sub(x).abs().max()) == 0.0  # alpha starts at 0: identity


def test_gpas_model_round_trips_and_alpha_trains(tmp_path):
    from erniekit.models.ernie4_5.checkpoint import from_pretrained, save_pretrained

    cfg = get_preset("tiny-dense").replace(num_hidden_layers=2, use_gpas=True)
    model = Ernie4_5ForCausalLM(cfg)
    model.model.layers[1].gpas.alpha.set_value(paddle.to_tensor([0.3]))
    ids = paddle.randint(0, 1000, [1, 8])
    model.eval()
    ref = model(ids).logits.numpy()
    save_pretrained(model, str(tmp_path))
    back = from_pretrained(str(tmp_path))
    back.eval()
    np.testing.assert_allclose(back(ids).logits.numpy(), ref, rtol=1e-5, atol=1e-6)
    model.train()
    model(ids).logits.mean().backward()
    assert float(model.model.layers[1].gpas.alpha.grad.abs().sum()) > 0
    # a NaN gate loaded silently and made every logit NaN (chat printed garbage)
    model.model.layers[0].gpas.alpha.set_value(paddle.to_tensor([float("nan")]))
    save_pretrained(model, str(tmp_path / "nan"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.gpas.alpha \(a GPAS gate\) is NaN or infinite"):
        from_pretrained(str(tmp_path / "nan"))


@pytest.mark.parametrize(
    "change,msg",
    [
        (dict(moe_k=9), "moe_k=9"),
        (dict(moe_capacity_factor=-1.0), "moe_capacity_factor"),
    ],
)
def test_bad_moe_config_is_one_clear_error(change, msg):
    with pytest.raises(CheckpointError, match=msg):
        get_preset("tiny-moe").replace(**change)


def test_fp8_block_that_does_not_divide_is_an_error():
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="fp8_block_size=96 does not divide hidden_size=128"):
        model.set_fp8(96)
    with pytest.raises(CheckpointError, match="dense"):
        Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1)).set_fp8(128)


def test_moe_block_without_losses_has_no_router_loss():
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=2, router_aux_loss_coef=0.0)
    block = MoEBlock(cfg, lambda c, n: None)
    block.train()
    block(paddle.randn([1, 4, cfg.hidden_size]))
    assert block.router_loss is None and block.loss_parts == {}


def test_load_balancing_terms_of_split_batches_add_up_to_the_whole_batch_loss():
    """Beside data parallelism each rank holds part of the batch: with the whole batch's counts (the
    all-reduce of both parts' statistics) the two ranks' terms and their gradients
    add up to the loss of the whole batch."""
    rng = np.random.default_rng(0)
    logits = paddle.to_tensor(rng.normal(size=(10, 6)).astype("float32"), stop_gradient=False)
    idx = paddle.to_tensor(rng.integers(0, 6, (10, 2)))
    probs = F.softmax(logits, axis=-1)
    whole = load_balancing_loss(probs, idx, 6)
    (g_whole,) = paddle.grad(whole, logits)

    def stats(i):
        return paddle.concat(
            [
                paddle.bincount(i.reshape([-1]), minlength=6).astype("float32"),
                paddle.to_tensor([float(i.shape[0])], dtype="float32"),
            ]
        )

    a, b = slice(0, 4), slice(4, 10)
    both = stats(idx[a]) + stats(idx[b])  # what the sum over the ranks gives each of them
    whole_batch = (both[:-1], float(both[-1]))
    ta = load_balancing_loss(probs[a], idx[a], 6, whole_batch)
    tb = load_balancing_loss(probs[b], idx[b], 6, whole_batch)
    np.testing.assert_allclose(float(ta + tb), float(whole), rtol=1e-6)
    (g_split,) = paddle.grad(ta + tb, logits)
    np.testing.assert_allclose(g_split.numpy(), g_whole.numpy(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("recompute", [None, "mlp"])
def test_data_ranks_sum_every_layer_s_counts_in_one_collective_after_the_forward(recompute):
    """Beside data ranks the router losses need the whole batch's counts; they are summed for all
    MoE layers at once when the forward ends (one wait for the other ranks a step, not one a layer).
    Two ranks with the same rows (the sum doubles every count) each carry half of the one-process
    loss, through the aux and z terms, with and without recompute."""
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=3, router_z_loss_coef=1e-3)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(cfg)
    model.set_recompute(recompute)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)))
    one = model(ids).aux_loss
    parts_one = {k: float(v) for m in model.moe_layers() for k, v in m.loss_parts.items()}
    calls = []

    def data_sum(t):
        calls.append(t.shape)
        return t * 2

    for m in model.moe_layers():
        m.data_sum, m.data_ranks = data_sum, 2
    out = model(ids)
    moe = model.moe_layers()
    assert len(moe) >= 2 and calls == [[len(moe) * (cfg.total_experts + 1)]]
    assert all(m.pending_stats is None for m in moe)
    np.testing.assert_allclose(2 * float(out.aux_loss), float(one), rtol=1e-6)
    assert set(parts_one) == {k for m in moe for k in m.loss_parts} == {"aux", "z"}
    out.aux_loss.backward()  # the recomputed second run sums nothing and keeps the settled losses
    assert len(calls) == 1 and all(m.loss_parts for m in moe)


def test_no_whole_batch_sum_when_no_loss_needs_the_counts():
    """Aux-loss-free routing (or the orthogonal loss alone) needs no counts from the other ranks:
    no collective a step, and each rank carries its share of the orthogonal loss."""
    cfg = get_preset("tiny-moe").replace(
        num_hidden_layers=2, router_aux_loss_coef=0.0, router_z_loss_coef=0.0, router_orthogonal_loss_coef=1.0
    )
    model = Ernie4_5ForCausalLM(cfg)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8)))
    one = float(model(ids).aux_loss)
    calls = []
    for m in model.moe_layers():
        m.data_sum, m.data_ranks = (lambda t: calls.append(t) or t), 2
    np.testing.assert_allclose(2 * float(model(ids).aux_loss), one, rtol=1e-6)
    assert calls == []


def test_deferred_router_losses_give_the_same_gradients_with_recompute():
    """The settled losses read router probabilities made inside a recomputed part: the backward
    replays it and the router gets the gradients it gets without recompute."""
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=2, router_z_loss_coef=1e-3)
    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)))
    grads = []
    for recompute in (None, "mlp"):
        paddle.seed(0)
        model = Ernie4_5ForCausalLM(cfg)
        model.set_recompute(recompute)
        model.train()
        for m in model.moe_layers():
            m.data_sum, m.data_ranks = (lambda t: t * 2), 2
        model(ids).aux_loss.backward()
        grads.append([m.router(0).weight.grad.numpy().copy() for m in model.moe_layers()])
    for a, b in zip(*grads):
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
