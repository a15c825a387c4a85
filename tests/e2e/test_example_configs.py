"""Every shipped example config under examples/configs/tiny/ trains a few steps as written.

A config that starts from another run's output (`model_name_or_path: output/tiny-sft`) starts
from the tiny preset of the same architecture instead, so each file is checked on its own.
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = str(Path(__file__).resolve().parents[2])
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "tiny", "*.yaml")))


def test_every_stage_has_an_example_config():
    from erniekit.train.stages import stage_names

    stages = {yaml.safe_load(open(p))["stage"] for p in CONFIGS}
    assert stages == set(stage_names()) == {"pretrain", "SFT", "DPO", "GRPO", "PPO", "VL-SFT", "Distill"}


def _random_teacher(path) -> str:
    """A tiny-moe checkpoint with fresh weights and the bundled tokenizer."""
    from erniekit.models import registry

    model = registry.load_model("tiny-moe", {"num_hidden_layers": 2})
    registry.save_model(model, str(path), tokenizer=registry.family_of("tiny-moe").default_tokenizer())
    return str(path)


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_example_config_trains_a_few_steps(path, tmp_path):
    cfg = yaml.safe_load(open(path))
    out = tmp_path / "out"
    overrides = [
        f"output_dir={out}",
        "max_steps=2",
        "logging_steps=1",
        "save_steps=2",
        "disable_tqdm=true",
        "eval_steps=1000",
    ]
    if not os.path.isabs(cfg["model_name_or_path"]) and cfg["model_name_or_path"].startswith("output/"):
        overrides.append("model_name_or_path=tiny-moe")  # the run it builds on is not there in a test
    if str(cfg.get("teacher_name_or_path", "")).startswith("output/"):  # Distill: a random teacher instead
        overrides.append(f"teacher_name_or_path={_random_teacher(tmp_path / 'teacher')}")
    if cfg.get("do_eval", True):  # keep the evaluations, on a few examples, so every stage's eval path runs too
        overrides += ["per_device_eval_batch_size=8", "eval_max_samples=8"]
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "train", path, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["global_step"] == 2
    run_config = yaml.safe_load((out / "run_config.yaml").read_text())
    assert run_config["stage"] == cfg["stage"]
    assert os.path.isdir(out / "checkpoint-2")
