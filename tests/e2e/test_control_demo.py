"""The controllable-arithmetic demo (examples/configs/tiny/sft_control.yaml, docs/control.md), cut to
STEPS steps so it fits the suite: the run ends with its held-out control-following and credibility
lines, and the styles are already followed; the full config's seeds are recorded in
bench_results/control_demo.json, which must be of the shipped config and meet the >= 90% bar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from launched_jobs import train

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/tiny/sft_control.yaml"
BAR = 0.90  # docs/control.md: each style followed on at least 90% of held-out prompts
STEPS = 150
FOLLOW_FLOOR = 0.85  # measured at STEPS steps (seed 42, 1 thread): digits 1.000, words 1.000


def test_the_recorded_runs_of_the_full_demo_meet_the_bar():
    doc = json.loads((ROOT / "bench_results" / "control_demo.json").read_text())
    assert doc["key"] == {"config": CONFIG, "overrides": []}
    steps = yaml.safe_load((ROOT / CONFIG).read_text())["max_steps"]
    runs = doc["runs"]
    assert len({r["seed"] for r in runs}) >= 2 and doc["cpu"] and all("threads" in r for r in runs)
    assert all(r["returncode"] == 0 and r["global_step"] == steps for r in runs), runs
    for style in ("digits", "words"):
        assert min(r[f"follow:style={style}"] for r in runs) >= BAR, (style, runs)
    assert all(0.0 <= r["credibility_auc"] <= 1.0 for r in runs)
    docs = (ROOT / "docs" / "control.md").read_text()
    for r in runs:  # the table in the docs is these runs
        assert f"| {r['seed']} | {r['threads']} |" in docs


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("control")
    args = [CONFIG, f"max_steps={STEPS}", "warmup_steps=15", f"eval_steps={STEPS}", f"save_steps={STEPS}"]
    args += ["credibility_every=10", "eval_max_samples=60", "disable_tqdm=true", f"output_dir={out}"]
    return out, train(args, str(ROOT), timeout=600).stdout


def test_a_short_run_already_follows_both_styles_and_reports_credibility(short_run):
    out, stdout = short_run
    follow = re.search(r"held-out control following: style=digits ([0-9.]+), style=words ([0-9.]+)", stdout)
    auc = re.search(r"held-out credibility AUC \(real vs sampled replies\): ([0-9.]+)", stdout)
    assert follow and auc, stdout[-2000:]
    assert float(follow[1]) >= FOLLOW_FLOOR and float(follow[2]) >= FOLLOW_FLOOR, stdout[-2000:]
    assert 0.0 <= float(auc[1]) <= 1.0
    assert (out / "credibility_head.safetensors").exists()
