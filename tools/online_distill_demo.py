#!/usr/bin/env python
"""Measure issue #29's online-distillation claim on examples/configs/tiny/online_distill.yaml: the
run's teacher ends as its solo run does (the same config without students) and each student ends
above plain SFT of its shape for the same steps (examples/configs/tiny/sft.yaml with the student's
num_hidden_layers and the config's max_steps: the student's own schedule, lr_ratio x the teacher's,
is the embedded default's). Held-out exact match on the config's eval set, per seed; the teacher's
final weights are compared with its solo run's. The teacher is the embedded default's output (run
`erniekit train examples/configs/tiny/sft.yaml` first).

Runs go one at a time (--threads cores each); every finished run is written to the JSON file at
once and a rerun skips the (run, seed) cells already there for the same config values (distill_demo.config_sha256).

    python tools/online_distill_demo.py                  # seeds 42, 43 on 2 threads
    python tools/online_distill_demo.py --seeds 44 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from control_demo import train_run  # noqa: E402
from distill_demo import config_sha256  # noqa: E402
from embedded_default_matrix import cpu_model  # noqa: E402

CONFIG = "examples/configs/tiny/online_distill.yaml"
SOLO_CONFIG = "examples/configs/tiny/sft.yaml"
NO_EVAL_DURING = ["eval_steps=100000", "save_steps=100000"]  # held-out figures at the end only


def plan(config: dict) -> dict[str, tuple[str, list[str]]]:
    """run name -> (config, overrides): the online run, the teacher's solo run, each student's."""
    steps = f"max_steps={config['max_steps']}"
    runs = {"online": (CONFIG, [*NO_EVAL_DURING]), "teacher": (CONFIG, ["online_distill_students=[]", *NO_EVAL_DURING])}
    for s in config["online_distill_students"]:
        layers = f"model_overrides.num_hidden_layers={s['num_hidden_layers']}"
        runs[s["name"]] = (SOLO_CONFIG, [layers, steps, *NO_EVAL_DURING])
    return runs


def teacher_weights(out: str) -> dict:
    from safetensors.numpy import load_file

    return {"_weights": load_file(os.path.join(out, "model.safetensors"))}


def cell(name: str, config: str, overrides: list[str], seed: int, threads: int, students: list[str]) -> dict:
    metrics = ("exact_match", "loss", *(f"{s}/{k}" for s in students for k in ("exact_match", "loss")))
    after = teacher_weights if name in ("online", "teacher") else None
    run = train_run(config, seed, threads, overrides, metrics, after)
    run.update(name=name, command=" ".join(["erniekit train", config, f"seed={seed}", *overrides]))
    return run


def summarize(runs: list[dict], students: list[str]) -> dict:
    """Per seed: the online run's teacher and students against their solo runs."""
    by = {(r["name"], r["seed"]): r for r in runs if r.get("returncode") == 0}
    out = {"per_seed": []}
    for seed in sorted({s for _, s in by}):
        online = by.get(("online", seed))
        if online is None or any((n, seed) not in by for n in ["teacher", *students]):
            continue
        row = {"seed": seed, "teacher": {"online": online["exact_match"], "solo": by[("teacher", seed)]["exact_match"]}}
        row["teacher_weights_max_abs_diff_online_vs_solo"] = online.get("teacher_weights_max_abs_diff")
        for s in students:
            row[s] = {"online": online[f"{s}/exact_match"], "solo": by[(s, seed)]["exact_match"]}
        out["per_seed"].append(row)
    for s in students:
        out[f"{s}_above_solo_at_every_seed"] = bool(out["per_seed"]) and all(
            r[s]["online"] > r[s]["solo"] for r in out["per_seed"]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="42,43", help="comma-separated seeds")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "online_distill_demo.json"))
    ns = p.parse_args(argv)
    config = yaml.safe_load((ROOT / CONFIG).read_text())
    students = [s["name"] for s in config["online_distill_students"]]
    key = {"config": CONFIG, "config_sha256": config_sha256(CONFIG)}
    doc = json.loads(Path(ns.out).read_text()) if os.path.exists(ns.out) else {}
    if doc.get("key") != key:
        doc = {"key": key, "runs": []}
    doc.update(cpu=cpu_model(), cores=os.cpu_count(), python=platform.python_version(), students=students)
    done = {(r["name"], r["seed"]) for r in doc["runs"] if r.get("returncode") == 0}
    for seed in (int(s) for s in ns.seeds.split(",")):
        weights = {}
        for name, (cfg, overrides) in plan(config).items():
            if (name, seed) in done:
                continue
            run = cell(name, cfg, overrides, seed, ns.threads, students)
            if "_weights" in run:
                weights[name] = run.pop("_weights")
            if name == "teacher" and "online" in weights:  # plan() runs the online run first
                a, b = weights["online"], weights["teacher"]
                online = next(r for r in doc["runs"] if r["name"] == "online" and r["seed"] == seed)
                online["teacher_weights_max_abs_diff"] = max(float(abs(a[k] - b[k]).max()) for k in a)
            print(json.dumps({k: v for k, v in run.items() if k != "lines"}), flush=True)
            doc["runs"].append(run)
            doc["summary"] = summarize(doc["runs"], students)
            Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
