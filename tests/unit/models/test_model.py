"""ERNIE 4.5 modeling: parity with transformers, checkpoint round trips, KV cache, packing."""

import json
import os

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file, save_file

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import Ernie4_5Config, Ernie4_5ForCausalLM, KVCache, from_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
TINY_MOE = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1)


def _hf_model(moe: bool, tied: bool, seed: int = 0, bias: bool = False):
    torch.manual_seed(seed)
    if moe:
        cfg = transformers.Ernie4_5_MoeConfig(**TINY, **TINY_MOE, tie_word_embeddings=tied, use_bias=bias)
        m = transformers.Ernie4_5_MoeForCausalLM(cfg)
        with torch.no_grad():  # a non-zero correction bias makes the test see how it is applied
            for layer in m.model.layers[1:]:
                layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0, 0.05)
    else:
        cfg = transformers.Ernie4_5Config(**TINY, tie_word_embeddings=tied, use_bias=bias)
        m = transformers.Ernie4_5ForCausalLM(cfg)
    return m.eval()


@pytest.mark.parametrize(
    "moe,tied,bias",
    [
        (False, True, False),
        (False, False, True),
        (True, True, False),
        (True, False, False),
        # the MoE head has a bias with use_bias (transformers: lm_head bias=use_bias), tied or not
        (True, True, True),
        (True, False, True),
    ],
)
def test_logits_match_transformers_both_ways(tmp_path, moe, tied, bias):
    hf = _hf_model(moe, tied, bias=bias)
    if moe and bias:
        with torch.no_grad():  # transformers starts it at zero: a non-zero one shows it is applied
            hf.lm_head.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.numpy()

    ours = from_pretrained(str(tmp_path / "hf"))
    ours.eval()
    got = ours(paddle.to_tensor(ids.numpy())).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)

    save_pretrained(ours, str(tmp_path / "ours"))
    cls = transformers.Ernie4_5_MoeForCausalLM if moe else transformers.Ernie4_5ForCausalLM
    back = cls.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).logits.numpy(), ref, atol=1e-4, rtol=0)


def test_hub_style_config_with_top_level_rope_theta(tmp_path):
    hf = _hf_model(moe=True, tied=True)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert Ernie4_5Config.from_pretrained(str(tmp_path)).rope_theta == theta
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    got = from_pretrained(str(tmp_path))(paddle.to_tensor(ids.numpy())).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4)


def _tiny(moe=True, seed=0):
    paddle.seed(seed)
    m = Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, **(TINY_MOE if moe else {})))
    m.eval()
    return m


def test_sharded_save_round_trip(tmp_path):
    m = _tiny()
    save_pretrained(m, str(tmp_path), max_shard_size=4096)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
    m2 = from_pretrained(str(tmp_path))
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=n)


@pytest.mark.parametrize("sharded", [False, True])
def test_loading_drops_a_shards_mapping_once_enough_is_read_and_loads_the_same_values(
    tmp_path, monkeypatch, shard_maps, sharded
):
    """A shard's memory map is dropped once REMAP_BYTES were read through it (its pages then leave
    the resident set) and opened again for the next tensor; the values are the same."""
    from erniekit.models.ernie4_5 import checkpoint

    m = _tiny()
    save_pretrained(m, str(tmp_path), **({"max_shard_size": 4096} if sharded else {}))
    kept = from_pretrained(str(tmp_path))
    opened, dropped = shard_maps.opened, shard_maps.dropped
    opened.clear(), dropped.clear()  # that load's
    monkeypatch.setattr(checkpoint, "REMAP_BYTES", 1)  # every read drops its mapping
    remapped = from_pretrained(str(tmp_path))
    n = len(list(m.named_parameters()))
    assert len(dropped) >= n and len(opened) == len(dropped)  # each read's mapping dropped, opened anew
    for (name, a), (_, b) in zip(kept.named_parameters(), remapped.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    opened.clear(), dropped.clear()
    monkeypatch.setattr(checkpoint, "REMAP_BYTES", 1 << 40)  # never: one open per shard
    from_pretrained(str(tmp_path))
    assert not dropped and len(opened) == len(set(opened))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    save_pretrained(_tiny(), str(tmp_path))
    f = str(tmp_path / "model.safetensors")
    state = load_file(f)
    bad = dict(state)
    del bad["model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(bad, f)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.1\.up_proj\.weight is missing"):
        from_pretrained(str(tmp_path))
    bad = dict(state)
    bad["model.layers.0.self_attn.q_proj.weight"] = np.zeros((5, 32), np.float32)
    save_file(bad, f)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \[5, 32\].*\[32, 32\]"):
        from_pretrained(str(tmp_path))
    os.remove(f)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="not found"):
        from_pretrained(str(tmp_path / "nope"))


