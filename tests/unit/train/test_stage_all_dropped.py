"""Stages whose data leaves nothing to train on refuse it while building rows, naming the dataset
path (train or eval) and why, instead of failing at the first batch with `pad_batch: empty batch`."""

from __future__ import annotations

import json
import warnings

import pytest

from erniekit.config import load_config, validate
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.train.stages import get_stage

ROWS = [{"src": ["12+34="], "tgt": ["46"]}, {"src": ["5-7="], "tgt": ["-2"]}]
MASKED = [dict(r, label=[0]) for r in ROWS]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _write(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return str(path)


def _cfg(tmp_path, train, *overrides, checked: bool = True):
    args = [f"train_dataset_path={train}", "max_seq_len=32", f"output_dir={tmp_path / 'out'}", *overrides]
    return validate(load_config(None, args)) if checked else load_config(None, args)


def _error(fn, *args) -> str:
    with warnings.catch_warnings(record=True) as caught, pytest.raises(DataError) as e:
        warnings.simplefilter("always")
        fn(*args)
    assert not caught, [str(w.message) for w in caught]  # one error, not warnings before it
    return str(e.value)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_every_example_truncated_away(tmp_path, tok, packing):
    train = _write(tmp_path / "train.jsonl", [dict(r, system="Answer with the number only, please.") for r in ROWS])
    cfg = _cfg(tmp_path, train, "max_seq_len=8", "truncation=truncate", f"packing={str(packing).lower()}")
    assert _error(get_stage("SFT").build_train_rows, cfg, tok) == (
        f"{train}: all 2 examples were dropped (2 with a prompt longer than max_seq_len=8); raise max_seq_len"
    )


def test_sft_eval_set_every_label_zero(tmp_path, tok):
    train = _write(tmp_path / "train.jsonl", ROWS)
    ev = _write(tmp_path / "eval.jsonl", MASKED)
    cfg = _cfg(tmp_path, train, f"eval_dataset_path={ev}")
    stage = get_stage("SFT")
    assert len(stage.build_train_rows(cfg, tok)) == 2
    assert _error(stage.build_eval_data, cfg, tok) == (
        f"{ev}: all 2 examples were dropped (2 with no trained reply (every label 0)); check the labels"
    )


def test_distill_every_label_zero(tmp_path, tok):
    train = _write(tmp_path / "train.jsonl", MASKED)
    cfg = _cfg(tmp_path, train, "stage=Distill", checked=False)  # validation would want a teacher checkpoint
    assert _error(get_stage("Distill").build_train_rows, cfg, tok) == (
        f"{train}: all 2 examples were dropped (2 with no trained reply (every label 0)); check the labels"
    )


def test_pretrain_every_document_empty(tmp_path, tok):
    train = _write(tmp_path / "pt.jsonl", [{"text": ""}, {"text": ""}, {"text": ""}])
    cfg = _cfg(tmp_path, train, "stage=pretrain", "train_dataset_type=text")
    assert _error(get_stage("pretrain").build_train_rows, cfg, tok) == (
        f"{train}: all 3 documents are empty (no token to train on); check the text field"
    )
    one = _write(tmp_path / "one.jsonl", [{"text": ""}, {"text": "1"}])  # one token and its end: trained
    assert len(get_stage("pretrain").build_train_rows(_cfg(tmp_path, one, "stage=pretrain"), tok)) == 1


def test_vl_sft_every_label_zero(tmp_path, tok):
    train = _write(tmp_path / "train.jsonl", MASKED)
    cfg = _cfg(tmp_path, train, "stage=VL-SFT", "model_name_or_path=tiny-vl", "max_seq_len=48")
    assert _error(get_stage("VL-SFT").build_train_rows, cfg, tok) == (
        f"{train}: none of the 2 examples has a trained token (every label 0); check the labels"
    )


def test_a_run_refuses_its_data_before_loading_the_model(tmp_path, monkeypatch):
    """A real checkpoint takes minutes to load: the data's mistake is said first."""
    import erniekit.train.run as run

    def no_model(cfg):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(run, "load_model", no_model)
    cfg = _cfg(tmp_path, _write(tmp_path / "masked.jsonl", MASKED), "max_steps=1", "do_eval=false")
    with pytest.raises(DataError, match=r"masked.jsonl: all 2 examples were dropped"):
        run.run_train(cfg, log=lambda *_: None)


def test_pretrain_rows_of_a_long_one_line_document_stay_small(tmp_path, tok, monkeypatch):
    """A one-line document of N tokens used to peak at ~100 bytes a token (Python id lists, then four
    int64 arrays per packed row): a 500 MB line took tens of GB. Now the ids are one int32 array and
    the line is tokenized in pieces."""
    import tracemalloc

    import erniekit.data.encode as enc

    monkeypatch.setattr(enc, "PRETRAIN_PIECE_CHARS", 20_000, raising=False)
    train = tmp_path / "one-line.txt"
    train.write_text("12+34=46 " * 30_000 + "\n", encoding="utf-8")  # 270k tokens (digits are single tokens)
    cfg = _cfg(tmp_path, str(train), "stage=pretrain", "train_dataset_type=text")
    tracemalloc.start()
    try:
        rows = get_stage("pretrain").build_train_rows(cfg, tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows) == -(-270_001 // 32) and rows[0]["input_ids"].shape == (32,)
    assert peak < 20 * 270_000, peak  # was ~90 bytes a token
