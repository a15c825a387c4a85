"""`erniekit export` of an ERNIE-4.5-VL checkpoint: the HF-layout export keeps the image sizes it
trained with, and `--verify` compares a prompt with a picture, reloaded by erniekit and by
transformers, against the source; a corrupted vision weight fails it."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from erniekit.export.hf import export_hf, verify
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
from erniekit.models.ernie4_5_vl.processor import ImageSettings
from erniekit.models.registry import model_config, save_model

transformers = pytest.importorskip("transformers")


@pytest.fixture
def src(tmp_path):
    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.2))
    model.image_settings = ImageSettings(min_pixels=56 * 56, max_pixels=112 * 112)
    save_model(model, str(tmp_path / "src"), tokenizer=default_tokenizer())
    return tmp_path


def test_vl_export_verifies_with_a_picture_in_erniekit_and_transformers(src):
    from safetensors.numpy import load_file, save_file

    out = str(src / "out")
    export_hf(str(src / "src"), out)
    assert json.load(open(src / "out" / "preprocessor_config.json"))["size"]["longest_edge"] == 112 * 112
    r = verify(out)
    assert r["ok"] and r["max_abs_diff"] == 0.0
    if hasattr(transformers, "Ernie4_5_VLMoeForConditionalGeneration"):
        assert r["transformers_max_abs_diff"] is not None and r["transformers_max_abs_diff"] <= r["tolerance"]
    tensors = load_file(str(src / "out" / "model.safetensors"))
    name = next(k for k in tensors if "vision_model.patch_embed" in k)
    noise = np.random.default_rng(0).standard_normal(tensors[name].shape).astype(np.float32)
    tensors[name] = tensors[name] + noise  # a corrupted vision weight: text prompts cannot tell
    save_file(tensors, str(src / "out" / "model.safetensors"), metadata={"format": "pt"})
    bad = verify(out)
    assert not bad["ok"] and bad["max_abs_diff"] > bad["tolerance"], (name, bad)
