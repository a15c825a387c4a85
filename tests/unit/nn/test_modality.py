"""Modality-isolated routing, heterogeneous experts and the multimodal token-balanced loss.

Synthetic two-modality token streams (token_type_ids in blocks of 0 and 1); every value is
checked against a direct per-token (numpy) computation of its formula.
"""

import json

import numpy as np
import paddle
import pytest

from erniekit.errors import CheckpointError, DataError
from erniekit.models.ernie4_5 import Ernie4_5Config, Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.modeling import MLP
from erniekit.nn.moe import MoEBlock, StackedExperts
from erniekit.train.losses import IGNORE_INDEX, causal_lm_loss_sum, count_examples, token_balanced_loss_sum

EXPERTS, SIZES = [4, 3], [32, 16]


def _cfg(**kw):
    base = dict(num_hidden_layers=2, moe_num_experts=EXPERTS, moe_intermediate_size=SIZES, moe_k=2)
    return get_preset("tiny-moe").replace(**{**base, **kw})


def _types(B, S, seed=0):
    """Blocks of text (0) and modality-1 tokens at random boundaries, e.g. 0 0 1 1 1 0 0."""
    rs = np.random.RandomState(seed)
    t = np.zeros((B, S), np.int64)
    for b in range(B):
        lo, hi = sorted(rs.choice(np.arange(1, S), 2, replace=False))
        t[b, lo:hi] = 1
    return t


def _randomize(block):
    """Large random weights and correction biases, so routing differs per token and the bias matters."""
    for n, p in block.named_parameters():
        scale = 0.05 if "e_score_correction_bias" in n else 0.3
        p.set_value(paddle.randn(p.shape) * scale)


def _silu(x):
    return x / (1 + np.exp(-x))


def _naive_block(block, x, mod):
    """Per-token loop: softmax of modality m's router, top-k of probs + bias_m, renormalised
    weights, modality m's experts, plus the shared experts. Returns (y, global ids)."""
    k = block.router(0).k
    y = np.zeros_like(x)
    ids = np.zeros((x.shape[0], k), np.int64)
    sh = block.shared_experts
    for t in range(x.shape[0]):
        m = mod[t]
        gate, ex = block.router(m), block.expert_set(m)
        logits = x[t] @ gate.weight.numpy()
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-(p + gate.e_score_correction_bias.numpy()[0]), kind="stable")[:k]
        w = p[top] / max(p[top].sum(), 1e-12)
        g, u, d = (getattr(ex, q).numpy() for q in StackedExperts.PROJS)
        for e, we in zip(top, w):
            y[t] += we * ((_silu(x[t] @ g[e]) * (x[t] @ u[e])) @ d[e])
        y[t] += (
            _silu(x[t] @ sh.gate_proj.weight.numpy()) * (x[t] @ sh.up_proj.weight.numpy())
        ) @ sh.down_proj.weight.numpy()
        ids[t] = top + block.offsets[m]
    return y, ids


def test_config_lists_round_trip_and_helpers():
    cfg = _cfg()
    assert (cfg.num_modalities, cfg.experts_per_modality, cfg.expert_sizes, cfg.total_experts) == (2, EXPERTS, SIZES, 7)
    assert cfg.is_moe and cfg.model_type == "ernie4_5_moe"
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["moe_num_experts"] == EXPERTS and d["moe_intermediate_size"] == SIZES
    back = Ernie4_5Config.from_dict(d)
    assert back.to_dict() == cfg.to_dict() and back.experts_per_modality == EXPERTS
    mixed = _cfg(moe_num_experts=5)  # an int applies to every modality
    assert mixed.experts_per_modality == [5, 5] and mixed.expert_sizes == SIZES
    text = get_preset("tiny-moe")  # the int path is unchanged
    assert (text.num_modalities, text.experts_per_modality, text.total_experts) == (1, [8], 8)


