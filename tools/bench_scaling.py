"""Weak scaling of data parallelism (1 -> 2 processes) and the communication volume per step of
every layout runnable here, measured; the planner's predicted volume beside it.

Weak scaling: the per-device batch stays (8 packed rows of 128 tokens) and the process count
doubles; efficiency = tokens/s with 2 processes / (2 x tokens/s with 1), each process with one
OpenMP thread (one core each). Each repeat runs, back to back: 1 process; 2 processes with the
sums in shared memory (the default on one host, erniekit/distributed/collective/host_sum.py);
2 processes through gloo (ERNIEKIT_HOST_SUM=0); 1 process with 2 threads and the doubled batch
(the whole machine without communication); and two independent 1-process runs at once, the
ceiling this machine allows (two processes slow each other down through the shared memory
bandwidth and caches, with no communication at all). Median and range over --repeats.

Volume: gloo on 127.0.0.1 moves every byte through the loopback interface, so the transmitted
bytes of `lo` (/proc/net/dev) during a run are the job's traffic; these runs use gloo for every
sum (ERNIEKIT_HOST_SUM=0: the shared-memory sum moves the same bytes through memory, unseen by
`lo`). Each layout runs twice, with --short and --long steps; (bytes_long - bytes_short) /
(long - short) is the per-step volume without start-up (rendezvous, the first broadcast) and
checkpoint traffic. Run it on a quiet machine: anything else on loopback is counted.

    python tools/bench_scaling.py [--repeats 3] [--short 5] [--long 25] [--out bench_results/scaling_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _train_runs import median_step_time, pretrain_cmd, train  # noqa: E402

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


def run(
    model: str,
    procs: int,
    extra: list[str],
    steps: int,
    out: str,
    threads: int = 1,
    batch: int = B,
    env: dict | None = None,
) -> dict:
    cmd = pretrain_cmd(
        model, S, steps, out, f"per_device_train_batch_size={batch}", "fp8=false", f"nproc_per_node={procs}", *extra
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads), **(env or {}))
    before = loopback_tx_bytes()
    train(cmd, out, env)
    return {"bytes": loopback_tx_bytes() - before, "step_s": median_step_time(out)}


GLOO = {"ERNIEKIT_HOST_SUM": "0"}


def _independent_pair(model: str, steps: int, out: str) -> float:
    """Two 1-process runs at once, no communication: the slower one's step time."""
    times: list[float] = []
    threads = [
        threading.Thread(target=lambda k=k: times.append(run(model, 1, [], steps, f"{out}-{k}")["step_s"]))
        for k in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(times)


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def _efficiency(r: dict, key: str) -> list[float]:
    """Tokens/s of two processes over twice one process's, repeat by repeat."""
    return [x / (2 * one) for x, one in zip(r[key], r["one"])]


def weak_scaling(steps: int, repeats: int, tmp: str) -> dict:
    """Per model: tokens/s and efficiencies, median and range over the repeats (interleaved)."""
    runs: dict = {m: {k: [] for k in ("one", "shm", "gloo", "whole", "pair")} for m in ("tiny-dense", "tiny-moe")}
    for rep in range(repeats):
        for model, r in runs.items():
            tag = f"{tmp}/{model}-{rep}"
            r["one"].append(B * S / run(model, 1, [], steps, tag + "-1")["step_s"])
            r["shm"].append(2 * B * S / run(model, 2, [], steps, tag + "-2")["step_s"])
            r["gloo"].append(2 * B * S / run(model, 2, [], steps, tag + "-2g", env=GLOO)["step_s"])
            r["whole"].append(2 * B * S / run(model, 1, [], steps, tag + "-1x2", threads=2, batch=2 * B)["step_s"])
            r["pair"].append(2 * B * S / _independent_pair(model, steps, tag + "-pair"))
            print(json.dumps({model: {k: v[-1] for k, v in r.items()}}), flush=True)
    out = {}
    for model, r in runs.items():
        out[model] = {
            "tokens_per_s_1proc_1thread": _spread(r["one"]),
            "tokens_per_s_2proc": _spread(r["shm"]),
            "tokens_per_s_2proc_gloo": _spread(r["gloo"]),
            "tokens_per_s_1proc_2threads": _spread(r["whole"]),
            "tokens_per_s_2_independent_processes": _spread(r["pair"]),
            "weak_scaling_efficiency": _spread(_efficiency(r, "shm")),
            "weak_scaling_efficiency_gloo": _spread(_efficiency(r, "gloo")),
            "independent_processes_ceiling": _spread(_efficiency(r, "pair")),
            "two_processes_vs_one_with_2_threads": _spread([x / w for x, w in zip(r["shm"], r["whole"])]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="weak-scaling repeats (median and range)")
    p.add_argument("--no-volume", action="store_true", help="weak scaling only")
    p.add_argument("--short", type=int, default=5)
    p.add_argument("--long", type=int, default=25)
    p.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "cpu-2core.yaml"))
    p.add_argument("--out", default=str(ROOT / "bench_results" / "scaling_bench.json"))
    a = p.parse_args(argv)
    cluster = P.load_cluster(a.cluster)
    res: dict = {"seq_len": S, "per_device_rows": B, "steps": [a.short, a.long]}
    with tempfile.TemporaryDirectory() as tmp:
        # ---- weak scaling of data parallelism
        res["weak_scaling"] = weak_scaling(a.long, a.repeats, tmp)
        # ---- communication volume per step
        rows = []
        for name, model, procs, extra, plan in [] if a.no_volume else LAYOUTS:
            tag = f"{tmp}/{model}-{name.replace(' ', '_')}"
            short = run(model, procs, extra, a.short, tag + "-s", env=GLOO)
            long = run(model, procs, extra, a.long, tag + "-l", env=GLOO)
            per_step = (long["bytes"] - short["bytes"]) / (a.long - a.short)
            pred = P.predict(
                get_preset(model), cluster, P.Workload(plan.dp * B * plan.accumulation, S, fused_head=True), plan
            )
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
    res["table"] = table if rows else []
    print("\n".join(res["table"]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
