"""Adding an export format is one module with `register_export_format` (CONTRIBUTING.md): the
registry lists it, `export_hf` writes it, `--verify` checks it with the format's own verifier."""

import json

import pytest

from erniekit.errors import CheckpointError
from erniekit.export.formats import (
    ExportFormat,
    ExportOptions,
    format_names,
    register_export_format,
    unregister_export_format,
)
from erniekit.export.formats.hf import verify_layout, write_layout


def _write_half(model, tokenizer, out, info, options: ExportOptions):
    """The Hugging Face layout in float16, whatever --dtype says."""
    info["note"] = "float16 weights"
    write_layout(model, tokenizer, out, info, ExportOptions(options.max_shard_size, "float16", options.group_size))


@pytest.fixture
def half():
    fmt = register_export_format(
        ExportFormat(
            name="hf16",
            help="hf16: the hf layout in float16",
            write=_write_half,
            verify=lambda out, info, ref, tok, atol: verify_layout(out, info, ref, tok, atol, 1e-2),
        )
    )
    yield fmt
    unregister_export_format("hf16")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.models.ernie4_5.checkpoint import save_pretrained
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    paddle.seed(0)
    path = str(tmp_path_factory.mktemp("src") / "tiny")
    save_pretrained(Ernie4_5ForCausalLM(get_preset("tiny-dense")), path, tokenizer=default_tokenizer())
    return path


def test_a_registered_format_is_listed_written_and_verified(half, ckpt, tmp_path):
    from safetensors import safe_open

    from erniekit.export.hf import export_hf, verify

    assert format_names()[:5] == ["hf", "wint8", "wint4", "paddle", "onnx"] and format_names()[-1] == "hf16"
    out = export_hf(ckpt, str(tmp_path / "half"), fmt="hf16")
    info = json.loads((tmp_path / "half" / "export_info.json").read_text())
    assert info["format"] == "hf16" and info["note"] == "float16 weights"
    with safe_open(str(tmp_path / "half" / "model.safetensors"), framework="numpy") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"float16"}
    r = verify(out)
    assert r["ok"] and r["format"] == "hf16" and 0 < r["max_abs_diff"] <= r["tolerance"]


def test_an_unregistered_format_is_refused_before_loading(ckpt, tmp_path):
    from erniekit.export.hf import export_hf

    with pytest.raises(CheckpointError, match="unknown export format 'hf16'; use one of hf, wint8"):
        export_hf(ckpt, str(tmp_path / "x"), fmt="hf16")
    assert not (tmp_path / "x").exists()