@pytest.mark.parametrize(
    "change,msg",
    [
        (dict(moe_k=4), r"moe_k=4 must be in \[1, moe_num_experts=\[4, 3\]\]"),
        (dict(moe_intermediate_size=[32, 16, 8]), "list different modality counts"),
        (dict(moe_num_experts=[4, 0]), "positive integers"),
    ],
)
def test_bad_modality_config_is_one_clear_error(change, msg):
    with pytest.raises(CheckpointError, match=msg):
        _cfg(**change)


def _block(seed=0, **kw):
    paddle.seed(seed)
    block = MoEBlock(_cfg(**kw), MLP)
    _randomize(block)
    return block


def test_routing_is_isolated_and_matches_per_token_loop():
    block = _block()
    assert [block.expert_set(m).gate_proj.shape for m in (0, 1)] == [[4, 128, 32], [3, 128, 16]]
    types = _types(3, 12)
    x = paddle.randn([3, 12, 128])
    y = block(x, paddle.to_tensor(types))
    ids = block.last_topk_idx.numpy()
    mod = types.reshape(-1)
    assert ids[mod == 0].max() < 4 and ids[mod == 1].min() >= 4 and ids.max() < 7  # global ids
    ref_y, ref_ids = _naive_block(block, x.numpy().reshape(-1, 128), mod)
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(ref_ids, 1))
    np.testing.assert_allclose(y.numpy().reshape(-1, 128), ref_y, rtol=1e-4, atol=1e-4)  # |y| ~ 20
    probs = block.last_probs.numpy()  # own modality's softmax at global columns, 0 elsewhere
    assert (
        probs.shape == (36, 7)
        and np.abs(probs[mod == 0][:, 4:]).max() == 0
        and np.abs(probs[mod == 1][:, :4]).max() == 0
    )
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(block.last_modality.numpy(), mod)


def test_no_modality_is_all_text_and_single_modality_model_accepts_zeros():
    block = _block()
    x = paddle.randn([2, 6, 128])
    y_none = block(x).numpy()
    assert block.last_modality is None and block.last_probs.shape == [12, 7]
    np.testing.assert_allclose(block(x, paddle.zeros([2, 6], "int64")).numpy(), y_none, rtol=1e-6, atol=1e-6)
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=2)
    model = Ernie4_5ForCausalLM(cfg)
    model.eval()
    ids = paddle.randint(0, 1000, [2, 6])
    np.testing.assert_array_equal(
        model(ids).logits.numpy(), model(ids, token_type_ids=paddle.zeros([2, 6], "int64")).logits.numpy()
    )
    with pytest.raises(DataError, match="modality id 1 but the model has 1 modality"):
        model(ids, token_type_ids=paddle.ones([2, 6], "int64"))


@pytest.mark.parametrize("bad", [2, -1])
def test_modality_id_outside_config_is_one_clear_error(bad):
    model = Ernie4_5ForCausalLM(_cfg())
    types = _types(2, 8)
    types[1, 3] = bad
    with pytest.raises(DataError, match=f"modality id {bad} but the model has 2 modalities"):
        model(paddle.randint(0, 1000, [2, 8]), token_type_ids=paddle.to_tensor(types))


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_router_losses_are_per_modality_sums():
    block = _block(router_aux_loss_coef=0.1, router_z_loss_coef=0.01, router_orthogonal_loss_coef=1.0)
    block.train()
    types = _types(2, 10, seed=3)
    x = paddle.randn([2, 10, 128])
    block(x, paddle.to_tensor(types))
    xs, mod, ids = x.numpy().reshape(-1, 128), types.reshape(-1), block.last_topk_idx.numpy()
    aux = z = orth = 0.0
    for m in (0, 1):
        W = block.router(m).weight.numpy()
        logits = xs[mod == m] @ W
        p = _np_softmax(logits)
        local = ids[mod == m] - block.offsets[m]
        f = np.bincount(local.ravel(), minlength=EXPERTS[m]) / local.size
        aux += EXPERTS[m] * np.sum(f * p.mean(0))
        z += np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
        Wn = W / np.linalg.norm(W, axis=0, keepdims=True)
        orth += np.mean((Wn.T @ Wn - np.eye(EXPERTS[m])) ** 2)
    got = {k: float(v) for k, v in block.loss_parts.items()}
    np.testing.assert_allclose([got["aux"], got["z"], got["orthogonal"]], [aux, z, orth], rtol=1e-4)
    np.testing.assert_allclose(float(block.router_loss), 0.1 * aux + 0.01 * z + orth, rtol=1e-4)
    np.testing.assert_array_equal(block.load_counts.numpy(), np.bincount(ids.ravel(), minlength=7))


