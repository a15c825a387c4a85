"""Parameter-server mode report (issue #8, docs/ps.md): bytes moved per step against dense data
parallelism, compression's bytes and loss, scheduler quality against exact and greedy, and the
chosen placement's cost and throughput against CPU-only and GPU-only.

1. Measured on this machine (gloo on 127.0.0.1, every byte through `lo`): tiny-moe, 8 packed
   rows of 128 tokens per worker; 1 server + 2 workers against 2 data-parallel processes.
   Each run twice (--short and --long steps); the difference / steps is the per-step volume.
2. Modelled for ERNIE-4.5-0.3B at 2 workers x 16 x 1024 tokens: the embedding's share of a dense
   all-reduce against the PS traffic (pull + push of the distinct rows, the final hidden states
   of the trained positions and their gradient).
3. Scheduler quality on seeded synthetic instances (erniekit/distributed/ps/scheduler.py).
4. ERNIE-4.5-0.3B on examples/clusters/hetero-cpu-gpu.yaml: the RL placement against CPU-only
   and GPU-only at several throughput targets.

    python tools/bench_ps.py [--short 5] [--long 25] [--out bench_results/ps_bench.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _train_runs import train  # noqa: E402
from bench_scaling import loopback_tx_bytes  # noqa: E402

CFG = str(ROOT / "examples" / "configs" / "tiny" / "ps.yaml")


def _run(extra: list[str], steps: int, out: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        CFG,
        f"max_steps={steps}",
        "logging_steps=5",
        "save_steps=100000",
        "disable_tqdm=true",
        f"output_dir={out}",
        *extra,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    before = loopback_tx_bytes()
    train(cmd, out, env)
    res = json.load(open(os.path.join(out, "train_results.json")))
    return {
        "bytes": loopback_tx_bytes() - before,
        "loss": res["train"]["train/loss"],
        "ps": res.get("ps_bytes_per_worker"),
    }


def measured(short: int, long: int) -> dict:
    layouts = {
        "ps 1 server + 2 workers": [],
        "ps, int8 pushes": ["ps_compress=int8"],
        "ps, top-10% pushes": ["ps_compress=topk", "ps_topk_ratio=0.1"],
        "dp=2 (collective)": ["distributed_mode=collective", "nproc_per_node=2"],
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in layouts.items():
            tag = os.path.join(tmp, name.replace(" ", "_").replace(",", "").replace("%", ""))
            a, b = _run(extra, short, tag + "-s"), _run(extra, long, tag + "-l")
            row = {"bytes_per_step": (b["bytes"] - a["bytes"]) / (long - short), "loss": b["loss"]}
            if b["ps"]:
                row["pushed_row_gradient_bytes_per_step_per_worker"] = (
                    b["ps"]["pushed_row_gradients"] - a["ps"]["pushed_row_gradients"]
                ) / (long - short)
            out[name] = row
            print(json.dumps({name: row}), flush=True)
    return out


def modelled(unique_fraction: float) -> dict:
    """ERNIE-4.5-0.3B, 2 workers x 16 x 1024 tokens: per-step bytes of the embedding table."""
    from erniekit.models.ernie4_5 import get_preset

    c = get_preset("ERNIE-4.5-0.3B")
    V, H, W, tokens = c.vocab_size, c.hidden_size, 2, 16 * 1024
    dense = 2 * (W - 1) / W * V * H * 4 * W  # ring all-reduce of the table's gradient, all devices
    rows = min(V, unique_fraction * tokens)  # distinct ids per worker
    ps = W * (2 * rows * H * 4 + rows * 8 + 2 * tokens * H * 4)  # pull + push rows, ids, h and its gradient
    return {
        "vocab": V,
        "hidden": H,
        "workers": W,
        "tokens_per_worker": tokens,
        "distinct_rows_per_worker": rows,
        "dense_allreduce_of_table_bytes": dense,
        "ps_bytes": ps,
        "ps_over_dense": ps / dense,
    }


def scheduler_quality() -> dict:
    from erniekit.distributed.ps.scheduler import against_exact, against_greedy

    t0 = time.perf_counter()
    pairs = against_exact(range(40))
    small = {
        "instances": len(pairs),
        "rl_equals_exact": sum(rl <= ex * (1 + 1e-9) for rl, ex in pairs),
        "seconds": time.perf_counter() - t0,
    }
    pairs = against_greedy(range(12))
    ratios = [rl / g for rl, g in pairs]
    large = {
        "instances": len(pairs),
        "rl_cheaper_than_greedy": sum(rl < g * (1 - 1e-6) for rl, g in pairs),
        "mean_rl_over_greedy_cost": float(np.mean(ratios)),
        "min_rl_over_greedy_cost": float(np.min(ratios)),
    }
    return {"small_4_5_parts": small, "large_40_parts": large}


def placements() -> list[dict]:
    from erniekit.distributed.ps.cost_model import load_hetero_cluster
    from erniekit.distributed.ps.plan import describe, plan_placement
    from erniekit.errors import ConfigError
    from erniekit.models.ernie4_5 import get_preset

    cluster = load_hetero_cluster(str(ROOT / "examples" / "clusters" / "hetero-cpu-gpu.yaml"))
    out = []
    for target in (3e4, 1e5, 2e5):
        try:
            rows, _ = plan_placement(get_preset("ERNIE-4.5-0.3B"), cluster, 1024, 16, target)
        except ConfigError as e:
            out.append({"target": target, "error": str(e)})
            continue
        tokens = 16 * 1024
        for r in rows:
            ev = r.evaluation
            out.append(
                {
                    "target": target,
                    "placement": r.name,
                    "feasible": ev.feasible,
                    "tokens_per_s": ev.throughput,
                    "usd_per_1m_tokens": ev.cost_per_batch / tokens * 1e6 if ev.feasible else math.inf,
                    "stages": describe(ev),
                    "why": ev.why,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=5)
    p.add_argument("--long", type=int, default=25)
    p.add_argument("--out", default=str(ROOT / "bench_results" / "ps_bench.json"))
    a = p.parse_args(argv)
    res = {"measured_tiny_moe": measured(a.short, a.long)}
    # assumed: distinct ids ~ 1/4 of 16k tokens of natural text (not measured here: the tiny vocabulary has 512)
    res["modelled_ernie_0_3b"] = modelled(unique_fraction=0.25)
    res["scheduler_quality"] = scheduler_quality()
    res["placements_ernie_0_3b"] = placements()
    print(json.dumps({k: v for k, v in res.items() if k != "measured_tiny_moe"}, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
