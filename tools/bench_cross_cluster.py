#!/usr/bin/env python
"""Measure issue #30's claim on localhost: the embedded default trained by 2 emulated clusters x 2
processes over a 100 Mbit/s, 50 ms link (docs/cross_cluster.md), against

- `single`: one cluster of 2 processes (no link), the same global batch (64) and steps;
- `gradients`: plain data parallelism across the same 2 x 2 processes over the same emulated link
  (every step's gradients cross it), timed over --gradient-steps steps (its accuracy is `single`'s:
  the same maths, tests/e2e/test_cross_cluster.py);
- `local`: local SGD across the clusters, synced every --sync-every steps with --compress.

Records cross-cluster bytes per step (per rank), tokens/s (both clusters together), held-out exact
match, and `erniekit plan`'s predicted step time for the local and gradients runs, given either the
run's own measured compute time of a step (only the link predicted) or the one-cluster run's step time
(the calibration a user makes before going to two sites). Runs go one at a time (each takes both cores);
results are written to bench_results/cross_cluster.json after every run.

    python tools/bench_cross_cluster.py                  # seed 42
    python tools/bench_cross_cluster.py --seeds 42 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from embedded_default_matrix import cpu_model  # noqa: E402

CONFIG = "examples/configs/tiny/sft.yaml"
SITES = "examples/clusters/two_sites.yaml"
LINK = ["cross_cluster_link_mbit=100", "cross_cluster_link_latency_ms=50"]


def methods(sync_every: int, compress: str, gradient_steps: int) -> dict[str, list[str]]:
    both = ["cross_cluster_sizes=[2,2]", "per_device_train_batch_size=16", *LINK]
    return {
        "single": ["nproc_per_node=2", "per_device_train_batch_size=32"],
        "local": [*both, f"cross_cluster_sync_every={sync_every}", f"cross_cluster_compress={compress}"],
        "gradients": [*both, "cross_cluster_sync=gradients", f"max_steps={gradient_steps}", "do_eval=false"],
    }


def scalars(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "vdl_log" / "scalars.jsonl").read_text().splitlines()]


def tokens_per_s(out: Path) -> float:
    """Mean of the logged windows' tokens/s (the first window, start-up included, left out)."""
    rates = [r["train/tokens_per_sec"] for r in scalars(out) if "train/tokens_per_sec" in r][1:]
    return sum(rates) / max(len(rates), 1)


def run_one(method: str, args: list[str], seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "erniekit", "train", CONFIG, f"seed={seed}", f"output_dir={out}"]
    cmd += ["disable_tqdm=true", "logging_steps=20", "save_steps=1000", "eval_steps=100000", *args]
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rec = {"method": method, "seed": seed, "wall_s": round(time.perf_counter() - start, 1), "returncode": r.returncode}
    if r.returncode != 0:
        rec["error_tail"] = (r.stdout + r.stderr)[-2000:]
        return rec
    res = json.loads((out / "train_results.json").read_text())
    clusters = [out] + ([out / "cluster-1"] if (out / "cluster-1").is_dir() else [])
    rec.update(
        global_step=res["global_step"],
        exact_match=res.get("eval", {}).get("exact_match"),
        eval_loss=res.get("eval", {}).get("loss"),
        tokens_per_s=round(sum(tokens_per_s(c) for c in clusters), 1),
        step_s=round(res["train_runtime_s"] / res["global_step"], 4),
    )
    if "cross_cluster" in res:
        cc = res["cross_cluster"]
        rec["cross_cluster"] = cc
        rec["bytes_per_step_per_rank"] = round(cc["bytes_sent_per_step"], 1)
    return rec


