"""RL stages and control_attributes.json (docs/control.md): a GRPO run continued from a model whose
record lacks its prompts' attributes ends (and checkpoints, and resumes) with them counted; PPO counts
them the same way; a damaged starting record stops the run before the model loads."""

from __future__ import annotations

import json
import os

import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.data.control import CONTROL_RECORD_NAME, count_controls, read_control_record, write_control_record
from erniekit.errors import CheckpointError

TINY = [
    "model_overrides.num_hidden_layers=1",
    "model_overrides.hidden_size=32",
    "model_overrides.intermediate_size=64",
    "model_overrides.moe_intermediate_size=32",
]
RUN = [
    "max_seq_len=64",
    "max_new_tokens=2",
    "num_generations=2",
    "per_device_train_batch_size=4",
    "reward_funcs=[format]",
    "beta=0",
    "logging_steps=1",
    "disable_tqdm=true",
    "do_eval=false",
    "save_total_limit=0",
]
# the starting model learnt style=digits only; the prompts add style=words and a key, tone
START = count_controls([{"style": "digits"}] * 3)
PROMPTS = (
    [{"prompt": f"{i}+1=", "control": {"style": "words"}} for i in range(5)]
    + [{"prompt": f"{i}*2=", "control": {"style": "digits", "tone": "formal"}} for i in range(2)]
    + [{"prompt": "9-1="}]
)


def _cfg(out, *overrides, stage="GRPO"):
    return validate(load_config(None, RUN + [f"stage={stage}", f"output_dir={out}", *overrides]))


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny model directory with weights, tokenizer and START as its record; the prompt file."""
    from erniekit.models.ernie4_5.checkpoint import save_pretrained
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.train.run import load_model

    root = tmp_path_factory.mktemp("rl-control")
    paddle.seed(0)
    model = load_model(_cfg(root / "unused", *TINY))
    save_pretrained(model, str(root / "start"), tokenizer=default_tokenizer())
    write_control_record(str(root / "start"), START)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return str(root / "start"), str(prompts)


def _want() -> dict:
    """START plus the prompts' attributes, counted by hand."""
    return {
        "version": 1,
        "records": 3 + 7,
        "attributes": {
            "style": {"open": False, "values": {"digits": 3 + 2, "words": 5}},
            "tone": {"open": False, "values": {"formal": 2}},
        },
    }


def test_grpo_adds_its_prompts_attributes_to_the_record_and_a_resume_rebuilds_it(tmp_path, start):
    from erniekit.data.control import check_model_control
    from erniekit.train.run import run_train

    model_dir, prompts = start
    common = [f"model_name_or_path={model_dir}", f"train_dataset_path={prompts}", "max_steps=2", "save_steps=1"]
    full = tmp_path / "full"
    run_train(_cfg(full, *common), log=lambda *_: None)
    want = _want()
    assert read_control_record(str(full)) == want
    assert read_control_record(str(full / "checkpoint-1")) == want == read_control_record(str(full / "checkpoint-2"))
    check_model_control(str(full), {"style": "words", "tone": "formal"})  # chat --control now takes them
    assert read_control_record(model_dir) == START  # the starting model's file is not touched
    # an interrupted run: checkpoint-1 alone; the resume rebuilds the record, it does not add to the checkpoint's
    resumed = tmp_path / "resumed"
    os.makedirs(resumed)
    os.rename(full / "checkpoint-1", resumed / "checkpoint-1")
    run_train(_cfg(resumed, *common, "resume_from_checkpoint=auto"), log=lambda *_: None)
    assert read_control_record(str(resumed)) == want


def test_ppo_counts_its_prompts_the_same_way_and_a_prompt_too_long_is_not_counted(tmp_path, start):
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.train.stages import get_stage

    model_dir, prompts = start
    stage = get_stage("PPO")
    cfg = _cfg(tmp_path, f"model_name_or_path={model_dir}", f"train_dataset_path={prompts}", stage="PPO")
    stage.build_train_rows(cfg, default_tokenizer())
    assert stage.control_record == _want()
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"prompt": "1+1=", "control": {"style": "words"}})
        + "\n"
        + json.dumps({"prompt": "1+1=" * 60, "control": {"tone": "formal"}})  # dropped: never sampled
        + "\n"
    )
    cut = _cfg(tmp_path, f"train_dataset_path={long}", "truncation=truncate", *TINY, stage="PPO")
    with pytest.warns(UserWarning, match="1 of 2 training prompts dropped"):
        stage = get_stage("PPO")
        stage.build_train_rows(cut, default_tokenizer())
    assert stage.control_record == count_controls([{"style": "words"}])


DATA = os.path.join(os.path.dirname(__file__), *[".."] * 3, "examples", "data", "arithmetic")


@pytest.mark.parametrize(
    "stage, mode",
    [("GRPO", "train"), ("GRPO", "evaluate only"), ("SFT", "train"), ("DPO", "train"), ("pretrain", "train")],
)
def test_a_damaged_starting_record_stops_a_run_before_the_model_loads(tmp_path, start, monkeypatch, stage, mode):
    """Every stage reads the starting model's record with its data (train/run.py _build_data)."""
    import shutil

    from erniekit.train import run

    model_dir, prompts = start
    if stage != "GRPO":
        prompts = os.path.join(DATA, {"SFT": "train.jsonl", "DPO": "dpo_train.jsonl"}.get(stage, "pretrain.jsonl"))
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    (damaged / CONTROL_RECORD_NAME).write_text('{"version": 1, "attributes": {"style": ["words"]}}')

    def load_model(cfg):
        raise AssertionError("the model was loaded before the damaged record was found")

    monkeypatch.setattr(run, "load_model", load_model)
    how = ["do_train=false", "do_eval=true", f"eval_dataset_path={prompts}"] if mode != "train" else []
    keys = [f"model_name_or_path={damaged}", f"train_dataset_path={prompts}", *how]
    if stage == "GRPO":
        cfg = _cfg(tmp_path / "out", *keys)
    else:
        cfg = validate(load_config(None, [f"stage={stage}", f"output_dir={tmp_path / 'out'}", "do_eval=false", *keys]))
    with pytest.raises(CheckpointError) as e:
        run.run_train(cfg, log=lambda *_: None)
    assert str(e.value).startswith(f"{damaged / CONTROL_RECORD_NAME}: attributes.style must be")
    assert "\n" not in str(e.value)
