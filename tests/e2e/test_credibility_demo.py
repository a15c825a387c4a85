"""The credibility demo (examples/configs/tiny/sft_credibility.yaml, docs/control.md): the trained
embedded default fine-tuned with the credibility loss. Its seeds are recorded in
bench_results/credibility_demo.json (tools/credibility_demo.py), which must be of the shipped config and
show the separation the docs claim, on all sampled answers and on the well-formed wrong ones alone.
The run itself needs output/tiny-sft; here the shipped config is run briefly from a fresh tiny model,
whose samples are malformed, so a working head separates them within a few dozen steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from launched_jobs import train

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/tiny/sft_credibility.yaml"
AUC_BAR = 0.85  # docs/control.md: real vs sampled answers, every recorded seed
WELL_FORMED_BAR = 0.65  # the same, against sampled answers that are integers (wrong values in the data's format)
STEPS = 30
SHORT_AUC_FLOOR = (
    0.8  # measured at STEPS steps from a fresh tiny-moe (seed 42, 1 thread): 1.000; 0.5 with the loss zeroed
)


def test_the_recorded_runs_separate_real_from_sampled_answers():
    doc = json.loads((ROOT / "bench_results" / "credibility_demo.json").read_text())
    assert doc["key"] == {"config": CONFIG, "overrides": []}
    cfg = yaml.safe_load((ROOT / CONFIG).read_text())
    runs = doc["runs"]
    assert len({r["seed"] for r in runs}) >= 2 and doc["cpu"] and all("threads" in r for r in runs)
    assert all(r["returncode"] == 0 and r["global_step"] == cfg["max_steps"] for r in runs), runs
    for r in runs:
        assert r["examples"] == cfg["eval_max_samples"]
        assert 0.1 <= r["sampled_differ_fraction"] <= 0.9  # a fair share differs; the rest is left out
        assert min(r["credibility_auc"], r["auc_all"]) >= AUC_BAR, r
        assert r["auc_well_formed"] >= WELL_FORMED_BAR, r
    docs = (ROOT / "docs" / "control.md").read_text()
    for r in runs:  # the credibility table in the docs is these runs
        row = f"| {r['seed']} | {r['threads']} | {r['credibility_auc']:.3f} | {r['auc_all']:.3f} | {r['auc_well_formed']:.3f} |"
        assert row in docs


def test_without_the_embedded_defaults_output_the_config_says_to_train_it(tmp_path, monkeypatch):
    from erniekit.config import load_config, validate
    from erniekit.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # no output/tiny-sft here
    with pytest.raises(ConfigError, match=r"model_name_or_path: output/tiny-sft does not exist.*sft\.yaml` first"):
        data = {
            k: ROOT / v for k, v in yaml.safe_load((ROOT / CONFIG).read_text()).items() if k.endswith("dataset_path")
        }
        validate(
            load_config(str(ROOT / CONFIG), [f"output_dir={tmp_path / 'out'}", *(f"{k}={v}" for k, v in data.items())])
        )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("credibility")
    args = [CONFIG, "model_name_or_path=tiny-moe", f"max_steps={STEPS}", "warmup_steps=3", f"eval_steps={STEPS}"]
    args += [
        f"save_steps={STEPS}",
        "credibility_batch_size=16",
        "eval_max_samples=100",
        "per_device_eval_batch_size=100",
    ]
    args += ["disable_tqdm=true", f"output_dir={out}"]
    return out, train(args, str(ROOT), timeout=600).stdout


def test_a_short_run_trains_a_head_that_separates_malformed_samples(short_run):
    out, stdout = short_run
    auc = re.search(r"held-out credibility AUC \(real vs sampled replies\): ([0-9.]+)", stdout)
    assert auc, stdout[-2000:]
    assert float(auc[1]) >= SHORT_AUC_FLOOR, stdout[-2000:]
    assert (out / "credibility_head.safetensors").exists()
