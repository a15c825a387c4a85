"""Checkpoints in the Paddle layout of the -Paddle repositories (docs/paddle_layout.md) load into
our model: the mapping round-trips, and a checkpoint written by hand from the documented rules
(q|k|v and gate|up fused along the output axis, [in, out] weights, `ernie.` names) gives the PT
checkpoint's logits, while the wrong fusion order does not."""

import json
import os

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.checkpoint import save_pretrained
from erniekit.models.ernie4_5.paddle_layout import paddle_config_dict, paddle_state_dict
from erniekit.models.registry import load_model

IDS = paddle.to_tensor([[5, 17, 300, 2, 911, 64, 7, 128, 33, 1000]], dtype="int64")
VARIANTS = {
    "dense": ("tiny-dense", {}),
    "moe": ("tiny-moe", {}),
    # untied head, biases, a multi-token-prediction head: every kind of tensor the layout has
    "moe-untied-bias-mtp": (
        "tiny-moe",
        {"tie_word_embeddings": False, "use_bias": True, "num_nextn_predict_layers": 1},
    ),
}


def _model(variant: str, seed: int = 0, **over) -> Ernie4_5ForCausalLM:
    """Random weights at a scale where every matrix moves the logits (and the router's choice)."""
    preset, kw = VARIANTS[variant]
    paddle.seed(seed)
    model = Ernie4_5ForCausalLM(get_preset(preset).replace(**{**kw, **over}))
    for name, p in model.named_parameters():
        noise = paddle.randn(p.shape, dtype=p.dtype)
        p.set_value(1.0 + 0.1 * noise if "norm" in name else (0.02 if "correction" in name else 0.15) * noise)
    model.eval()
    return model


def _logits(model) -> np.ndarray:
    with paddle.no_grad():
        return model(IDS).logits.numpy()


def _pt_checkpoint(model, path) -> dict:
    """Our PT-layout save: returns its tensors by name (numpy) and config.json."""
    save_pretrained(model, str(path))
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def _write(path, tensors: dict, config: dict, shards: int = 1) -> str:
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(path)


def _paddle_config(pt_config: dict) -> dict:
    """A -Paddle repository's config.json: `dtype`, its architectures name and ERNIEKit's own keys."""
    c = {k: v for k, v in pt_config.items() if k != "torch_dtype"}
    c.update(dtype="float32", use_rmsnorm=True, compression_ratio=1.0, use_flash_attention=True, fuse_rope=True)
    c["architectures"] = ["Ernie4_5_MoeForCausalLM" if "moe_num_experts" in c else "Ernie4_5_ForCausalLM"]
    if "moe_num_experts" in c:
        c.update(moe_gate="topk", moe_use_aux_free=True, moe_capacity=[64, 64, 64])
    return c


def _by_hand(pt: dict, order_qkv=("q", "k", "v"), order_mlp=("gate", "up")) -> dict:
    """The Paddle layout written from the documented rules alone, from PT tensors ([out, in]):
    `ernie.` for `model.`, every Linear weight (not the embedding) transposed to [in, out], q|k|v and
    gate|up concatenated along the output axis (`order_*`: the order to fuse in)."""
    out = {}
    for name, t in pt.items():
        n = "ernie." + name[len("model.") :] if name.startswith("model.") else name
        if t.ndim == 2 and n.endswith(".weight") and not n.endswith("embed_tokens.weight"):
            t = t.T
        out[n] = np.ascontiguousarray(t)
    for n in [k for k in out if ".self_attn.q_proj." in k]:
        parts = {p: out.pop(n.replace("q_proj", f"{p}_proj")) for p in "qkv"}
        out[n.replace("q_proj", "qkv_proj")] = np.concatenate([parts[p] for p in order_qkv], axis=-1)
    for n in [k for k in out if ".gate_proj." in k]:
        parts = {p: out.pop(n.replace("gate_proj", f"{p}_proj")) for p in ("gate", "up")}
        out[n.replace("gate_proj", "up_gate_proj")] = np.concatenate([parts[p] for p in order_mlp], axis=-1)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_checkpoint_round_trips_through_the_paddle_layout(tmp_path, variant):
    model = _model(variant)
    state = {k: v.numpy() for k, v in paddle_state_dict(model).items()}
    assert not any(".q_proj." in k or ".gate_proj." in k or k.startswith("model.") for k in state)
    path = _write(
        tmp_path / "pd", state, paddle_config_dict(model.config.to_dict(), model.config.model_type, "float32")
    )
    back = load_model(path)
    np.testing.assert_allclose(_logits(back), _logits(model), rtol=0, atol=1e-5)
    if model.mtp is not None:  # the MTP head came back too, not only the trunk
        np.testing.assert_array_equal(
            back.mtp.mtp_linear_proj[0].weight.numpy(), model.mtp.mtp_linear_proj[0].weight.numpy()
        )
    save_pretrained(back, str(tmp_path / "pt"))  # and what loaded from the Paddle layout saves as PT
    np.testing.assert_allclose(_logits(load_model(str(tmp_path / "pt"))), _logits(model), rtol=0, atol=1e-5)


