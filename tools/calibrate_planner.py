"""Planner calibration: predicted vs measured step time and peak memory for layouts runnable here.

Each layout trains the tiny models on the packed pretraining corpus (every row is max_seq_len
tokens, the planner's workload) for --steps steps through `erniekit train`; measured step time is
the median of the logged `train/step_time_s` after the first window, memory is rank 0's
`peak_memory_bytes` (train_results.json: resident set on CPU). Predictions come from
erniekit.distributed.planner.predict with the cluster files measured by tools/profile_cluster.py
(one for 1 process with all cores, one for 2 processes). Writes JSON and prints a markdown table.

    python tools/calibrate_planner.py [--steps 30] [--out bench_results/planner_calibration.json]
    python tools/calibrate_planner.py --layouts gradients   # memory where the gradients weigh
                                                            # (dense-1024: 1 process and 2 replicas)
    python tools/calibrate_planner.py --measured bench_results/planner_calibration.json --out X.json
                                                            # a record's measurements, predicted again
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

import bench_vs_torch  # noqa: E402  (stdlib imports only)
from _train_runs import layout_step  # noqa: E402

from erniekit.distributed import planner as P  # noqa: E402
from erniekit.models.ernie4_5 import get_preset  # noqa: E402

G, S = 16, 128
# models by name: a preset, or a preset with model_overrides (a model whose gradients are not small
# beside its activations: dense-1024 has 80M parameters, 320 MB of float32 gradients)
MODELS = {
    "tiny-moe": ("tiny-moe", {}),
    "tiny-dense": ("tiny-dense", {}),
    "dense-1024": ("tiny-dense", bench_vs_torch.MODELS["dense-1024"]),  # the speed benchmark's dense model
}
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
# --layouts gradients: memory where the gradients weigh (dense-1024), one process and 2 replicas
GRADIENT_LAYOUTS = [
    *(("dense-1024", 1, P.Plan(1, 1, 1, 1, 0, "none", mb, 1)) for mb in (1, 4, 8, 16, 32)),
    ("dense-1024", 1, P.Plan(1, 1, 1, 1, 0, "none", 1, 2)),
    ("dense-1024", 2, P.Plan(2, 1, 1, 1, 0, "none", 1, 1)),
    ("dense-1024", 2, P.Plan(2, 1, 1, 1, 0, "none", 8, 1)),
]


def model_config(name: str):
    base, overrides = MODELS[name]
    return get_preset(base).replace(**overrides) if overrides else get_preset(base)


def measure(model: str, procs: int, plan: P.Plan, steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{model}-{procs}-{plan.describe().replace(' ', '_').replace('=', '')}")
    base, model_overrides = MODELS[model]
    keys = {**plan.config_overrides(), **{f"model_overrides.{k}": v for k, v in model_overrides.items()}}
    return layout_step(base, procs, keys, steps, out, seq_len=S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cluster1", default=str(ROOT / "examples" / "clusters" / "cpu-2core-1proc.yaml"))
    p.add_argument("--cluster2", default=str(ROOT / "examples" / "clusters" / "cpu-2core.yaml"))
    p.add_argument("--layouts", choices=("default", "gradients"), default="default")
    p.add_argument("--out", default=None, help="default bench_results/planner_calibration[_gradients].json")
    p.add_argument(
        "--measured",
        default=None,
        help="a record this tool wrote: predict its layouts again with the current planner next to the "
        "measurements it holds, without training (after a change to the formulas)",
    )
    a = p.parse_args(argv)
    if a.measured and not a.out:  # the default --out is a record the docs cite: never written over by this
        p.error("--measured needs --out (a new record: the measurements are kept, the predictions are new)")
    if a.measured and Path(a.out).resolve() == Path(a.measured).resolve():
        p.error(f"--out {a.out}: the record --measured reads; write the new predictions elsewhere")
    layouts = LAYOUTS if a.layouts == "default" else GRADIENT_LAYOUTS
    suffix = "" if a.layouts == "default" else "_gradients"
    a.out = a.out or str(ROOT / "bench_results" / f"planner_calibration{suffix}.json")
    clusters = {1: P.load_cluster(a.cluster1), 2: P.load_cluster(a.cluster2)}
    recorded = {}
    if a.measured:
        source = json.loads(Path(a.measured).read_text())
        a.steps = source["workload"]["steps"]  # as those runs trained
        for r in source["rows"]:
            recorded[(r["model"], r["processes"], r["layout"])] = {
                "step_s": r["measured_step_s"],
                "memory": r["measured_memory"],
            }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, procs, plan in layouts:
            # erniekit train's pretrain takes the head's loss chunk by chunk (fused_head_loss)
            g = plan.micro_batch * plan.accumulation * plan.dp
            pred = P.predict(model_config(model), clusters[procs], P.Workload(g, S, fused_head=True), plan)
            key = (model, procs, plan.describe())
            if a.measured and key not in recorded:
                raise SystemExit(f"--measured {a.measured}: no row for {key}")
            got = recorded[key] if a.measured else measure(model, procs, plan, a.steps, tmp)
            row = {
                "model": model,
                "processes": procs,
                "layout": plan.describe(),
                "predicted_step_s": pred.step_s,
                "measured_step_s": got["step_s"],
                "predicted_memory": pred.memory,
                "measured_memory": got["memory"],
                "predicted_parts": {k: v for k, v in pred.parts.items() if k.endswith("_bytes")},
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
                "workload": {"global_batch": "micro_batch x accumulation x dp", "seq_len": S, "steps": a.steps},
                "measurements_from": a.measured,  # None: measured by this run
                "models": {m: MODELS[m] for m in sorted({r["model"] for r in rows})},
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