def predicted_step_s(method: str, args: list[str], compute_s: float) -> float:
    """erniekit plan's step time for this run's sync over the sites' link, given its measured compute."""
    plan_json = ROOT / "output" / f"bench_cc_plan_{method}.json"
    cmd = [sys.executable, "-m", "erniekit", "plan", CONFIG, f"sites={SITES}", *args]
    cmd += ["--measured-step-s", str(compute_s), "--json", str(plan_json)]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(plan_json.read_text())["config"]["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42])
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--compress", default="int8")
    ap.add_argument("--gradient-steps", type=int, default=150)
    ap.add_argument("--methods", nargs="+", default=["gradients", "local", "single"])
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "cross_cluster.json"))
    ap.add_argument("--summary-only", action="store_true", help="recompute predictions and summary of the record")
    a = ap.parse_args()
    path = Path(a.out)
    record = json.loads(path.read_text()) if path.exists() else {"runs": []}
    record.update(
        what="issue #30 on localhost: 2 emulated clusters x 2 processes over 100 Mbit/s + 50 ms (per rank pair) "
        "against one cluster and against data parallelism over the same link (tools/bench_cross_cluster.py)",
        config=CONFIG,
        sites=SITES,
        cpu=cpu_model(),
        cores=os.cpu_count(),
        python=platform.python_version(),
        methods={m: " ".join(v) for m, v in methods(a.sync_every, a.compress, a.gradient_steps).items()},
    )
    table = methods(a.sync_every, a.compress, a.gradient_steps)
    for seed in [] if a.summary_only else a.seeds:
        for m in a.methods:
            out = ROOT / "output" / f"bench_cc_{m}_{seed}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            rec = run_one(m, table[m], seed, out)
            if "cross_cluster" in rec:
                rec["predicted_step_s"] = predicted_step_s(m, table[m], rec["cross_cluster"]["compute_s_per_step"])
            print(json.dumps({k: v for k, v in rec.items() if k != "cross_cluster"}), flush=True)
            record["runs"] = [r for r in record["runs"] if (r["method"], r["seed"]) != (m, seed)] + [rec]
            path.write_text(json.dumps(record, indent=1) + "\n")
    predict_from_single(record["runs"], table)
    record["summary"] = summary(record["runs"])
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))


def predict_from_single(runs: list[dict], table: dict[str, list[str]]) -> None:
    """The planner's step time of each cross-cluster run with the compute measured in another run: the
    one-cluster run of the same seed (2 processes, no link), as a user calibrates before going to two sites."""
    single = {r["seed"]: r for r in runs if r["method"] == "single" and r.get("returncode") == 0}
    for r in runs:
        if r["method"] in ("local", "gradients") and r.get("returncode") == 0 and r["seed"] in single:
            r["predicted_step_s_from_single"] = predicted_step_s(
                r["method"], table[r["method"]], single[r["seed"]]["step_s"]
            )


def summary(runs: list[dict]) -> dict:
    by = {(r["method"], r["seed"]): r for r in runs if r.get("returncode") == 0}
    out = {}
    for seed in sorted({s for _, s in by}):
        g, loc, one = by.get(("gradients", seed)), by.get(("local", seed)), by.get(("single", seed))
        row = {}
        if g and loc:
            row["bytes_per_step_ratio_gradients_over_local"] = round(
                g["bytes_per_step_per_rank"] / loc["bytes_per_step_per_rank"], 1
            )
            row["tokens_per_s_ratio_local_over_gradients"] = round(loc["tokens_per_s"] / g["tokens_per_s"], 2)
        if loc and one and loc.get("exact_match") is not None:
            row["exact_match_local_minus_single"] = round(loc["exact_match"] - one["exact_match"], 3)
        for m, r in (("local", loc), ("gradients", g)):
            if r and "predicted_step_s" in r:
                row[f"{m}_predicted_over_measured_step"] = round(r["predicted_step_s"] / r["step_s"], 3)
            if r and "predicted_step_s_from_single" in r:
                row[f"{m}_predicted_from_single_over_measured_step"] = round(
                    r["predicted_step_s_from_single"] / r["step_s"], 3
                )
        out[str(seed)] = row
    return out


if __name__ == "__main__":
    main()
