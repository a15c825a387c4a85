"""A PEFT-saved adapter directory (no tokenizer, no config.json) loads through the registry the
way chat, export, the server, the WebUI and eval load a checkpoint: base model and tokenizer come
from base_model_name_or_path (as given, else relative to the adapter), or from --base-model."""

import os
import shutil

import numpy as np
import paddle
import pytest
from peft_adapters import make_peft_adapter, set_base

from erniekit.errors import CheckpointError
from erniekit.infer.chat import load_chat_model
from erniekit.models.registry import adapter_base_override, load_model_or_adapter, load_tokenizer, tokenizer_dir

pytest.importorskip("peft")
IDS = [[3, 281, 971, 949, 958, 959, 979, 964]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_peft_adapter(str(tmp_path_factory.mktemp("peft")))


@pytest.fixture(scope="module")
def merged_logits(dirs):
    model, _ = load_chat_model(dirs["merged"])
    return model(paddle.to_tensor(IDS)).logits.numpy()


def _logits(path):
    model, tok = load_chat_model(path)
    assert tok.encode("What is 2+3?") == load_tokenizer(path).encode("What is 2+3?")
    return model(paddle.to_tensor(IDS)).logits.numpy()


def _copy(dirs, tmp_path, base):
    adapter = str(tmp_path / "adapter")
    shutil.copytree(dirs["adapter"], adapter)
    set_base(adapter, base)
    return adapter


def test_peft_adapter_without_tokenizer_equals_peft_merge(dirs, merged_logits):
    assert tokenizer_dir(dirs["adapter"]) == dirs["base"]
    np.testing.assert_allclose(_logits(dirs["adapter"]), merged_logits, atol=1e-5)
    # what eval and export load (erniekit/routing/report.py, erniekit/export/hf.py)
    model = load_model_or_adapter(dirs["adapter"])
    np.testing.assert_allclose(model(paddle.to_tensor(IDS)).logits.numpy(), merged_logits, atol=1e-5)


def test_relative_base_is_found_beside_the_adapter(dirs, merged_logits, tmp_path, monkeypatch):
    shutil.copytree(dirs["base"], tmp_path / "base")
    adapter = _copy(dirs, tmp_path, "../base")  # PEFT wrote the path training ran with
    monkeypatch.chdir(dirs["merged"])  # not found as given from here, found against the adapter
    np.testing.assert_allclose(_logits(adapter), merged_logits, atol=1e-5)


def test_missing_base_is_one_line_naming_what_was_tried(dirs, tmp_path, monkeypatch):
    adapter = _copy(dirs, tmp_path, "gone/base")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        load_chat_model(adapter)
    msg = str(e.value)
    assert "\n" not in msg and "--base-model" in msg
    assert os.path.join(str(tmp_path), "gone", "base") in msg and os.path.join(adapter, "gone", "base") in msg


def test_base_override_wins(dirs, merged_logits, tmp_path):
    adapter = _copy(dirs, tmp_path, "/nowhere/base")
    with adapter_base_override(dirs["base"]):
        np.testing.assert_allclose(_logits(adapter), merged_logits, atol=1e-5)
    with pytest.raises(CheckpointError, match="not a directory"):
        with adapter_base_override(str(tmp_path / "nope")):
            pass
