"""The WebUI's run logic (erniekit/webui/runs.py) without a browser: the form becomes validated
overrides of the stage's shipped config, errors are one line, the plot points come from the run's
VisualDL log directory (loss and GRPO's reward), and a finished run's status."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("gradio")

from erniekit.errors import ErniekitError
from erniekit.webui.runs import ROOT, Form, Runs, bundled_data, check_form, cli_command, read_points


def test_form_becomes_overrides_of_the_stage_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the bundled data is found from anywhere
    f = Form(stage="LoRA", output_dir=str(tmp_path / "o"), max_steps=7, learning_rate=1e-3, batch_size=4,
             max_seq_len=32, lora_rank=4)
    cfg = check_form(f)
    assert (cfg.fine_tuning, cfg.lora_rank, cfg.max_steps, cfg.learning_rate) == ("LoRA", 4, 7, 1e-3)
    assert cfg.model_name_or_path == "tiny-moe" and cfg.logging_steps == 1
    assert cfg.train_dataset_path == os.path.join(ROOT, "examples/data/arithmetic/train.jsonl")
    cmd = cli_command(f)
    assert cmd.startswith("erniekit train ") and "sft_lora.yaml" in cmd and "lora_rank=4" in cmd
    assert set(bundled_data("GRPO")) == {"train_dataset_path", "eval_dataset_path"}


@pytest.mark.parametrize("kw, match", [
    ({"model": "/no/such/model"}, "model directory /no/such/model not found"),
    ({"dataset": "/no/such.jsonl"}, "dataset /no/such.jsonl not found"),
    ({"max_steps": 0}, "max steps 0 must be >= 1"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"stage": "RLHF"}, "stage 'RLHF': choose one of"),
])
def test_bad_form_values_are_one_line_errors(tmp_path, kw, match):
    with pytest.raises(ErniekitError, match=match) as e:
        check_form(Form(output_dir=str(tmp_path / "o"), **kw))
    assert "\n" not in str(e.value)


def test_plot_points_read_loss_and_reward(tmp_path):
    (tmp_path / "vdl_log").mkdir()
    rows = [{"step": 1, "train/loss": 2.0, "train/reward": 0.1}, {"step": 2, "train/loss": 1.5, "train/reward": 0.3}]
    (tmp_path / "vdl_log" / "scalars.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 3, "tr')
    pts, step = read_points(str(tmp_path))
    assert step == 2  # the half-written line is skipped
    assert sorted(pts) == [(1, 0.1, "reward"), (1, 2.0, "loss"), (2, 0.3, "reward"), (2, 1.5, "loss")]


def test_a_finished_run_reports_its_steps_and_a_second_start_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = Runs()
    f = Form(stage="pretrain", output_dir=str(tmp_path / "run"), max_steps=3, batch_size=4, max_seq_len=32)
    runs.start(f)
    with pytest.raises(ErniekitError, match="a run is already writing to"):
        runs.start(f)
    deadline = time.time() + 240
    while runs.status(f.output_dir)["state"] == "running" and time.time() < deadline:
        time.sleep(0.2)
    st = runs.status(f.output_dir)
    assert st["state"] == "finished", st["log"][-2000:]
    assert st["step"] == 3 and [p[0] for p in st["points"] if p[2] == "loss"] == [1, 2, 3]
    assert "saved model" in st["log"]
