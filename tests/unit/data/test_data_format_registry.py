"""Adding an SFT data format is one reader with `@register_sft_format` (CONTRIBUTING.md): config
accepts its name, auto-detection finds it, and SFT trains on it."""

import json

import pytest

from erniekit.data.formats import Conversation, load_sft_examples, register_sft_format, unregister_sft_format
from erniekit.errors import ConfigError, DataError


def _read_qa(rec: dict, where: str) -> Conversation:
    if not isinstance(rec.get("q"), str) or not isinstance(rec.get("a"), str):
        raise DataError(f"{where}: a qa record needs string fields 'q' and 'a'")
    return Conversation(None, [(rec["q"], rec["a"])], [True], where)


@pytest.fixture
def qa(tmp_path):
    register_sft_format("qa", detect=lambda rec: "q" in rec and "a" in rec)(_read_qa)
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(40)))
    yield str(path)
    unregister_sft_format("qa")


def _cfg(tmp_path, path, *extra):
    from erniekit.config import load_config, validate

    return validate(
        load_config(
            None,
            [
                "stage=SFT",
                "model_name_or_path=tiny-dense",
                "model_overrides.num_hidden_layers=1",
                f"train_dataset_path={path}",
                "max_steps=2",
                "per_device_train_batch_size=4",
                "max_seq_len=32",
                "do_eval=false",
                "save_steps=100",
                "disable_tqdm=true",
                f"output_dir={tmp_path / 'out'}",
                *extra,
            ],
        )
    )


def test_a_registered_format_is_read_detected_and_trained_on(qa, tmp_path):
    convs = load_sft_examples(qa)  # auto-detected
    assert convs[3].turns == [("3+1=", "4")] and convs[3].source.endswith(":4")
    assert _cfg(tmp_path, qa, "train_dataset_type=QA").train_dataset_type == "qa"
    from erniekit.train.run import run_train

    res = run_train(_cfg(tmp_path, qa), log=lambda s: None)
    assert res["train"]["train/loss"] > 0 and (tmp_path / "out" / "checkpoint-2").is_dir()


def test_its_reader_reports_bad_records_and_an_unregistered_name_is_refused(qa, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "1+1=", "a": 2}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: a qa record needs string fields"):
        load_sft_examples(str(bad), "qa")
    unregister_sft_format("qa")
    with pytest.raises(ConfigError, match="train_dataset_type"):
        _cfg(tmp_path, qa, "train_dataset_type=qa")
    with pytest.raises(DataError, match="cannot tell the data format"):
        load_sft_examples(qa)
