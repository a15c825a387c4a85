"""Peak memory and step time of each activation-recompute granularity (erniekit/nn/recompute.py).

Each mode runs in a fresh process: build the model, run --steps forward+backward passes on random
tokens, and report (the peak of a training step is activations plus the backward's temporaries):
  - activations: memory the forward leaves alive for the backward (in use after the forward minus
    before it), exact: glibc's mallinfo2 in-use bytes on CPU, memory_allocated on GPU;
  - peak: the most memory in use during the step, above the loaded model: max_memory_allocated on
    GPU; on CPU mallinfo2 sampled every 0.2 ms by a thread (may miss a peak shorter than that);
  - the best step time; and each as a ratio to the run without recompute.
Writes JSON (default bench_results/recompute_bench.json).

    python tools/bench_recompute.py [--preset tiny-moe] [--hidden 256] [--layers 4] [--batch 8] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ["none", "core_attn", "full_attn", "mlp", "full"]


def _heap_in_use():
    """Bytes glibc malloc has handed out and not got back (Paddle's CPU tensors live there)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def used() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    return used


def worker(a: argparse.Namespace) -> dict:
    """One mode in this process: {activation_bytes, peak_bytes, step_s}."""
    from erniekit.utils.malloc import keep_freed_memory

    keep_freed_memory()
    import numpy as np
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.train.losses import causal_lm_loss_sum

    gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    paddle.set_device("gpu" if gpu else "cpu")
    cfg = get_preset(a.preset).replace(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=a.hidden * 3,
        max_position_embeddings=max(a.seq, 512),
    )
    if cfg.is_moe:
        cfg = cfg.replace(moe_intermediate_size=a.hidden)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(cfg).train()
    model.set_recompute(None if a.worker == "none" else a.worker)
    ids = np.random.RandomState(0).randint(3, cfg.vocab_size, (a.batch, a.seq))
    x = paddle.to_tensor(ids)
    used = paddle.device.cuda.memory_allocated if gpu else _heap_in_use()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:  # CPU: no allocator peak counter, so watch the heap
        while not stop.is_set():
            peak[0] = max(peak[0], used())
            time.sleep(0.0002)

    best, act, top = float("inf"), 0, 0
    for _ in range(a.steps):
        if gpu:
            paddle.device.cuda.synchronize()
            paddle.device.cuda.reset_max_memory_allocated()
        base = used()
        peak[0] = base
        thread = None if gpu else threading.Thread(target=sample)
        if thread:
            stop.clear()
            thread.start()
        t = time.perf_counter()
        out = model(x)
        loss = causal_lm_loss_sum(out.logits, ids) / ids.size
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        act = max(act, used() - base)
        loss.backward()
        float(loss)
        best = min(best, time.perf_counter() - t)
        if thread:
            stop.set()
            thread.join()
        top = max(top, (paddle.device.cuda.max_memory_allocated() if gpu else peak[0]) - base)
        del out, loss
        model.clear_gradients(set_to_zero=False)
    params = sum(int(p.numel()) for p in model.parameters())
    return {
        "activation_bytes": int(act),
        "peak_bytes": int(top),
        "step_s": best,
        "device": "gpu" if gpu else "cpu",
        "params": params,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench_results" / "recompute_bench.json"))
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--worker", mode] + [
            f"--{k}={getattr(a, k)}" for k in ("preset", "hidden", "layers", "batch", "seq", "steps")
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        r = rows[mode]
        print(
            f"{mode:10s} activations {r['activation_bytes'] / 1e6:7.1f} MB  peak {r['peak_bytes'] / 1e6:7.1f} MB"
            f"  step {r['step_s'] * 1e3:8.1f} ms"
        )
    from erniekit.distributed import planner
    from erniekit.models.ernie4_5 import get_preset

    cfg = get_preset(a.preset).replace(hidden_size=a.hidden, num_hidden_layers=a.layers, intermediate_size=a.hidden * 3)
    if cfg.is_moe:
        cfg = cfg.replace(moe_intermediate_size=a.hidden)
    for mode, r in rows.items():  # the planner's count of the same saved activations
        pred = planner.predict(
            cfg, planner.Cluster(), planner.Workload(a.batch, a.seq), planner.Plan(1, 1, 1, 1, 0, mode, a.batch, 1)
        )
        r["planner_activation_bytes"] = pred.parts["activations_bytes"]
    base = rows["none"]
    for r in rows.values():
        for k in ("activation_bytes", "peak_bytes"):
            r[k.replace("_bytes", "_ratio")] = r[k] / max(base[k], 1)
        r["time_ratio"] = r["step_s"] / base["step_s"]
    out = {
        "what": "memory the forward keeps for the backward, peak memory of the step above the loaded model, "
        "and best step time, per recompute mode (docs/distributed.md)",
        "setup": {k: getattr(a, k) for k in ("preset", "hidden", "layers", "batch", "seq", "steps")},
        "threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "machine": platform.machine(),
        "command": "python tools/bench_recompute.py " + " ".join(sys.argv[1:]),
        "modes": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