def test_data_ranks_with_different_modalities_send_equal_sizes_and_add_up_to_the_whole_batch():
    """Beside data ranks each MoE layer sends its counts for every modality, zeros for one it has
    no token of (a rank with text only): the sums line up on every rank, and the ranks' router
    losses add up to the whole batch's."""
    block = _block(router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    block.train()
    xa, ta = paddle.randn([1, 10, 128]), _types(1, 10, seed=3)
    xb, tb = paddle.randn([1, 6, 128]), np.zeros((1, 6), np.int64)  # the other rank: text only
    block(paddle.concat([xa, xb], axis=1), paddle.to_tensor(np.concatenate([ta, tb], axis=1)))
    whole = float(block.router_loss)
    block.data_sum, block.data_ranks = (lambda t: t), 2
    pending = []
    for x, t in ((xa, ta), (xb, tb)):
        block(x, paddle.to_tensor(t))
        pending.append(block.pending_stats)
    sa, sb = pending[0][0], pending[1][0]
    assert sa.shape == sb.shape == [7 + 2]
    assert sb.numpy()[4:7].sum() == 0 and sb.numpy()[-2:].tolist() == [6.0, 0.0]  # no modality-1 token
    losses = []
    for p in pending:
        block.pending_stats = p
        block.finish_router_losses(sa + sb)
        losses.append(float(block.router_loss))
    np.testing.assert_allclose(sum(losses), whole, rtol=1e-5)


def test_gradients_reach_every_modality_and_bias_update_balances_within_modality():
    block = _block(router_aux_loss_coef=0.1)
    block.train()
    x = paddle.randn([2, 10, 128])
    x.stop_gradient = False
    y = block(x, paddle.to_tensor(_types(2, 10)))
    (y.square().mean() + block.router_loss).backward()
    for m in (0, 1):
        assert float(block.expert_set(m).down_proj.grad.abs().sum()) > 0
        assert float(block.router(m).weight.grad.abs().sum()) > 0
    assert float(x.grad.abs().sum()) > 0
    block.load_counts.set_value(paddle.to_tensor([4, 0, 2, 2, 9, 1, 2], dtype="float32"))
    for m in (0, 1):
        block.router(m).e_score_correction_bias.set_value(paddle.zeros([1, EXPERTS[m]]))
    block.update_correction_bias(0.1)
    np.testing.assert_allclose(block.router(0).e_score_correction_bias.numpy()[0], [-0.1, 0.1, 0, 0], atol=1e-7)
    np.testing.assert_allclose(block.router(1).e_score_correction_bias.numpy()[0], [-0.1, 0.1, 0.1], atol=1e-7)
    assert float(block.load_counts.sum()) == 0


def test_save_load_round_trip_is_exact_with_ernie_vl_names(tmp_path):
    from safetensors import safe_open

    from erniekit.models.ernie4_5.checkpoint import from_pretrained, save_pretrained

    paddle.seed(0)
    model = Ernie4_5ForCausalLM(_cfg())
    for m in (0, 1):
        model.moe_layers()[0].router(m).e_score_correction_bias.set_value(paddle.randn([1, EXPERTS[m]]))
    model.eval()
    ids, types = paddle.randint(0, 1000, [2, 12]), paddle.to_tensor(_types(2, 12))
    ref = model(ids, token_type_ids=types).logits.numpy()
    save_pretrained(model, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    pre = "model.layers.1.mlp."
    assert {
        pre + "gate.weight",
        pre + "gate.weight_1",
        pre + "moe_statics.e_score_correction_bias",
        pre + "moe_statics.e_score_correction_bias_1",
    } <= names
    assert {
        f"{pre}experts.{e}.up_proj.weight" for e in range(7)
    } <= names and f"{pre}experts.7.up_proj.weight" not in names
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert list(f.get_tensor(pre + "experts.4.down_proj.weight").shape) == [128, 16]  # modality 1: [out, in]
    back = from_pretrained(str(tmp_path))
    back.eval()
    assert back.config.moe_num_experts == EXPERTS
    np.testing.assert_array_equal(back(ids, token_type_ids=types).logits.numpy(), ref)
    for (n, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)


def test_text_only_parameter_names_are_unchanged():
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(num_hidden_layers=2))
    names = [n for n, _ in model.named_parameters() if n.startswith("model.layers.1.mlp.")]
    assert [n[len("model.layers.1.mlp.") :] for n in names] == [
        "gate.weight",
        "gate.e_score_correction_bias",
        "experts.gate_proj",
        "experts.up_proj",
        "experts.down_proj",
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    ]


def _loss_case(seed=0):
    """Packed rows of unequal examples: row 0 holds a 2-target and a 9-target example."""
    rs = np.random.RandomState(seed)
    B, S, V = 3, 14, 11
    labels = rs.randint(0, V, (B, S)).astype(np.int64)
    seg = np.array([[1] * 3 + [2] * 10 + [0], [1] * 14, [1] * 6 + [0] * 8])
    labels[seg == 0] = IGNORE_INDEX
    labels[1, :8] = IGNORE_INDEX  # a prompt
    return paddle.randn([B, S, V]), labels, seg


def _loop_reference(logits, labels, seg):
    """Mean over examples of each example's mean NLL over its own targets (one loop per example)."""
    lp = logits.numpy() - np.log(np.exp(logits.numpy()).sum(-1, keepdims=True))
    per_example = []
    for b in range(labels.shape[0]):
        for s in sorted(set(seg[b]) - {0}):
            nll = [
                -lp[b, t, labels[b, t + 1]]
                for t in range(labels.shape[1] - 1)
                if seg[b, t] == s and seg[b, t + 1] == s and labels[b, t + 1] != IGNORE_INDEX
            ]
            if nll:
                per_example.append(np.mean(nll))
    return np.mean(per_example), len(per_example)


def test_token_balanced_loss_matches_per_example_loop_and_differs_from_token_average():
    logits, labels, seg = _loss_case()
    ref, n = _loop_reference(logits, labels, seg)
    batch = {"labels": labels, "segment_ids": seg}
    assert count_examples(batch) == n == 4
    got = float(token_balanced_loss_sum(logits, labels, seg)) / count_examples(batch)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    from erniekit.train.losses import count_target_tokens

    token_avg = float(causal_lm_loss_sum(logits, labels, seg)) / count_target_tokens(batch)
    assert abs(token_avg - ref) > 1e-3  # unequal lengths: the two normalisations disagree
    # equal-length examples: both are the same average
    eq = np.array([[1] * 7 + [2] * 7] * 3)
    l2 = np.random.RandomState(1).randint(0, 11, (3, 14)).astype(np.int64)
    b2 = {"labels": l2, "segment_ids": eq}
    np.testing.assert_allclose(
        float(token_balanced_loss_sum(logits, l2, eq)) / count_examples(b2),
        float(causal_lm_loss_sum(logits, l2, eq)) / count_target_tokens(b2),
        rtol=1e-5,
    )


def test_token_balanced_loss_gradient_weights_each_example_equally():
    logits, labels, seg = _loss_case(2)
    logits.stop_gradient = False
    token_balanced_loss_sum(logits, labels, seg).backward()
    g = np.abs(logits.grad.numpy()).sum(-1)
    # row 0: 2 targets of example 1 vs 9 of example 2 -> each example's total gradient mass ~ equal
    assert g[0, :2].sum() == pytest.approx(g[0, 3:12].sum(), rel=0.5) and g[0, 2] == 0


def test_training_with_token_type_ids_learns(tmp_path):
    from erniekit.routing.stats import RoutingAccumulator
    from erniekit.train.batching import collate
    from erniekit.train.stage import Stage

    paddle.seed(0)
    cfg = _cfg(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        router_aux_loss_coef=0.01,
        router_orthogonal_loss_coef=0.01,
    )
    model = Ernie4_5ForCausalLM(cfg)
    rs = np.random.RandomState(0)
    rows = []
    for i in range(4):  # unequal examples, each with a text part and a modality-1 part
        n = 6 + 3 * i
        ids = rs.randint(0, 50, n).astype(np.int64)
        types = np.zeros(n, np.int64)
        types[2:4] = 1
        rows.append({"input_ids": ids, "labels": ids.copy(), "token_type_ids": types})
    batch = collate(rows, pad_id=0)
    assert batch["token_type_ids"].shape == batch["input_ids"].shape and batch["token_type_ids"][0, 2] == 1
    stage = Stage()
    stage.prepare(model, rows, None, type("C", (), {"loss_token_balance": True})(), None)
    assert stage.normalizer(batch) == 4
    opt = paddle.optimizer.AdamW(3e-3, parameters=model.parameters())
    model.train()
    losses = []
    for _ in range(12):
        out = stage.loss(model, batch)
        loss = out.loss_sum / stage.normalizer(batch) + out.aux_loss
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(out.loss_sum) / 4)
    assert losses[-1] < losses[0] * 0.8
    acc = RoutingAccumulator(modality_experts=[range(4), range(4, 7)])
    acc.update(model, batch["segment_ids"] > 0)
    usage = acc.modality_matrix()
    assert usage.shape == (2, 7) and usage[0, 4:].sum() == 0 and usage[1, :4].sum() == 0


