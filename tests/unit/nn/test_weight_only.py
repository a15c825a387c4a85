"""Weight-only export (`erniekit export --format wint8|wint4`, erniekit/nn/weight_only.py): the
formats against a naive formula, and the round trip through export, load and --verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.weight_only import QUANTIZED, dequantize, quantize_int4, quantize_int8

ROOT = str(Path(__file__).resolve().parents[3])


def test_int8_is_per_output_channel_round_to_nearest():
    w = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
    q, s = quantize_int8(w)
    for o in range(6):  # naive: one row at a time
        scale = max(abs(float(x)) for x in w[o]) / 127
        assert s[o] == pytest.approx(scale)
        for i in range(10):
            assert q[o, i] == int(np.rint(w[o, i] / scale))
    d = dequantize(q, s)
    assert np.abs(d - w).max() <= s.max() / 2 + 1e-7


def test_int4_packs_two_values_a_byte_with_a_scale_per_group():
    w = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    q, s = quantize_int4(w, group_size=4)
    assert q.shape == (3, 8) and q.dtype == np.uint8 and s.shape == (3, 4)
    d = dequantize(q, s)
    for o in range(3):
        for i in range(16):
            scale = max(abs(float(x)) for x in w[o, (i // 4) * 4 : (i // 4) * 4 + 4]) / 7
            want = int(np.clip(np.rint(w[o, i] / scale), -8, 7))
            nib = int(q[o, i // 2] >> (4 * (i % 2))) & 0xF  # even index in the low nibble
            assert (nib - 16 if nib > 7 else nib) == want
            assert d[o, i] == pytest.approx(want * scale, rel=1e-6)
    with pytest.raises(ValueError, match="group size 5 must be even and divide the input size 16"):
        quantize_int4(w, 5)


def test_only_the_decoder_matrices_are_quantized():
    assert QUANTIZED.match("model.layers.3.self_attn.q_proj.weight")
    assert QUANTIZED.match("model.layers.1.mlp.experts.7.down_proj.weight")
    assert QUANTIZED.match("model.layers.0.mlp.shared_experts.up_proj.weight")
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.mlp.moe_statics.e_score_correction_bias",
    ):
        assert not QUANTIZED.match(name)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wq") / "src")
    paddle.seed(0)
    # dense: an MoE router flips near-tied experts under any weight noise, which hides the quantization error
    save_pretrained(Ernie4_5ForCausalLM(get_preset("tiny-dense")), path, tokenizer=default_tokenizer())
    return path


def _export(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "export", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("fmt, bytes_ratio, tol", [("hf", 1.0, 1e-6), ("wint8", 0.26, 0.03), ("wint4", 0.17, 0.3)])
def test_export_round_trip_and_verify(tmp_path, src, fmt, bytes_ratio, tol):
    out = str(tmp_path / fmt)
    r = _export(src, "-o", out, "--format", fmt, *(["--group-size", "16"] if fmt == "wint4" else []))
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.load(open(os.path.join(out, "export_info.json")))
    assert info["format"] == fmt and info["source"] == os.path.abspath(src)
    from safetensors.numpy import load_file

    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    mats = [k for k in a if QUANTIZED.match(k)]
    got = sum(b[k].nbytes + b.get(k + "_scale", np.zeros(0)).nbytes for k in mats)
    assert got / sum(a[k].nbytes for k in mats) == pytest.approx(bytes_ratio, abs=0.02)
    ids = paddle.to_tensor([[5, 17, 300, 42, 9, 1000]])
    with paddle.no_grad():
        ref = from_pretrained(src)(ids).logits.numpy()
        new = from_pretrained(out)(ids).logits.numpy()
    err = np.abs(ref - new).max() / np.abs(ref).max()
    assert err <= tol and (fmt != "hf" or err == 0.0), err
    r = _export("--verify", out)
    assert r.returncode == 0 and ": OK" in r.stdout, r.stdout + r.stderr


def test_verify_fails_loudly_on_a_tampered_export(tmp_path, src):
    out = str(tmp_path / "hf")
    assert _export(src, "-o", out).returncode == 0
    from safetensors.numpy import load_file, save_file

    f = os.path.join(out, "model.safetensors")
    t = load_file(f)
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"] * 3
    save_file(t, f, metadata={"format": "pt"})
    r = _export("--verify", out)
    assert r.returncode == 1 and "FAILED" in r.stdout
    r = _export("--verify", str(tmp_path))
    assert r.returncode == 2 and "no export_info.json" in r.stderr
