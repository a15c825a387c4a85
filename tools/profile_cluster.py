"""Measure this machine's planner constants and write a cluster YAML (erniekit/distributed/planner.py).

Paddle is set up as every erniekit command sets it up (erniekit.utils.paddle_import: MKL's vector
kernels, contiguous transposes, the thread count). Measured, per device (one process with
--threads OpenMP threads; all --devices processes at once, since they share the memory bus):
  device_flops        best-of-11 1024^3 float32 paddle.matmul
  memory_overhead     resident memory of a process that imported paddle and erniekit and ran a
                      forward + backward of tiny-dense (a safe upper bound)
and, with --devices N > 1, between N processes started by `paddle.distributed.launch` on 127.0.0.1:
  intra_node_latency_s, intra_node_bandwidth   gloo all_reduce of one float; ring all_reduce of
                                               16 MiB: 2(n-1)/n x bytes / (time - latency)
  host_sum_latency_s, host_sum_bandwidth       the data-parallel replicas' sum through shared
                                               memory (one float; 16 MiB: bytes / (time - latency))
Then fitted, with the figures above held fixed, to the step time `erniekit train` logs for
tiny-dense on the planner's workload (packed rows of 128 tokens), on this cluster's N processes:
  op_overhead_s, memory_bandwidth   the cost per op launch and of the memory-bound traffic that make
                                    the planner's step match two runs (1 process, or N data-parallel
                                    replicas), micro-batch 2 and 16 per device
  spmd_op_overhead_s                (N > 1) the extra cost per op of a layout on DistTensors (ZeRO-1
                                    over the N ranks, micro-batch 8), what Paddle's dynamic SPMD adds
The calibration (tools/calibrate_planner.py) then predicts other models and layouts from these.

    python tools/profile_cluster.py --devices 2 --threads 1 --out examples/clusters/cpu-2core.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIT_MODEL, FIT_SEQ = "tiny-dense", 128


def single() -> dict:
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    import paddle

    import erniekit.models.ernie4_5  # noqa: F401  (its import cost belongs to the overhead)

    flops = best_gemm_flops(paddle)
    _one_step(paddle)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"device_flops": flops, "memory_overhead": rss}


def _one_step(paddle) -> None:
    """A forward + backward of FIT_MODEL, 16 x FIT_SEQ tokens: what the kernels, thread pools and
    kept heap blocks of a process that has trained add to an idle one (a safe upper bound of the
    memory outside the model's tensors)."""
    import numpy as np

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.train.losses import causal_lm_loss_sum

    c = get_preset(FIT_MODEL)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(c).train()
    ids = np.random.RandomState(0).randint(3, c.vocab_size, (16, FIT_SEQ))
    for _ in range(2):
        out = model(paddle.to_tensor(ids))
        (causal_lm_loss_sum(out.logits, ids) / ids.size).backward()
        model.clear_gradients(set_to_zero=False)


def fit_step_costs(cluster, devices: int, threads: int | None, steps: int, tmp: str) -> tuple[dict, list[str]]:
    """(op_overhead_s, memory_bandwidth[, spmd_op_overhead_s]) fitted to measured `erniekit train`
    steps of FIT_MODEL (see the module docstring), and a comment line per run for the YAML."""
    import numpy as np
    from _train_runs import layout_step

    from erniekit.distributed import planner as P
    from erniekit.models.ernie4_5 import get_preset

    c = get_preset(FIT_MODEL)
    base = dataclasses.replace(cluster, op_overhead_s=0.0, memory_bandwidth=1e30, spmd_op_overhead_s=0.0)

    def run(plan):
        out = os.path.join(tmp, plan.describe().replace(" ", "_").replace("=", ""))
        got = layout_step(FIT_MODEL, devices, plan.config_overrides(), steps, out, FIT_SEQ, threads)["step_s"]
        return got, P.Workload(plan.micro_batch * plan.accumulation * plan.dp, FIT_SEQ, fused_head=True)

    def step(cl, work, plan):
        return P.predict(c, cl, work, plan).step_s

    rows, rhs, notes = [], [], []
    for mb in (2, 16):
        plan = P.Plan(devices, 1, 1, 1, 0, "none", mb, 1)
        got, work = run(plan)
        known = step(base, work, plan)
        rows.append(
            [
                step(dataclasses.replace(base, op_overhead_s=1.0), work, plan) - known,
                step(dataclasses.replace(base, memory_bandwidth=1.0), work, plan) - known,
            ]
        )
        rhs.append(got - known)
        notes.append(f"{plan.describe()}: {got:.4f} s")
    op, inv_bw = np.linalg.solve(np.array(rows), np.array(rhs))
    fitted = {"op_overhead_s": max(float(op), 1e-7), "memory_bandwidth": 1.0 / max(float(inv_bw), 1e-13)}
    if devices > 1:
        plan = P.Plan(devices, 1, 1, 1, 1, "none", 8, 1)
        got, work = run(plan)
        cl = dataclasses.replace(cluster, **fitted, spmd_op_overhead_s=0.0)
        known = step(cl, work, plan)
        per_op = step(dataclasses.replace(cl, spmd_op_overhead_s=1.0), work, plan) - known
        fitted["spmd_op_overhead_s"] = max((got - known) / per_op, 0.0)
        notes.append(f"{plan.describe()}: {got:.4f} s")
    return fitted, notes


def best_gemm_flops(paddle) -> float:
    a, b = paddle.randn([1024, 1024]), paddle.randn([1024, 1024])
    best = float("inf")
    for _ in range(11):
        t = time.perf_counter()
        paddle.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best


def collective() -> dict:
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    n = dist.get_world_size()
    one, big = paddle.ones([1]), paddle.ones([4 * 2**20])  # 16 MiB
    dist.all_reduce(big)
    lat, best = _latency_and_best(lambda: dist.all_reduce(one), lambda: dist.all_reduce(big), dist.barrier)
    bw = 2 * (n - 1) / n * big.numel().item() * 4 / max(best - lat, 1e-9)
    out = {"intra_node_latency_s": lat, "intra_node_bandwidth": bw, **_host_sum(n, dist.get_rank(), dist)}
    if dist.get_rank() == 0:
        Path(os.environ["PROFILE_OUT"]).write_text(json.dumps(out))
    return out


def _latency_and_best(small, big, barrier) -> tuple[float, float]:
    """(mean seconds of `small` over 200 calls after 10 of warm-up, best of 5 `big` calls started
    together): a link's latency and its large transfer."""
    for _ in range(10):
        small()
    t = time.perf_counter()
    for _ in range(200):
        small()
    lat = (time.perf_counter() - t) / 200
    best = float("inf")
    for _ in range(5):
        barrier()
        t = time.perf_counter()
        big()
        best = min(best, time.perf_counter() - t)
    return lat, best


def _host_sum(n: int, rank: int, dist) -> dict:
    """The replicas' shared-memory sum (erniekit/distributed/collective/host_sum.py): {} when the
    ranks cannot use it here (then the planner counts gloo for them too)."""
    from erniekit.distributed.collective.host_sum import HostSum

    floats = 4 * 2**20  # 16 MiB
    hs = HostSum(n, rank)
    if hs.buffer(floats) is None:
        return {}
    hs.buffer(floats)[:] = 1.0
    lat, best = _latency_and_best(lambda: hs.sum(1), lambda: hs.sum(floats), dist.barrier)
    hs.close()
    return {"host_sum_latency_s": lat, "host_sum_bandwidth": floats * 4 / max(best - lat, 1e-9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="processes on this machine (devices of the cluster)")
    p.add_argument("--threads", type=int, default=None, help="OpenMP threads per process (default cores/devices)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory per device (default RAM / devices)")
    p.add_argument("--name", default=None)
    p.add_argument("--steps", type=int, default=25, help="steps of each fitted erniekit train run")
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
    from erniekit.distributed import planner as P

    measured = P.Cluster(devices_per_node=a.devices, device_memory=mem, name=name, **facts)
    with tempfile.TemporaryDirectory() as tmp:
        fitted, runs = fit_step_costs(measured, a.devices, threads, a.steps, tmp)
    facts.update(fitted)
    lines = [
        f"# measured by: python tools/profile_cluster.py --devices {a.devices} --threads {threads}",
        f"# ({os.cpu_count()} cores; one device = one process with {threads} OpenMP thread(s))",
        f"# fitted to {FIT_MODEL} steps of erniekit train ({FIT_SEQ}-token rows): " + "; ".join(runs),
        f"name: {name}",
        "device: cpu",
        "nodes: 1",
        f"devices_per_node: {a.devices}",
        f"device_flops: {facts['device_flops']:.4g}      # float32 GEMM FLOP/s of one process",
        f"device_memory: {mem:.4g}",
        f"op_overhead_s: {facts['op_overhead_s']:.3g}     # fitted with memory_bandwidth to the first two runs above",
        f"memory_bandwidth: {facts['memory_bandwidth']:.4g}",
        f"memory_overhead: {facts['memory_overhead']:.4g}   # resident bytes of a process after one model step",
    ]
    if a.devices > 1:
        lines += [
            f"spmd_op_overhead_s: {facts['spmd_op_overhead_s']:.3g}   # fitted to the ZeRO-1 run (DistTensors)",
            f"intra_node_bandwidth: {facts['intra_node_bandwidth']:.4g}   # gloo ring all_reduce, bytes/s",
            f"intra_node_latency_s: {facts['intra_node_latency_s']:.3g}",
        ]
        if "host_sum_bandwidth" in facts:
            lines += [
                f"host_sum_bandwidth: {facts['host_sum_bandwidth']:.4g}   # the replicas' shared-memory sum, bytes/s",
                f"host_sum_latency_s: {facts['host_sum_latency_s']:.3g}",
            ]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