def test_lora_adapts_every_modality_with_global_expert_names(tmp_path):
    from safetensors import safe_open

    from erniekit.nn.lora import LoraConfig, apply_lora, load_adapter, merge_and_unload, save_adapter

    paddle.seed(0)
    model = Ernie4_5ForCausalLM(_cfg())
    adapted = apply_lora(model, LoraConfig(r=2))
    assert {"model.layers.1.mlp.experts", "model.layers.1.mlp.experts_1"} <= set(adapted)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.set_value(paddle.randn(p.shape) * 0.1)
    ids, types = paddle.randint(0, 1000, [2, 10]), paddle.to_tensor(_types(2, 10))
    model.eval()
    ref = model(ids, token_type_ids=types).logits.numpy()
    save_adapter(model, str(tmp_path))
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert list(f.get_tensor("base_model.model.model.layers.1.mlp.experts.6.down_proj.lora_A.weight").shape) == [
            2,
            16,
        ]
    assert not any("experts_1" in k for k in keys)
    paddle.seed(0)
    back = Ernie4_5ForCausalLM(_cfg())
    load_adapter(back, str(tmp_path))
    back.eval()
    np.testing.assert_allclose(back(ids, token_type_ids=types).logits.numpy(), ref, rtol=1e-6, atol=1e-6)
    merge_and_unload(back)
    assert "model.layers.1.mlp.experts_1.gate_proj" in dict(back.named_parameters())
    np.testing.assert_allclose(back(ids, token_type_ids=types).logits.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_loss_token_balance_key_trains_end_to_end(tmp_path, monkeypatch):
    """The config key reaches the stage: the logged loss is the per-example average (normaliser = examples)."""
    from erniekit.config import load_config, validate
    from erniekit.train import run as runner
    from erniekit.train.stages import get_stage
    from tests.unit.train.test_train import SMALL

    cfg = validate(
        load_config(
            None,
            SMALL
            + [
                f"output_dir={tmp_path / 'tb'}",
                "loss_token_balance=true",
                "max_steps=3",
                "do_eval=false",
                "save_steps=100",
            ],
        )
    )
    used = []  # the run's own stage instance (each run gets a fresh one)
    monkeypatch.setattr(runner, "get_stage", lambda name: used.append(get_stage(name)) or used[-1])
    assert cfg.loss_token_balance is True
    runner.run_train(cfg, log=lambda s: None)
    assert len(used) == 1 and used[0].token_balance is True
    assert get_stage("SFT").token_balance is False  # nothing of the run is left on the class
