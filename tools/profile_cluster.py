"""Measure this machine's planner constants and write a cluster YAML (erniekit/distributed/planner.py).

Measured, per device (one process with --threads OpenMP threads):
  device_flops       best-of-10 1024^3 float32 paddle.matmul
  op_overhead_s      mean time of a tiny op (one launch, no math)
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

    a, b = paddle.randn([1024, 1024]), paddle.randn([1024, 1024])
    best = float("inf")
    for _ in range(11):
        t = time.perf_counter()
        paddle.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - t)
    x = paddle.ones([4])
    for _ in range(100):
        x = x + 1.0
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        x = x + 1.0
    float(x[0])
    op = (time.perf_counter() - t) / n
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"device_flops": 2 * 1024**3 / best, "op_overhead_s": op, "memory_overhead": rss}


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
    r = subprocess.run([sys.executable, __file__, "--role", "single"], env=env, capture_output=True, text=True, check=True)
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    if a.devices > 1:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "collective.json")
            subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(a.devices),
                            "--log_dir", os.path.join(tmp, "logs"), __file__, "--role", "collective"],
                           env=dict(env, PROFILE_OUT=out), check=True, capture_output=True)
            facts.update(json.loads(Path(out).read_text()))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = a.memory_gb * 1e9 if a.memory_gb else ram / a.devices
    name = a.name or f"cpu-{os.cpu_count()}core-{a.devices}proc"
    lines = [f"# measured by: python tools/profile_cluster.py --devices {a.devices} --threads {threads}",
             f"# ({os.cpu_count()} cores; one device = one process with {threads} OpenMP thread(s))",
             f"name: {name}", "nodes: 1", f"devices_per_node: {a.devices}",
             f"device_flops: {facts['device_flops']:.4g}      # float32 GEMM FLOP/s of one process",
             f"device_memory: {mem:.4g}", f"op_overhead_s: {facts['op_overhead_s']:.3g}     # one tiny op",
             f"memory_overhead: {facts['memory_overhead']:.4g}   # resident bytes of an idle process"]
    if a.devices > 1:
        lines += [f"intra_node_bandwidth: {facts['intra_node_bandwidth']:.4g}   # gloo ring all_reduce, bytes/s",
                  f"intra_node_latency_s: {facts['intra_node_latency_s']:.3g}"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
