"""Planner calibration: predicted vs measured step time and peak memory for layouts runnable here.

Each layout trains the tiny models on the packed pretraining corpus (every row is max_seq_len
tokens, the planner's workload) for --steps steps through `erniekit train`; measured step time is
the median of the logged `train/step_time_s` after the first window, memory is rank 0's
`peak_memory_bytes` (train_results.json: resident set on CPU). Predictions come from
erniekit.distributed.planner.predict with the cluster files measured by tools/profile_cluster.py
(one for 1 process with all cores, one for 2 processes). Writes JSON and prints a markdown table.

    python tools/calibrate_planner.py [--steps 30] [--out bench_results/planner_calibration.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _train_runs import layout_step  # noqa: E402

from erniekit.distributed import planner as P  # noqa: E402
from erniekit.models.ernie4_5 import get_preset  # noqa: E402

G, S = 16, 128
# (model, processes, plan); plan.dp x tp = processes, micro_batch x accumulation x dp = G
LAYOUTS = [
    ("tiny-moe", 1, P.Plan(1, 1, 1, 1, 0, "none", 16, 1)),
    ("tiny-moe", 1, P.Plan(1, 1, 1, 1, 0, "full", 16, 1)),
    ("tiny-moe", 1, P.Plan(1, 1, 1, 1, 0, "none", 8, 2)),
    ("tiny-dense", 1, P.Plan(1, 1, 1, 1, 0, "none", 16, 1)),
    ("tiny-moe", 2, P.Plan(2, 1, 1, 1, 0, "none", 8, 1)),
    ("tiny-moe", 2, P.Plan(2, 1, 1, 1, 1, "none", 8, 1)),
    ("tiny-moe", 2, P.Plan(2, 1, 1, 2, 0, "none", 8, 1)),
    ("tiny-dense", 2, P.Plan(2, 1, 1, 1, 0, "none", 8, 1)),
    ("tiny-dense", 2, P.Plan(1, 2, 1, 1, 0, "none", 16, 1)),
]


def measure(model: str, procs: int, plan: P.Plan, steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{model}-{procs}-{plan.describe().replace(' ', '_').replace('=', '')}")
    return layout_step(model, procs, plan.config_overrides(), steps, out, seq_len=S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cluster1", default=str(ROOT / "examples" / "clusters" / "cpu-2core-1proc.yaml"))
    p.add_argument("--cluster2", default=str(ROOT / "examples" / "clusters" / "cpu-2core.yaml"))
    p.add_argument("--out", default=str(ROOT / "bench_results" / "planner_calibration.json"))
    a = p.parse_args(argv)
    clusters = {1: P.load_cluster(a.cluster1), 2: P.load_cluster(a.cluster2)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, procs, plan in LAYOUTS:
            # erniekit train's pretrain takes the head's loss chunk by chunk (fused_head_loss)
            pred = P.predict(get_preset(model), clusters[procs], P.Workload(G, S, fused_head=True), plan)
            got = measure(model, procs, plan, a.steps, tmp)
            row = {
                "model": model,
                "processes": procs,
                "layout": plan.describe(),
                "predicted_step_s": pred.step_s,
                "measured_step_s": got["step_s"],
                "predicted_memory": pred.memory,
                "measured_memory": got["memory"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = [
        "| model | procs | layout | step s predicted | step s measured | ratio | memory MB predicted | "
        "memory MB measured | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['model']} | {r['processes']} | {r['layout']} | {r['predicted_step_s']:.3f} | "
            f"{r['measured_step_s']:.3f} | {r['predicted_step_s'] / r['measured_step_s']:.2f} | "
            f"{r['predicted_memory'] / 1e6:.0f} | {r['measured_memory'] / 1e6:.0f} | "
            f"{r['predicted_memory'] / r['measured_memory']:.2f} |"
        )
    print("\n".join(table))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "workload": {"global_batch": G, "seq_len": S, "steps": a.steps},
                "clusters": {k: vars(v) if hasattr(v, "__dict__") else str(v) for k, v in clusters.items()},
                "rows": rows,
                "table": table,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
