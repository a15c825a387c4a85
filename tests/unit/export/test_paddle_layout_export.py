"""`erniekit export --format paddle-layout`: the -Paddle checkpoint layout with the config.json
FastDeploy reads as a Paddle checkpoint; erniekit loads it back to the source's logits."""

import json
import os
import re

import numpy as np
import paddle
import pytest
from safetensors import safe_open

from erniekit.errors import CheckpointError
from erniekit.export.formats import format_names
from erniekit.export.hf import export_hf, verify
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.checkpoint import save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.registry import load_model

IDS = paddle.to_tensor([[5, 17, 300, 2, 911, 64, 7, 128]], dtype="int64")


def _source(path, preset: str, **over) -> str:
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset(preset).replace(**over))
    for name, p in model.named_parameters():  # logits large enough that a wrong block would show
        noise = paddle.randn(p.shape, dtype=p.dtype)
        p.set_value(1.0 + 0.1 * noise if "norm" in name else (0.02 if "correction" in name else 0.15) * noise)
    save_pretrained(model, str(path), tokenizer=default_tokenizer())
    return str(path)


def _tensors(out: str) -> dict:
    """name -> (shape, safetensors dtype) over every shard."""
    found = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out, f), framework="numpy") as h:
                for k in h.keys():
                    view = h.get_slice(k)
                    found[k] = (view.get_shape(), view.get_dtype())
    return found


def _logits(path: str) -> np.ndarray:
    model = load_model(path)
    model.eval()
    with paddle.no_grad():
        return model(IDS).logits.numpy()


def test_the_format_is_listed_after_the_other_built_ins():
    assert format_names()[:6] == ["hf", "wint8", "wint4", "paddle", "onnx", "paddle-layout"]


@pytest.mark.parametrize("moe", [False, True])
def test_export_writes_fastdeploys_paddle_checkpoint_and_verifies(tmp_path, moe):
    over = {"tie_word_embeddings": False, "num_nextn_predict_layers": 1} if moe else {}
    src = _source(tmp_path / "src", "tiny-moe" if moe else "tiny-dense", **over)
    out = export_hf(src, str(tmp_path / "out"), fmt="paddle-layout")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # FastDeploy reads `dtype` (and no `torch_dtype`) as the Paddle format, `architectures` picks its model class
    assert "torch_dtype" not in config and config["dtype"] == "float32"
    assert config["architectures"] == ["Ernie4_5_MoeForCausalLM" if moe else "Ernie4_5_ForCausalLM"]
    assert config["model_type"] == ("ernie4_5_moe" if moe else "ernie4_5")
    assert (tmp_path / "out" / "generation_config.json").is_file() and (tmp_path / "out" / "tokenizer.model").is_file()
    tensors = _tensors(out)
    assert not any(k.startswith("model.") or ".q_proj." in k or ".gate_proj." in k for k in tensors)
    assert tensors["ernie.layers.0.self_attn.qkv_proj.weight"][0] == [128, 128 + 2 * 64]  # [in, q | k | v]
    assert tensors["ernie.layers.0.mlp.up_gate_proj.weight"][0] == [128, 2 * 384]
    assert tensors["ernie.layers.0.self_attn.o_proj.weight"][0] == [128, 128]
    if moe:
        assert tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.weight"][0] == [128, 2 * 128]
        assert tensors["ernie.layers.1.mlp.gate.weight"][0] == [128, 8]
        assert tensors["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"][0] == [1, 8]
        assert tensors["lm_head.weight"][0] == [128, 1024]  # untied: [hidden, vocab]
        assert "ernie.mtp_block.0.self_attn.qkv_proj.weight" in tensors
    else:
        assert "lm_head.weight" not in tensors  # tied
    r = verify(out)
    assert r["ok"] and r["format"] == "paddle-layout" and r["max_abs_diff"] <= 1e-5 and r["same_greedy"] == 1.0
    np.testing.assert_allclose(_logits(out), _logits(src), rtol=0, atol=1e-5)


def test_a_sharded_bfloat16_export_keeps_the_router_in_float32(tmp_path):
    src = _source(tmp_path / "src", "tiny-moe")
    out = export_hf(src, str(tmp_path / "out"), fmt="paddle-layout", dtype="bfloat16", max_shard_size="200KB")
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    # FastDeploy's unified-checkpoint check: model-0000i-of-0000n.safetensors, all of them present
    assert len(files) > 1 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = _tensors(out)
    assert tensors["ernie.layers.1.mlp.gate.weight"][1] == "F32"
    assert tensors["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"][1] == "F32"
    assert tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.weight"][1] == "BF16"
    r = verify(out)
    assert r["ok"] and 0 < r["max_abs_diff"] <= r["tolerance"]


def test_verify_refuses_an_export_whose_config_fastdeploy_would_read_as_pt(tmp_path):
    src = _source(tmp_path / "src", "tiny-dense")
    out = export_hf(src, str(tmp_path / "out"), fmt="paddle-layout")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    with pytest.raises(CheckpointError, match="not FastDeploy's Paddle flavour"):
        verify(out)


def test_multi_head_attention_is_refused_before_anything_is_written(tmp_path):
    src = _source(tmp_path / "src", "tiny-dense", num_key_value_heads=4)
    with pytest.raises(CheckpointError, match="export --format paddle-layout: num_key_value_heads == num_att"):
        export_hf(src, str(tmp_path / "out"), fmt="paddle-layout")
    assert not (tmp_path / "out").exists()
