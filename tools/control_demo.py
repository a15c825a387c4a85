#!/usr/bin/env python
"""Run the controllable-arithmetic demo (examples/configs/tiny/sft_control.yaml) over seeds and record
its held-out numbers (control-following rate per style, credibility AUC, exact match) with the CPU,
thread count, seeds and config in bench_results/control_demo.json (docs/control.md).

Runs go one after another (each uses --threads cores); every finished run is written at once and a
rerun skips the seeds already recorded for the same config and overrides.

    python tools/control_demo.py                       # seeds 1, 2, 3 on 2 threads
    python tools/control_demo.py --seeds 4 --threads 1 max_steps=300
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from embedded_default_matrix import cpu_model  # noqa: E402

CONFIG = "examples/configs/tiny/sft_control.yaml"
METRICS = ("follow:style=digits", "follow:style=words", "credibility_auc", "exact_match", "loss")


def train_run(config: str, seed: int, threads: int, overrides: list[str], metrics: tuple[str, ...], after=None) -> dict:
    """One `erniekit train` of `config` in a fresh process: its held-out `metrics` and lines, plus
    what `after(output_dir)` reads from the finished run (before the directory goes)."""
    with tempfile.TemporaryDirectory(prefix="demo-") as out:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "erniekit", "train", config, f"seed={seed}", f"output_dir={out}"]
        cmd += ["disable_tqdm=true", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        run = {"seed": seed, "threads": threads, "wall_s": round(time.perf_counter() - t0, 1)}
        run["returncode"] = proc.returncode
        if proc.returncode != 0:
            run["error"] = proc.stderr[-2000:]
            return run
        res = json.load(open(os.path.join(out, "train_results.json")))
        run["global_step"] = res["global_step"]
        run["train_runtime_s"] = round(res["train_runtime_s"], 1)
        run.update({k: res["eval"][k] for k in metrics if k in res["eval"]})
        run["lines"] = [line for line in proc.stdout.splitlines() if line.startswith("held-out ")]
        if after is not None:
            run.update(after(out))
        return run


def run_one(seed: int, threads: int, overrides: list[str]) -> dict:
    return train_run(CONFIG, seed, threads, overrides, METRICS)


def summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["returncode"] == 0]
    return {k: {"min": min(r[k] for r in ok), "max": max(r[k] for r in ok)} for k in METRICS[:4] if ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "control_demo.json"))
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config (recorded)")
    ns = p.parse_args()
    key = {"config": CONFIG, "overrides": ns.overrides}
    doc = json.load(open(ns.out)) if os.path.isfile(ns.out) else {}
    if doc.get("key") != key:
        doc = {"key": key, "runs": []}
    doc.update(cpu=cpu_model(), cores=os.cpu_count(), python=platform.python_version())
    done = {(r["seed"], r["threads"]) for r in doc["runs"] if r["returncode"] == 0}
    for seed in [int(s) for s in ns.seeds.split(",") if s]:
        if (seed, ns.threads) in done:
            continue
        run = run_one(seed, ns.threads, ns.overrides)
        print(json.dumps({k: v for k, v in run.items() if k != "lines"}), flush=True)
        doc["runs"] = [r for r in doc["runs"] if (r["seed"], r["threads"]) != (seed, ns.threads)] + [run]
        doc["summary"] = summary(doc["runs"])
        Path(ns.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc.get("summary", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