@pytest.mark.parametrize("moe", [False, True])
def test_kv_cache_decode_equals_full_forward(moe):
    m = _tiny(moe)
    ids = paddle.randint(0, 64, [2, 10])
    full = m(ids).logits.numpy()
    cache = KVCache(m.config, batch_size=2, max_len=16)
    steps = [m(ids[:, :6], cache=cache).logits.numpy()]
    steps += [m(ids[:, t : t + 1], cache=cache).logits.numpy() for t in range(6, 8)]
    steps.append(m(ids[:, 8:], cache=cache).logits.numpy())  # multi-token chunk on top of a cache
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_left_padding_matches_unpadded():
    m = _tiny()
    ids = paddle.randint(3, 64, [1, 6])
    ref = m(ids).logits.numpy()[:, -1]
    padded = paddle.concat([paddle.zeros([1, 3], "int64"), ids], axis=1)
    mask = paddle.to_tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    got = m(padded, attention_mask=mask).logits.numpy()[:, -1]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_packed_documents_do_not_see_each_other():
    m = _tiny()
    a, b = paddle.randint(0, 64, [1, 5]), paddle.randint(0, 64, [1, 4])
    packed = paddle.concat([a, b], axis=1)
    seg = paddle.to_tensor([[1] * 5 + [2] * 4])
    pos = paddle.to_tensor([list(range(5)) + list(range(4))])
    out = m(packed, position_ids=pos, segment_ids=seg).logits.numpy()
    np.testing.assert_allclose(out[:, :5], m(a).logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], m(b).logits.numpy(), atol=1e-5)


def test_moe_dispatch_matches_per_token_loop():
    """The sort/scatter/bmm dispatch against a naive loop over tokens and their top-k experts."""
    from erniekit.models.ernie4_5.modeling import MLP
    from erniekit.nn.moe import MoEBlock

    paddle.seed(3)
    cfg = Ernie4_5Config(**TINY, **TINY_MOE)
    block = MoEBlock(cfg, MLP)
    for p in block.parameters():
        if p.ndim >= 2 and not p.stop_gradient:  # not the correction bias: it is tested below
            p.set_value(paddle.randn(p.shape) * 0.2)
    bias = np.array([[0.0, 0.3, 0.0, -0.3]], np.float32)  # shifts which experts are picked only
    block.gate.e_score_correction_bias.set_value(paddle.to_tensor(bias))
    x = paddle.randn([2, 9, 32])
    got = block(x).numpy().reshape(-1, 32)
    xs = x.numpy().reshape(-1, 32)
    W = block.gate.weight.numpy()
    g, u, d = (block.experts.gate_proj.numpy(), block.experts.up_proj.numpy(), block.experts.down_proj.numpy())
    shared = block.shared_experts(x).numpy().reshape(-1, 32)
    for t in range(xs.shape[0]):
        logits = xs[t] @ W
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-(p + bias[0]))[:2]
        w = p[top] / p[top].sum()
        y = shared[t].copy()
        for e, we in zip(top, w):
            h = xs[t] @ g[e]
            y += we * (((h / (1 + np.exp(-h))) * (xs[t] @ u[e])) @ d[e])
        np.testing.assert_allclose(got[t], y, atol=1e-5)


def test_config_rejects_bad_head_counts():
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        Ernie4_5Config(**{**TINY, "num_key_value_heads": 3})


def test_the_tied_heads_decode_layout_gives_the_same_logits():
    """Few positions (decode) multiply W by h^T, many h by W^T: the same logits either way."""
    from erniekit.models.ernie4_5 import get_preset
    from erniekit.models.ernie4_5.modeling import _FEW_ROWS

    paddle.seed(3)
    m = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1))
    w = m.model.embed_tokens.weight
    for shape in ([1, 1, 128], [8, 1, 128], [2, _FEW_ROWS // 2, 128], [4, _FEW_ROWS, 128]):
        h = paddle.randn(shape)
        want = np.einsum("bsh,vh->bsv", h.numpy().astype(np.float64), w.numpy().astype(np.float64))
        got = m.head(h)
        assert got.shape == [*shape[:-1], w.shape[0]]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
