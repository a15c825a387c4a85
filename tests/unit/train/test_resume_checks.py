"""A resume continues the run that wrote the checkpoint, or refuses in one line: a changed model,
data or data order, a trainer state of another tool, a missing optimizer file; a fresh run does
not write into an earlier run's checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_train import SMALL, _run

from erniekit.config import load_config, validate
from erniekit.errors import CheckpointError, ConfigError

RUN = ["max_steps=2", "save_steps=2", "do_eval=false"]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished 2-step run with checkpoint-2."""
    tmp = tmp_path_factory.mktemp("resume")
    _run(tmp, "a", *RUN)
    return tmp / "a"


def _resume_into(tmp_path, done, name: str, *overrides: str):
    out = tmp_path / name
    shutil.copytree(done / "checkpoint-2", out / "checkpoint-2")
    return _run(tmp_path, name, *RUN, "resume_from_checkpoint=auto", *overrides)


@pytest.mark.parametrize(
    "override, change",
    [
        ("seed=7", "seed 42 -> 7"),
        ("per_device_train_batch_size=4", "micro_batch_rows 8 -> 4"),  # micro-batch i would be other rows
        ("max_seq_len=48", "max_seq_len 32 -> 48"),
        ("model_overrides.num_hidden_layers=1", "model_overrides"),
    ],
)
def test_a_resume_that_changes_the_model_or_the_data_order_is_refused(tmp_path, done, override, change):
    with pytest.raises(CheckpointError, match=rf"differs from the one that wrote the checkpoint \(.*{change}"):
        _resume_into(tmp_path, done, "r", override)


def test_a_longer_schedule_resumes_and_says_so(tmp_path, done):
    _, logs = _resume_into(tmp_path, done, "r", "max_steps=3", "learning_rate=1e-3", "ema_decay=0.9")
    said = [line for line in logs if "resuming with a changed schedule" in line]
    assert len(said) == 1 and "learning_rate 0.003 -> 0.001" in said[0] and "total steps 2 -> 3" in said[0]
    assert "ema_decay 0.0 -> 0.9" in said[0]
    assert any("resumed from" in line for line in logs)


def test_a_checkpoint_without_its_optimizer_or_step_counts_is_refused(tmp_path, done):
    ckpt = tmp_path / "r" / "checkpoint-2"
    shutil.copytree(done / "checkpoint-2", ckpt)
    os.remove(ckpt / "optimizer.safetensors")  # fresh moments changed every later step, silently
    with pytest.raises(
        CheckpointError, match=r"checkpoint-2 has no optimizer.safetensors, so the optimizer would restart"
    ):
        _run(tmp_path, "r", *RUN, "resume_from_checkpoint=auto")
    shutil.copy(done / "checkpoint-2" / "optimizer.safetensors", ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))  # transformers'
    with pytest.raises(CheckpointError, match=r"trainer_state.json: consumed_micro_batches is None, not a step count"):
        _run(tmp_path, "r", *RUN, "resume_from_checkpoint=auto")


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused(done):
    """It rotated its own checkpoints away beside the earlier run's, mixed both runs' logs, and a
    later resume_from_checkpoint=auto took the earlier run's."""
    from erniekit.train.start import refuse_earlier_run, start_training

    fresh = validate(load_config(None, SMALL + [f"output_dir={done}", *RUN, "seed=7"]))
    with pytest.raises(
        ConfigError, match=r"output_dir=.* holds an earlier run's checkpoints \(checkpoint-2\); continue"
    ):
        start_training(fresh, None, [], None)
    refuse_earlier_run(validate(load_config(None, SMALL + [f"output_dir={done}", *RUN, "resume_from_checkpoint=auto"])))
    assert sorted(os.listdir(done)).count("checkpoint-2") == 1
