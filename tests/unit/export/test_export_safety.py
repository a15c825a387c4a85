"""`erniekit export` must never overwrite what it reads, never ignore an option silently, never
leave two formats' weights in one directory, and `--verify` must judge a 16-bit export by 16-bit
rounding."""

import json
import os

import pytest

from erniekit.errors import CheckpointError
from erniekit.export.formats import (
    RELATIVE_TOLERANCE,
    ExportFormat,
    ExportOptions,
    export_format,
    format_names,
    register_export_format,
    unregister_export_format,
)
from erniekit.export.hf import export_hf, verify


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny-dense checkpoint and a non-trivial LoRA adapter on it."""
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.models.ernie4_5.checkpoint import save_pretrained
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.nn.lora import LoraConfig, apply_lora, lora_layers, save_adapter

    root = tmp_path_factory.mktemp("ckpts")
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-dense"))
    save_pretrained(model, str(root / "base"), tokenizer=default_tokenizer())
    apply_lora(model, LoraConfig(r=4, lora_alpha=8))
    for _, layer in lora_layers(model):
        for p in layer.lora_b_params():
            p.set_value(paddle.randn(p.shape) * 0.1)
    save_adapter(model, str(root / "lora"), base_model_name_or_path=str(root / "base"))
    return {"base": str(root / "base"), "lora": str(root / "lora")}


def _files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def test_a_symlink_to_the_source_is_the_source(ckpts, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ckpts["base"])
    before = _files(ckpts["base"])
    with pytest.raises(CheckpointError, match=f"--output {link} is the source directory"):
        export_hf(ckpts["base"], str(link), dtype="float16", force=True)
    assert _files(ckpts["base"]) == before


def test_an_adapter_is_not_merged_over_its_base(ckpts, tmp_path):
    from erniekit.models.registry import adapter_base_override

    before = _files(ckpts["base"])
    with pytest.raises(CheckpointError, match=f"is the base checkpoint {ckpts['base']} of the adapter"):
        export_hf(ckpts["lora"], ckpts["base"], force=True)  # adapter_config.json's base_model_name_or_path
    link = tmp_path / "base-link"
    link.symlink_to(ckpts["base"])
    with adapter_base_override(str(link)), pytest.raises(CheckpointError, match="is the base checkpoint"):
        export_hf(ckpts["lora"], ckpts["base"], force=True)  # --base-model, through a symlink
    assert _files(ckpts["base"]) == before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_hf_export_is_verified_within_its_rounding(ckpts, tmp_path, dtype):
    out = export_hf(ckpts["base"], str(tmp_path / dtype), dtype=dtype, max_shard_size="1MB")
    info_file = os.path.join(out, "export_info.json")
    info = json.loads(open(info_file).read())
    assert info["dtype"] == dtype
    r = verify(out)
    # float32's tolerance would fail it: the rounding moves the logits by more than 1e-4 of the largest
    assert r["ok"] and r["max_abs_diff"] > RELATIVE_TOLERANCE["float32"] * max(1.0, r["max_logit"])
    assert r["tolerance"] == pytest.approx(RELATIVE_TOLERANCE[dtype] * max(1.0, r["max_logit"]))
    del info["dtype"]  # an export written before the dtype was recorded: read from the shards' headers
    open(info_file, "w").write(json.dumps(info))
    assert verify(out)["tolerance"] == r["tolerance"]


def test_a_float32_export_keeps_the_float32_tolerance(ckpts, tmp_path):
    out = export_hf(ckpts["base"], str(tmp_path / "f32"))
    assert json.loads(open(os.path.join(out, "export_info.json")).read())["dtype"] == "float32"
    r = verify(out)
    assert r["ok"] and r["tolerance"] == pytest.approx(RELATIVE_TOLERANCE["float32"] * max(1.0, r["max_logit"]))


@pytest.mark.parametrize(
    ("fmt", "options", "message"),
    [
        ("paddle", {"dtype": "float16"}, "--format paddle: --dtype float16 is not supported"),
        ("onnx", {"dtype": "bfloat16"}, "--format onnx: --dtype bfloat16 is not supported"),
        ("wint8", {"dtype": "float16"}, "--format wint8: --dtype float16 is not supported"),
        ("wint4", {"dtype": "bfloat16"}, "--format wint4: --dtype bfloat16 is not supported"),
        ("hf", {"dtype": "q8_0"}, "--format hf: --dtype q8_0 is not one it writes"),
        ("paddle", {"max_shard_size": "1MB"}, "--format paddle: --max-shard-size 1MB is not supported"),
        ("onnx", {"max_shard_size": "1MB"}, "--format onnx: --max-shard-size 1MB is not supported"),
        ("gguf", {"max_shard_size": "1MB"}, "--format gguf: --max-shard-size 1MB is not supported"),
        ("hf", {"max_shard_size": "5XB"}, r"--max-shard-size '5XB' is not a size; use bytes or a size like '5GB'"),
    ],
)
def test_an_option_a_format_would_ignore_is_refused_before_anything_is_written(ckpts, tmp_path, fmt, options, message):
    with pytest.raises(CheckpointError, match=message):
        export_hf(ckpts["base"], str(tmp_path / "out"), fmt=fmt, **options)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_an_ignored_option_with_exit_2(ckpts, tmp_path):
    """Through `erniekit export` (erniekit/export/command.py), before paddle loads the model."""
    from erniekit import cli
    from erniekit.errors import ErniekitError

    with pytest.raises(ErniekitError, match="--format paddle: --dtype float16 is not supported"):
        cli.export([ckpts["base"], "-o", str(tmp_path / "x"), "--format", "paddle", "--dtype", "float16"])
    with pytest.raises(ErniekitError, match="--format gguf: --max-shard-size is not supported"):
        cli.export([ckpts["base"], "-o", str(tmp_path / "x"), "--format", "gguf", "--max-shard-size", "2GB"])
    # the defaults spelled out are refused too: the flag was given to a format that ignores it
    with pytest.raises(ErniekitError, match="--format onnx: --max-shard-size is not supported"):
        cli.export([ckpts["base"], "-o", str(tmp_path / "x"), "--format", "onnx", "--max-shard-size", "5GB"])
    with pytest.raises(ErniekitError, match="--format wint8: --group-size applies to --format wint4 only"):
        cli.export([ckpts["base"], "-o", str(tmp_path / "x"), "--format", "wint8", "--group-size", "64"])
    assert not (tmp_path / "x").exists()


def test_the_built_in_formats_declare_their_options():
    declared = {n: (export_format(n).dtypes, export_format(n).shards) for n in format_names()}
    assert declared["hf"] == declared["paddle-layout"] == (("float32", "bfloat16", "float16"), True)
    assert declared["gguf"] == (("float32", "float16", "bfloat16", "q8_0"), False)
    assert declared["wint8"] == declared["wint4"] == ((), True)
    assert declared["paddle"] == declared["onnx"] == ((), False)


def test_a_new_format_that_declares_nothing_refuses_every_option(ckpts, tmp_path):
    from erniekit.export.formats.hf import verify_layout, write_layout

    register_export_format(
        ExportFormat(
            name="plain",
            help="plain: a test format",
            write=write_layout,
            verify=lambda out, info, ref, tok, atol: verify_layout(out, info, ref, tok, atol, 1e-4),
        )
    )
    try:
        for options in ({"dtype": "float16"}, {"max_shard_size": "1MB"}):
            with pytest.raises(CheckpointError, match="--format plain: .* is not supported"):
                export_format("plain").check_options(ExportOptions(**options))
        export_format("plain").check_options(ExportOptions())  # the defaults are what every format gets
    finally:
        unregister_export_format("plain")


def test_force_replaces_an_export_of_the_same_format_only(ckpts, tmp_path):
    out = str(tmp_path / "mix")
    export_hf(ckpts["lora"], out)
    before = _files(out)
    for fmt in ("gguf", "paddle", "paddle-layout"):
        with pytest.raises(CheckpointError, match=f"--output {out} holds a hf export; .*same format \\({fmt}\\)"):
            export_hf(ckpts["base"], out, fmt=fmt, force=True)
    assert _files(out) == before  # nothing written, nothing removed
    export_hf(ckpts["base"], out, force=True, dtype="float16")  # the same format: replaced
    assert set(os.listdir(out)) == set(before) and _files(out)["model.safetensors"] != before["model.safetensors"]


def test_an_export_killed_after_its_weights_is_replaced_by_force(ckpts, tmp_path, monkeypatch):
    """It held weights but no export_info.json, which --force refuses: it had to be removed by hand."""
    from erniekit.models import registry

    real = registry.save_model

    def killed(*args, **kw):
        real(*args, **kw)
        raise KeyboardInterrupt  # after the weights are published, before export_info.json

    out = str(tmp_path / "out")
    monkeypatch.setattr(registry, "save_model", killed)
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpts["base"], out)
    monkeypatch.setattr(registry, "save_model", real)
    with pytest.raises(CheckpointError, match="this export did not finish"):
        verify(out)
    export_hf(ckpts["base"], out, force=True)
    assert verify(out)["ok"]


def test_force_does_not_write_over_weights_that_are_no_export(ckpts, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpts["base"], ckpt)  # a training checkpoint: no export_info.json
    before = _files(ckpt)
    with pytest.raises(CheckpointError, match="holds model weights \\(model.safetensors\\) but no export_info.json"):
        export_hf(ckpts["lora"], str(ckpt), force=True)
    assert _files(ckpt) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("kept")
    export_hf(ckpts["base"], str(notes), force=True)  # no weights in it: --force writes beside the rest
    assert (notes / "README.md").read_text() == "kept" and (notes / "model.safetensors").exists()


def test_the_control_record_goes_with_the_export_and_force_drops_a_stale_one(ckpts, tmp_path):
    """chat and the server check --control against control_attributes.json (docs/control.md): an
    export that dropped it left an exported control model unchecked."""
    import shutil

    from erniekit.data.control import CONTROL_RECORD_NAME, count_controls, read_control_record, write_control_record

    record = count_controls([{"style": "words"}, {"style": "digits"}])
    src, lora = tmp_path / "src", tmp_path / "lora"
    shutil.copytree(ckpts["base"], src)
    shutil.copytree(ckpts["lora"], lora)
    write_control_record(str(src), record)
    out = str(tmp_path / "out")
    export_hf(str(src), out)
    assert read_control_record(out) == record
    export_hf(ckpts["base"], out, force=True)  # a model trained without controls replaces it
    assert not os.path.exists(os.path.join(out, CONTROL_RECORD_NAME))
    with open(lora / "adapter_config.json") as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = str(src)
    with open(lora / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    merged = str(tmp_path / "merged")
    export_hf(str(lora), merged)  # an adapter without a record keeps its base's
    assert read_control_record(merged) == record


def test_a_damaged_control_record_is_refused_before_anything_is_written(ckpts, tmp_path):
    """Read at the end, it failed a finished export and left weights without export_info.json,
    which even --force then refused to replace."""
    import shutil

    from erniekit.data.control import CONTROL_RECORD_NAME

    src = tmp_path / "src"
    shutil.copytree(ckpts["base"], src)
    (src / CONTROL_RECORD_NAME).write_text('{"version": 1, "attributes": []}')
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="'attributes' must be an object"):
        export_hf(str(src), str(out))
    assert not out.exists()
