"""stage: Distill through `erniekit train`: the demonstration's config on a briefly trained teacher
(a 2-layer student that learns and loads as a normal checkpoint), two data-parallel processes
against one, and the recorded demonstration (bench_results/distill_demo.json: the distilled
student against the same student by plain SFT) against its claim and the shipped config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import head_of, tiny_teacher

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/tiny/distill.yaml"
DATA = ROOT / "examples" / "data" / "arithmetic"
EVAL = ["eval_max_samples=100", "per_device_eval_batch_size=100"]


def _train(*args, threads: int = 2, expect_ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args, "disable_tqdm=true"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if expect_ok:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _results(out) -> dict:
    return json.load(open(os.path.join(out, "train_results.json")))


def _losses(out) -> np.ndarray:
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    return np.array([r["train/loss"] for r in rows if "train/loss" in r])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A teacher of the embedded default's shape, cut to 30 steps: these tests check the mechanics
    (the distilled student's gain over plain SFT needs a trained teacher and minutes per run: it is
    measured by tools/distill_demo.py into bench_results/distill_demo.json, checked below)."""
    return Path(
        tiny_teacher(str(ROOT), tmp_path_factory.mktemp("distill") / "teacher", 30, "fp8=false", "logging_steps=10")
    )


def _student(teacher, out, *extra) -> list[str]:
    """The demonstration's config, cut short the same way."""
    return [
        CONFIG,
        f"teacher_name_or_path={teacher}",
        f"train_dataset_path={head_of(str(DATA / 'train.jsonl'), 2000)}",
        "max_steps=20",
        "fp8=false",
        "logging_steps=10",
        *EVAL,
        f"output_dir={out}",
        *extra,
    ]


def test_the_cli_trains_a_two_layer_student_that_loads_as_a_normal_checkpoint(teacher, tmp_path):
    kd = _train(*_student(teacher, tmp_path / "kd", "eval_max_samples=20", "per_device_eval_batch_size=20"))
    d = _results(tmp_path / "kd")["eval"]
    assert {"loss", "exact_match", "teacher_agreement", "distill_loss", "hidden_loss"} <= set(d), d
    assert any(line.startswith("held-out exact match: ") for line in kd.stdout.splitlines()[-3:]), kd.stdout[-1500:]
    losses = _losses(tmp_path / "kd")
    assert losses[-1] < losses[0]  # 20 steps from a random student: the distillation loss falls
    from erniekit.models import registry

    student = registry.load_model(str(tmp_path / "kd"))  # a normal checkpoint: what chat / export load
    assert student.config.num_hidden_layers == 2


def test_two_data_parallel_processes_follow_one(teacher, tmp_path):
    """on_policy_ratio 0.5: dataset steps and steps on the student's own samples (generated on each
    rank from the same global batch and seed), each rank scoring its rows with its own teacher."""
    common = ["max_steps=6", "logging_steps=1", "do_eval=false", "on_policy_ratio=0.5", "max_new_tokens=6"]
    _train(*_student(teacher, tmp_path / "one", *common, "per_device_train_batch_size=16"), threads=1)
    two = _train(
        *_student(teacher, tmp_path / "two", *common, "per_device_train_batch_size=8", "nproc_per_node=2"), threads=1
    )
    assert "data parallelism: 2 whole-model replicas" in two.stdout
    one_rows = [json.loads(x) for x in open(tmp_path / "one" / "vdl_log" / "scalars.jsonl")]
    assert 0 < sum(r["train/on_policy"] for r in one_rows) < 6
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)


def test_a_missing_teacher_says_to_run_the_embedded_default_first(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "erniekit",
            "train",
            str(ROOT / CONFIG),
            f"train_dataset_path={DATA / 'train.jsonl'}",
            f"eval_dataset_path={DATA / 'eval.jsonl'}",
            f"output_dir={tmp_path / 'o'}",
        ],
        cwd=tmp_path,  # no output/tiny-sft here
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    err = [line for line in (r.stdout + r.stderr).splitlines() if "teacher_name_or_path" in line]
    assert err and "output/tiny-sft does not exist" in err[-1] and "erniekit train " in err[-1], err
    assert "examples/configs/tiny/sft.yaml` first" in err[-1]


def test_the_recorded_demonstration_meets_the_claim_with_the_shipped_config():
    doc = json.load(open(ROOT / "bench_results" / "distill_demo.json"))
    assert doc["key"]["config"] == CONFIG and doc["key"]["overrides"] == []
    sys.path.insert(0, str(ROOT / "tools"))
    from distill_demo import config_sha256

    assert doc["key"]["config_sha256"] == config_sha256(CONFIG), (
        "examples/configs/tiny/distill.yaml changed since the measurement: rerun tools/distill_demo.py"
    )
    summary = doc["summary"]
    pairs = summary["pairs"]
    assert len({p["seed"] for p in pairs}) >= 2
    for p in pairs:
        assert p["distill_exact_match"] > p["sft_exact_match"], p
        assert p["distill_eval_loss"] < p["sft_eval_loss"], p
    assert summary["distilled_beats_sft_in_every_pair"]
    runs = [r for r in doc["runs"] if r["method"] == "distill"]
    assert all(r["global_step"] == next(q for q in doc["runs"] if q["method"] == "sft")["global_step"] for r in runs)
    assert all(any(line.startswith("held-out exact match") for line in r["held_out_lines"]) for r in runs)
    assert doc["teacher"]["path"] == "output/tiny-sft" and doc["teacher"]["exact_match"] > 0.9
