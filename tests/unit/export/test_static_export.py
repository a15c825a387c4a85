"""`erniekit export --format paddle|onnx`: the decoding step as a static graph under
paddle.inference and onnxruntime gives the eager model's logits, for prefill and decode, dense
and MoE (whose static form runs every expert: checked against the grouped GEMM here too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.export.static import StepRunner
from erniekit.infer.generate import generate
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.hf_files import STAGING_NAME
from erniekit.nn.moe import StackedExperts

ROOT = str(Path(__file__).resolve().parents[3])


def test_every_expert_form_equals_the_grouped_gemm():
    paddle.seed(0)
    ex = StackedExperts(6, 16, 24)
    x = paddle.randn([40, 16])
    idx = paddle.to_tensor(np.random.default_rng(0).integers(0, 6, size=(40, 2)))
    idx = paddle.where(idx[:, :1] == idx[:, 1:], (idx + paddle.to_tensor([[0, 1]])) % 6, idx)  # distinct experts
    w = paddle.rand([40, 2])
    keep = paddle.to_tensor(np.random.default_rng(1).random((40, 2)) > 0.2)
    for k in (None, keep):
        np.testing.assert_allclose(
            ex._forward_every_expert(x, idx, w, k).numpy(), ex(x, idx, w, k).numpy(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("fmt", ["paddle", "onnx"])
def test_static_step_decodes_like_eager(tmp_path, preset, fmt):
    pytest.importorskip("paddle2onnx" if fmt == "onnx" else "paddle")
    src, out = str(tmp_path / "src"), str(tmp_path / fmt)
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    save_pretrained(
        Ernie4_5ForCausalLM(get_preset(preset).replace(initializer_range=0.5)), src, tokenizer=default_tokenizer()
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "export", src, "-o", out, "--format", fmt],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    assert STAGING_NAME not in r.stdout + r.stderr  # no line names the temporary directory
    if fmt == "onnx":  # our line, naming where the model is, in place of paddle2onnx's
        assert f"ONNX model saved in {os.path.join(out, 'model.onnx')}\n" in r.stdout, r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "export", "--verify", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and ": OK" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "Removing initializer" not in r.stderr, r.stderr[-2000:]  # onnxruntime's warnings are off
    model = from_pretrained(src)
    model.eval()
    runner = StepRunner(out, fmt, model.config)
    prompt = [5, 17, 300, 42, 9, 1000, 77]
    want = generate(model, [prompt], SamplingParams(max_new_tokens=10))[0]
    got = [int(runner.prefill(prompt).argmax())]
    for _ in range(9):
        got.append(int(runner.decode(got[-1]).argmax()))
    assert got == want
