"""`erniekit export`: LoRA merged into a self-contained HF directory that transformers and chat load."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.models.ernie4_5 import from_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.lora import LoraConfig, apply_lora, lora_layers, save_adapter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ROOT = str(Path(__file__).resolve().parents[3])


@pytest.mark.parametrize("moe", [False, True])
def test_export_merges_lora_and_transformers_agrees(tmp_path, moe):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    if moe:
        cfg = transformers.Ernie4_5_MoeConfig(
            **kw,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        )
        hf = transformers.Ernie4_5_MoeForCausalLM(cfg)
    else:
        hf = transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**kw))
    base = tmp_path / "base"
    hf.save_pretrained(base)
    default_tokenizer().save_pretrained(str(base))

    model = from_pretrained(str(base))
    apply_lora(model, LoraConfig(r=4, lora_alpha=8))
    paddle.seed(1)
    for _, layer in lora_layers(model):  # a non-trivial adapter
        for p in layer.lora_b_params():
            p.set_value(paddle.randn(p.shape) * 0.1)
    adapter = tmp_path / "adapter"
    save_adapter(model, str(adapter), base_model_name_or_path=str(base))
    default_tokenizer().save_pretrained(str(adapter))
    ids = np.array([[3, 281, 971, 949, 958, 959, 979, 964]])
    model.eval()
    want = model(paddle.to_tensor(ids)).logits.numpy()

    out = tmp_path / "export"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "export", str(adapter), "-o", str(out), "--max-shard-size", "20KB"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert not any("lora" in k for k in index["weight_map"])
    for f in ("config.json", "generation_config.json", "tokenizer.model", "tokenizer_config.json"):
        assert (out / f).exists()
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())

    np.testing.assert_allclose(from_pretrained(str(out))(paddle.to_tensor(ids)).logits.numpy(), want, atol=1e-4)
    cls = transformers.Ernie4_5_MoeForCausalLM if moe else transformers.Ernie4_5ForCausalLM
    back = cls.from_pretrained(str(out)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(ids)).logits.numpy(), want, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("12+34=", add_special_tokens=False) == default_tokenizer().encode("12+34=")


def test_export_refuses_to_overwrite_its_source(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "export", str(tmp_path), "-o", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error:")