def test_fused_blocks_count_toward_dropping_a_shards_mapping(tmp_path, monkeypatch, shard_maps):
    """The fused tensors' column blocks are read through the shard's mapping like whole tensors, so
    they count toward REMAP_BYTES (the file's pages do not pile up beside the weights); the values
    are the same."""
    from erniekit.models.ernie4_5 import checkpoint

    model = _model("dense")
    state = {k: v.numpy() for k, v in paddle_state_dict(model).items()}
    path = _write(
        tmp_path / "pd", state, paddle_config_dict(model.config.to_dict(), model.config.model_type, "float32")
    )
    kept = load_model(path)
    dropped = shard_maps.dropped
    dropped.clear()  # that load's
    monkeypatch.setattr(checkpoint, "REMAP_BYTES", 1)  # every read drops its mapping
    remapped = load_model(path)
    fused_blocks = sum(2 for k in state if k.endswith(("qkv_proj.weight", "up_gate_proj.weight")))
    whole = sum(1 for k in state if not k.endswith(("qkv_proj.weight", "up_gate_proj.weight")))
    assert len(dropped) >= whole + fused_blocks  # q|k|v: 3 blocks, gate|up: 2; at least 2 each
    for (name, a), (_, b) in zip(kept.named_parameters(), remapped.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


def test_a_fused_block_that_cannot_be_read_is_one_line_naming_the_file(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from erniekit.models.ernie4_5 import checkpoint

    model = _model("dense")
    state = {k: v.numpy() for k, v in paddle_state_dict(model).items()}
    path = _write(
        tmp_path / "pd", state, paddle_config_dict(model.config.to_dict(), model.config.model_type, "float32")
    )
    real_slice = checkpoint._ShardReader._slice

    class Damaged:  # a view whose bytes cannot be read (a file cut short after its header was read)
        def __init__(self, view):
            self.view = view

        def __getattr__(self, name):  # shape and dtype still read from the header
            return getattr(self.view, name)

        def __getitem__(self, key):
            raise SafetensorError("incomplete metadata, file not fully covered")

    def slice_(self, name):
        view = real_slice(self, name)
        return Damaged(view) if name.endswith("qkv_proj.weight") else view

    monkeypatch.setattr(checkpoint._ShardReader, "_slice", slice_)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: cannot read columns 0:\d+ of tensor .*qkv_proj"
    ) as e:
        load_model(path)
    assert "\n" not in str(e.value) and "re-download or re-save" in str(e.value)


@pytest.mark.parametrize("variant", ["dense", "moe-untied-bias-mtp"])
def test_a_hand_written_paddle_checkpoint_gives_the_pt_logits(tmp_path, variant):
    model = _model(variant)
    pt, pt_config = _pt_checkpoint(model, tmp_path / "pt")
    want = _logits(load_model(str(tmp_path / "pt")))
    path = _write(tmp_path / "pd", _by_hand(pt), _paddle_config(pt_config), shards=3)
    np.testing.assert_allclose(_logits(load_model(path)), want, rtol=0, atol=1e-5)
    # the fusion order matters: q|v|k or up|gate loads without complaint but computes another model
    for i, order in enumerate([{"order_qkv": ("q", "v", "k")}, {"order_mlp": ("up", "gate")}]):
        wrong = _write(tmp_path / f"wrong{i}", _by_hand(pt, **order), _paddle_config(pt_config))
        assert np.abs(_logits(load_model(wrong)) - want).max() > 1e-2


def test_the_moe_layout_names_and_shapes(tmp_path):
    model = _model("moe")
    c = model.config
    state = paddle_state_dict(model)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    assert state["ernie.layers.0.self_attn.qkv_proj.weight"].shape == [c.hidden_size, q + 2 * kv]
    assert state["ernie.layers.0.mlp.up_gate_proj.weight"].shape == [c.hidden_size, 2 * c.intermediate_size]
    assert state["ernie.layers.1.mlp.experts.7.up_gate_proj.weight"].shape == [
        c.hidden_size,
        2 * c.moe_intermediate_size,
    ]
    assert state["ernie.layers.1.mlp.experts.7.down_proj.weight"].shape == [c.moe_intermediate_size, c.hidden_size]
    assert state["ernie.layers.1.mlp.gate.weight"].shape == [c.hidden_size, c.moe_num_experts]
    assert state["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == [1, c.moe_num_experts]
    assert "lm_head.weight" not in state  # tied: the embedding is the head
    # expert 7's gate half is our stacked gate_proj[7], its up half up_proj[7]
    fused = state["ernie.layers.1.mlp.experts.7.up_gate_proj.weight"].numpy()
    experts = model.model.layers[1].mlp.experts
    np.testing.assert_array_equal(fused[:, : c.moe_intermediate_size], experts.gate_proj[7].numpy())
    np.testing.assert_array_equal(fused[:, c.moe_intermediate_size :], experts.up_proj[7].numpy())


@pytest.fixture(scope="module")
def paddle_ckpt(tmp_path_factory):
    """A hand-written Paddle-layout MoE checkpoint (tensors, config) to break in the error tests."""
    tmp = tmp_path_factory.mktemp("pd")
    pt, pt_config = _pt_checkpoint(_model("moe"), tmp / "pt")
    return _by_hand(pt), _paddle_config(pt_config)


def _refused(path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_missing_fused_tensor_is_one_line_naming_it(tmp_path, paddle_ckpt):
    tensors, config = paddle_ckpt
    tensors = {k: v for k, v in tensors.items() if k != "ernie.layers.1.mlp.experts.3.up_gate_proj.weight"}
    _write(tmp_path, tensors, config)
    _refused(
        tmp_path,
        r"tensor ernie\.layers\.1\.mlp\.experts\.3\.up_gate_proj\.weight is missing from the checkpoint "
        r"\(needed for model\.layers\.1\.mlp\.experts\.gate_proj\)",
    )


def test_a_misshaped_fused_tensor_names_its_file_and_shape(tmp_path, paddle_ckpt):
    tensors, config = paddle_ckpt
    name = "ernie.layers.2.self_attn.qkv_proj.weight"
    tensors = {**tensors, name: tensors[name][:, :-32]}  # one kv head too few
    _write(tmp_path, tensors, config, shards=2)
    msg = _refused(tmp_path, rf"tensor {name} has shape \[128, 224\], the model config expects \[128, 256\]")
    assert msg.startswith(str(tmp_path / "model-0000"))  # the shard file it is in


def test_an_integer_tensor_under_a_weight_name_is_refused(tmp_path, paddle_ckpt):
    tensors, config = paddle_ckpt
    name = "ernie.layers.0.mlp.up_gate_proj.weight"
    _write(tmp_path, {**tensors, name: tensors[name].astype(np.int32)}, config)
    _refused(tmp_path, rf"tensor {name} is stored as I32, not a floating-point type")


def test_pickle_only_weights_are_refused_with_how_to_convert(tmp_path, paddle_ckpt):
    _, config = paddle_ckpt
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model_state.pdparams").write_bytes(b"\x80\x04 not read")
    _refused(
        tmp_path,
        r"model_state\.pdparams: pickle weights are not loaded; convert it to safetensors once.*"
        r"save_file\(paddle\.load\('model_state\.pdparams'\), 'model\.safetensors'\)",
    )


def test_multi_head_attention_is_refused_not_guessed(tmp_path):
    model = _model("dense", num_key_value_heads=4)  # as many kv heads as heads: fusion order ambiguous
    with pytest.raises(CheckpointError, match="num_key_value_heads == num_attention_heads"):
        paddle_state_dict(model)
    pt, pt_config = _pt_checkpoint(model, tmp_path / "pt")
    _write(tmp_path / "pd", _by_hand(pt), _paddle_config(pt_config))
    _refused(tmp_path / "pd", "num_key_value_heads == num_attention_heads: ERNIEKit fuses qkv_proj per head")


def test_scaled_rope_positions_are_refused(tmp_path, paddle_ckpt):
    tensors, config = paddle_ckpt
    _write(tmp_path, tensors, {**config, "compression_ratio": 2.0})
    _refused(tmp_path, r"compression_ratio=2\.0 \(scaled rope positions\) is not supported")
