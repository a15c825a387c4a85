"""Weak scaling of data parallelism (1 -> 2 processes) and the communication volume per step of
every layout runnable here, measured; the planner's predicted volume beside it.

Weak scaling: the per-device batch stays (8 packed rows of 128 tokens) and the process count
doubles; efficiency = tokens/s with 2 processes / (2 x tokens/s with 1), each process with one
OpenMP thread (one core each). A 1-process run with 2 threads and the doubled batch is printed
too: the whole machine without communication.

Volume: gloo on 127.0.0.1 moves every byte through the loopback interface, so the transmitted
bytes of `lo` (/proc/net/dev) during a run are the job's traffic. Each layout runs twice, with
--short and --long steps; (bytes_long - bytes_short) / (long - short) is the per-step volume
without start-up (rendezvous, the first broadcast) and checkpoint traffic. Run it on a quiet
machine: anything else on loopback is counted.

    python tools/bench_scaling.py [--short 5] [--long 25] [--out bench_results/scaling_bench.json]
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

from _train_runs import median_step_time, train  # noqa: E402

from erniekit.distributed import planner as P  # noqa: E402
from erniekit.models.ernie4_5 import get_preset  # noqa: E402

S, B = 128, 8  # tokens per packed row, rows per device per micro-batch
# name, model, processes, extra keys, plan for the planner (dp, tp, pp, ep, zero, recompute, mb, accum)
LAYOUTS = [
    ("dp=2", "tiny-dense", 2, [], P.Plan(2, 1, 1, 1, 0, "none", B, 1)),
    ("dp=2 zero1", "tiny-dense", 2, ["sharding=stage1"], P.Plan(2, 1, 1, 1, 1, "none", B, 1)),
    ("tp=2", "tiny-dense", 2, ["tensor_parallel_degree=2"], P.Plan(1, 2, 1, 1, 0, "none", B, 1)),
    (
        "pp=2 (4 micro-batches)",
        "tiny-dense",
        2,
        ["pipeline_parallel_degree=2", "gradient_accumulation_steps=4"],
        P.Plan(1, 1, 2, 1, 0, "none", B, 4),
    ),
    ("dp=2", "tiny-moe", 2, [], P.Plan(2, 1, 1, 1, 0, "none", B, 1)),
    ("dp=2 ep=2", "tiny-moe", 2, ["expert_parallel_degree=2"], P.Plan(2, 1, 1, 2, 0, "none", B, 1)),
    (
        "pp=2 (4 micro-batches)",
        "tiny-moe",
        2,
        ["pipeline_parallel_degree=2", "gradient_accumulation_steps=4"],
        P.Plan(1, 1, 2, 1, 0, "none", B, 4),
    ),
]


def loopback_tx_bytes() -> int:
    for line in open("/proc/net/dev"):
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise SystemExit("no loopback interface in /proc/net/dev: the volume cannot be measured here")


def run(model: str, procs: int, extra: list[str], steps: int, out: str, threads: int = 1, batch: int = B) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        "examples/configs/tiny/pretrain.yaml",
        f"model_name_or_path={model}",
        f"max_seq_len={S}",
        f"per_device_train_batch_size={batch}",
        f"max_steps={steps}",
        "logging_steps=5",
        "save_steps=100000",
        "disable_tqdm=true",
        "fp8=false",
        f"output_dir={out}",
        f"nproc_per_node={procs}",
        *extra,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
    before = loopback_tx_bytes()
    train(cmd, out, env)
    return {"bytes": loopback_tx_bytes() - before, "step_s": median_step_time(out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=5)
    p.add_argument("--long", type=int, default=25)
    p.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "cpu-2core.yaml"))
    p.add_argument("--out", default=str(ROOT / "bench_results" / "scaling_bench.json"))
    a = p.parse_args(argv)
    cluster = P.load_cluster(a.cluster)
    res: dict = {"seq_len": S, "per_device_rows": B, "steps": [a.short, a.long]}
    with tempfile.TemporaryDirectory() as tmp:
        # ---- weak scaling of data parallelism
        scaling = {}
        for model in ("tiny-dense", "tiny-moe"):
            one = run(model, 1, [], a.long, f"{tmp}/{model}-1")
            two = run(model, 2, [], a.long, f"{tmp}/{model}-2")
            whole = run(model, 1, [], a.long, f"{tmp}/{model}-1x2", threads=2, batch=2 * B)
            t1, t2, tw = (B * S / one["step_s"], 2 * B * S / two["step_s"], 2 * B * S / whole["step_s"])
            scaling[model] = {
                "tokens_per_s_1proc_1thread": t1,
                "tokens_per_s_2proc": t2,
                "tokens_per_s_1proc_2threads": tw,
                "weak_scaling_efficiency": t2 / (2 * t1),
                "two_processes_vs_one_with_2_threads": t2 / tw,
            }
            print(json.dumps({model: scaling[model]}), flush=True)
        res["weak_scaling"] = scaling
        # ---- communication volume per step
        rows = []
        for name, model, procs, extra, plan in LAYOUTS:
            tag = f"{tmp}/{model}-{name.replace(' ', '_')}"
            short = run(model, procs, extra, a.short, tag + "-s")
            long = run(model, procs, extra, a.long, tag + "-l")
            per_step = (long["bytes"] - short["bytes"]) / (a.long - a.short)
            pred = P.predict(get_preset(model), cluster, P.Workload(plan.dp * B * plan.accumulation, S), plan)
            row = {
                "model": model,
                "layout": name,
                "processes": procs,
                "measured_bytes_per_step": per_step,
                "measured_bytes_per_step_per_device": per_step / procs,
                "predicted_bytes_per_step_per_device": pred.parts["comm_bytes"],
                "step_s": long["step_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        res["volume"] = rows
    table = [
        "| model | layout | MB/step (all processes) | MB/step per device | planner MB per device | ratio | step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred, got = r["predicted_bytes_per_step_per_device"], r["measured_bytes_per_step_per_device"]
        table.append(
            f"| {r['model']} | {r['layout']} | {r['measured_bytes_per_step'] / 1e6:.2f} | {got / 1e6:.2f} | "
            f"{pred / 1e6:.2f} | {pred / got if got else float('nan'):.2f} | {r['step_s']:.3f} |"
        )
    res["table"] = table
    print("\n".join(table))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
