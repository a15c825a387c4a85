"""GRPO / PPO held-out prompts (RLStage.build_eval_data) are checked against the control attributes the
policy learnt, as SFT's eval data is: a misspelled attribute is refused when the data is built, with one line
naming its file:line and the key, instead of being evaluated as a prefix the policy never trained on."""

from __future__ import annotations

import json

import pytest

from erniekit.config import load_config, validate
from erniekit.data.control import CONTROL_RECORD_NAME, count_controls, write_control_record
from erniekit.errors import DataError
from erniekit.models.ernie4_5 import get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.train.stages import get_stage

RUN = ["max_seq_len=64", "max_new_tokens=2", "num_generations=2", "reward_funcs=[format]", "beta=0"]
TRAIN = [{"prompt": f"{i}+1=", "control": {"style": "words"}} for i in range(3)] + [{"prompt": "2+2="}]
EVAL = [{"prompt": "5+1=", "control": {"style": "words"}}, {"prompt": "6+1=", "control": {"stlye": "words"}}]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _cfg(tmp_path, stage: str, *overrides):
    return validate(load_config(None, RUN + [f"stage={stage}", f"output_dir={tmp_path / 'out'}", *overrides]))


def _start_dir(path, record) -> str:
    """A directory model_name_or_path accepts (config.json), with `record` as its control_attributes.json."""
    path.mkdir()
    get_preset("tiny-moe").save_pretrained(str(path))
    write_control_record(str(path), record)
    return str(path)


@pytest.mark.parametrize("stage", ["GRPO", "PPO"])
def test_a_misspelled_held_out_attribute_is_refused_at_data_build(tmp_path, stage):
    train, held_out = _jsonl(tmp_path / "train.jsonl", TRAIN), _jsonl(tmp_path / "eval.jsonl", EVAL)
    cfg = _cfg(tmp_path, stage, f"train_dataset_path={train}", f"eval_dataset_path={held_out}")
    st, tok = get_stage(stage), default_tokenizer()
    st.build_train_rows(cfg, tok)
    with pytest.raises(DataError) as e:
        st.build_eval_data(cfg, tok)
    msg = str(e.value)
    assert msg.startswith(f"{held_out}:2: control stlye=words: this model was not trained with the attribute 'stlye'")
    assert "did you mean 'style'?" in msg and "trained: train_dataset_path" in msg and "\n" not in msg


def test_trained_attributes_pass_and_only_evaluated_prompts_are_checked(tmp_path):
    train, held_out = _jsonl(tmp_path / "train.jsonl", TRAIN), _jsonl(tmp_path / "eval.jsonl", EVAL)
    tok = default_tokenizer()
    cfg = _cfg(tmp_path, "GRPO", f"train_dataset_path={train}", f"eval_dataset_path={held_out}", "eval_max_samples=1")
    st = get_stage("GRPO")
    st.build_train_rows(cfg, tok)
    data = st.build_eval_data(cfg, tok)  # prompt 2 is never generated for
    assert [e.conv.control for e in data["examples"]] == [{"style": "words"}, {"stlye": "words"}]
    good = _jsonl(tmp_path / "good.jsonl", EVAL[:1] + [{"prompt": "7+1="}])
    cfg = _cfg(tmp_path, "GRPO", f"train_dataset_path={train}", f"eval_dataset_path={good}")
    assert len(st.build_eval_data(cfg, tok)["examples"]) == 2


def test_evaluation_without_training_checks_the_starting_models_record(tmp_path):
    """do_train=false: the policy is the starting model; its record is what it knows (here tone only, so
    the training prompts' style, which this run does not train on, is refused too)."""
    start = _start_dir(tmp_path / "start", count_controls([{"tone": "formal"}]))
    held_out = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "control": {"tone": "formal"}}] + EVAL)
    cfg = _cfg(tmp_path, "GRPO", f"model_name_or_path={start}", f"eval_dataset_path={held_out}", "do_train=false")
    with pytest.raises(DataError) as e:
        get_stage("GRPO").build_eval_data(cfg, default_tokenizer())
    msg = str(e.value)
    assert msg.startswith(f"{held_out}:2: control style=words: this model was not trained with the attribute 'style'")
    assert msg.endswith(f"({start}/{CONTROL_RECORD_NAME}; docs/control.md)") and "\n" not in msg
