"""Measure this machine's planner constants and write a cluster YAML (erniekit/distributed/planner.py).

Measured, per device (one process with --threads OpenMP threads; all --devices processes at once,
since they share the memory bus):
  device_flops       best-of-10 1024^3 float32 paddle.matmul
  op_overhead_s      per op launch, and
  memory_bandwidth   of the memory-bound ops: the two that make the planner match measured
                     tiny-dense steps at 2 x 128 and 16 x 128 tokens
  memory_overhead    resident memory of a process that imported paddle and erniekit
and, with --devices N > 1, through `python -m paddle.distributed.launch` on 127.0.0.1 (gloo on CPU):
  intra_node_latency_s    mean all_reduce of one float
  intra_node_bandwidth    ring all_reduce of 16 MiB: 2(n-1)/n x bytes / (time - latency)

    python tools/profile_cluster.py --devices 2 --threads 1 --out examples/clusters/cpu-2core.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def single() -> dict:
    from erniekit.utils.malloc import keep_freed_memory

    keep_freed_memory()
    import paddle

    import erniekit.models.ernie4_5  # noqa: F401  (its import cost belongs to the overhead)

    flops = best_gemm_flops(paddle)
    op, mem_bw = _fit_overheads(paddle, flops)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"device_flops": flops, "op_overhead_s": op, "memory_bandwidth": mem_bw, "memory_overhead": rss}


def _fit_overheads(paddle, flops_s: float) -> tuple[float, float]:
    """(op_overhead_s, memory_bandwidth) that make the planner's compute term match two measured
    training steps (forward + backward) of a reference model: tiny-dense at 2 x 128 and 16 x 128
    tokens. Small models are dominated by what FLOPs do not count: a fixed cost per op launch
    (dispatch, autograd) and memory-bound elementwise ops whose cost grows with the batch. The
    other layouts and models of the calibration are predictions."""
    import dataclasses

    import numpy as np

    from erniekit.distributed import planner as P
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.train.losses import causal_lm_loss_sum

    c, S = get_preset("tiny-dense"), 128
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(c).train()
    base = dataclasses.replace(P.Cluster(), device_flops=flops_s, op_overhead_s=0.0, memory_bandwidth=1e30)
    rows, rhs = [], []
    for B in (2, 16):
        ids = np.random.RandomState(0).randint(3, c.vocab_size, (B, S))
        best = float("inf")
        for _ in range(6):
            t = time.perf_counter()
            out = model(paddle.to_tensor(ids))
            (causal_lm_loss_sum(out.logits, ids) / ids.size).backward()
            model.clear_gradients(set_to_zero=False)
            best = min(best, time.perf_counter() - t)
        plan, work = P.Plan(1, 1, 1, 1, 0, "none", B, 1), P.Workload(B, S)
        flops_only = P.predict(c, base, work, plan).parts["compute_s"]
        per_op = P.predict(c, dataclasses.replace(base, op_overhead_s=1.0), work, plan).parts["compute_s"] - flops_only
        per_inv_bw = (
            P.predict(c, dataclasses.replace(base, memory_bandwidth=1.0), work, plan).parts["compute_s"] - flops_only
        )
        rows.append([per_op, per_inv_bw])
        rhs.append(best - flops_only)
    op, inv_bw = np.linalg.solve(np.array(rows), np.array(rhs))
    return max(float(op), 1e-7), 1.0 / max(float(inv_bw), 1e-12)


def best_gemm_flops(paddle) -> float:
    a, b = paddle.randn([1024, 1024]), paddle.randn([1024, 1024])
    best = float("inf")
    for _ in range(11):
        t = time.perf_counter()
        paddle.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best


def collective() -> dict:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    n = dist.get_world_size()
    one = paddle.ones([1])
    for _ in range(10):
        dist.all_reduce(one)
    t = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(one)
    lat = (time.perf_counter() - t) / 200
    big = paddle.ones([4 * 2**20])  # 16 MiB
    dist.all_reduce(big)
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(big)
        best = min(best, time.perf_counter() - t)
    bw = 2 * (n - 1) / n * big.numel().item() * 4 / max(best - lat, 1e-9)
    out = {"intra_node_latency_s": lat, "intra_node_bandwidth": bw}
    if dist.get_rank() == 0:
        Path(os.environ["PROFILE_OUT"]).write_text(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="processes on this machine (devices of the cluster)")
    p.add_argument("--threads", type=int, default=None, help="OpenMP threads per process (default cores/devices)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory per device (default RAM / devices)")
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=str(ROOT / "examples" / "clusters" / "cpu-2core.yaml"))
    p.add_argument("--role", choices=["single", "collective"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role:
        print(json.dumps(single() if a.role == "single" else collective()))
        return 0
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.devices)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", GLOG_minloglevel="2")
    # all devices of the node measured at once: they share the memory bus, as in training
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", "single"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(a.devices)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("profiling failed: run python tools/profile_cluster.py --role single to see why")
    facts = json.loads(outs[0].strip().splitlines()[-1])
    if a.devices > 1:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "collective.json")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "paddle.distributed.launch",
                    "--nproc_per_node",
                    str(a.devices),
                    "--log_dir",
                    os.path.join(tmp, "logs"),
                    __file__,
                    "--role",
                    "collective",
                ],
                env=dict(env, PROFILE_OUT=out),
                check=True,
                capture_output=True,
            )
            facts.update(json.loads(Path(out).read_text()))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = a.memory_gb * 1e9 if a.memory_gb else ram / a.devices
    name = a.name or f"cpu-{os.cpu_count()}core-{a.devices}proc"
    lines = [
        f"# measured by: python tools/profile_cluster.py --devices {a.devices} --threads {threads}",
        f"# ({os.cpu_count()} cores; one device = one process with {threads} OpenMP thread(s))",
        f"name: {name}",
        "nodes: 1",
        f"devices_per_node: {a.devices}",
        f"device_flops: {facts['device_flops']:.4g}      # float32 GEMM FLOP/s of one process",
        f"device_memory: {mem:.4g}",
        f"op_overhead_s: {facts['op_overhead_s']:.3g}     # fitted with memory_bandwidth to tiny-dense",
        f"memory_bandwidth: {facts['memory_bandwidth']:.4g}   # fwd+bwd steps at 2x128 and 16x128 tokens",
        f"memory_overhead: {facts['memory_overhead']:.4g}   # resident bytes of an idle process",
    ]
    if a.devices > 1:
        lines += [
            f"intra_node_bandwidth: {facts['intra_node_bandwidth']:.4g}   # gloo ring all_reduce, bytes/s",
            f"intra_node_latency_s: {facts['intra_node_latency_s']:.3g}",
        ]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
