#!/usr/bin/env python
"""Where a training step's resident memory goes, erniekit and transformers + torch side by side
(issue #25: erniekit's peak is above torch's at 256 tokens while it is below at 4096).

    python tools/bench_heap.py [--model dense-1024] [--steps 5] [--threads 2] [--out bench_results/heap_dense-1024.json]

One process per framework on the checkpoint tools/bench_vs_torch.py writes (same model, same
batch, the same training steps as its train: cases). Each reports, in MiB:
  import_rss, loaded_rss, peak_rss   resident after the import, after loading, and the peak (VmHWM,
                                     what tools/bench_vs_torch.py compares)
  load_peak_rss                      the resident peak while loading (VmHWM, reset before the load)
  live_import, live_peak             bytes malloc has handed out and not had back (glibc's
                                     mallinfo2) after the import, and their peak during the steps
                                     (sampled every 0.5 ms: a short-lived peak can be missed)
  params                             the model's parameters
  weights_in_malloc                  whether loading put the weights in malloc'd memory (erniekit
                                     copies them there; transformers maps the safetensors file, and
                                     the optimizer's first update copies each page into anonymous
                                     memory outside malloc)
  live_growth                        live_peak - live_import, plus params where the weights are not
                                     malloc's: what the steps needed at their peak, weights included
  beyond_live                        peak_rss - import_rss - live_growth: what the allocator holds
                                     beyond that (freed blocks split by later, smaller ones)
ERNIEKIT_MALLOC_MMAP_MB (erniekit/utils/malloc.py) changes erniekit's beyond_live.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench_vs_torch as B  # noqa: E402  (the models, checkpoints and training shapes)

from erniekit.utils.malloc import live_bytes  # noqa: E402  (paddle-free)

MIB = 1 << 20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


class LivePeak:
    """The peak of malloc's in-use bytes (main and thread arenas, plus mapped blocks), sampled."""

    def __init__(self) -> None:
        if live_bytes() is None:
            raise SystemExit("bench_heap needs glibc >= 2.33 (mallinfo2)")
        self.peak = 0
        self._lock = threading.Lock()  # the sampler's read-modify-write against `restart`
        self._on = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def live(self) -> int:
        return live_bytes()

    def _run(self) -> None:
        while self._on:
            with self._lock:
                self.peak = max(self.peak, self.live())
            time.sleep(0.0005)

    def restart(self) -> None:
        """The peak from now on."""
        with self._lock:
            self.peak = self.live()

    def stop(self) -> int:
        self._on = False
        self._thread.join()
        return max(self.peak, self.live())


def _steps_erniekit(ckpt: str, case: str, steps: int):
    sys.path.insert(0, ROOT)
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    import paddle  # noqa: F401

    yield "import", None
    from erniekit.models.registry import load_model

    model = load_model(ckpt)
    yield "loaded", sum(int(p.numel()) * 4 for p in model.parameters())
    B.FUSED_HEAD_LOSS = "on"  # as erniekit train's default
    B._erniekit_train(model, case, steps)
    yield "trained", None


def _steps_torch(ckpt: str, case: str, steps: int, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    yield "import", None
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    yield "loaded", sum(p.numel() * 4 for p in model.parameters())
    b, s = B._train_shape(case)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x = torch.from_numpy(B._ids(model.config.vocab_size, b, s))
    for _ in range(steps + 2):  # bench_vs_torch's 2 warm-up steps and the timed ones
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    yield "trained", None


def measure(framework: str, ckpt: str, case: str, steps: int, threads: int) -> dict:
    """This process's figures (bytes; weights_in_malloc a bool) for one framework."""
    out: dict = {}
    sampler = LivePeak()
    phases = _steps_torch(ckpt, case, steps, threads) if framework == "torch" else _steps_erniekit(ckpt, case, steps)
    for phase, params in phases:
        if phase == "import":
            out["import_rss"], out["live_import"] = _status("VmRSS"), sampler.live()
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here: the load's peak
                f.write("5")
        elif phase == "loaded":
            out["loaded_rss"], out["load_peak_rss"], out["params"] = _status("VmRSS"), _status("VmHWM"), params
            out["weights_in_malloc"] = sampler.live() - out["live_import"] >= 0.9 * params
            sampler.restart()  # the steps' peak from here
        else:
            out["live_peak"], out["peak_rss"] = sampler.stop(), _status("VmHWM")
    outside = 0 if out["weights_in_malloc"] else out["params"]
    out["live_growth"] = out["live_peak"] - out["live_import"] + outside
    out["beyond_live"] = out["peak_rss"] - out["import_rss"] - out["live_growth"]
    return out


def _mib(v) -> str:
    return str(v) if isinstance(v, bool) else f"{v / MIB:.0f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dense-1024", choices=list(B.MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up ones, as bench_vs_torch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default=os.path.join(ROOT, "output", "bench_vs_torch"))
    p.add_argument("--out", help="JSON path (default bench_results/heap_<model>.json)")
    p.add_argument("--worker", choices=("erniekit", "torch"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    ckpt, case = os.path.join(a.workdir, a.model), f"train:{a.model}"
    if a.worker:
        print("RESULT " + json.dumps(measure(a.worker, ckpt, case, a.steps, a.threads)), flush=True)
        return
    B.write_checkpoint(a.model, ckpt)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    res = {}
    for fw in ("torch", "erniekit"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw, "--model", a.model]
        cmd += ["--steps", str(a.steps), "--threads", str(a.threads), "--workdir", a.workdir]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode or line is None:
            raise SystemExit(f"{fw} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        res[fw] = json.loads(line[len("RESULT ") :])
        print(fw.ljust(9), "  ".join(f"{k} {_mib(v)}" for k, v in res[fw].items()), flush=True)
    record = {
        "cpu": B._cpu(),
        "model": a.model,
        "batch": list(B._train_shape(case)),
        "threads": a.threads,
        "steps": a.steps,
        "malloc_mmap_mb": os.environ.get("ERNIEKIT_MALLOC_MMAP_MB") or None,
        "mib": {
            fw: {k: v if isinstance(v, bool) else round(v / MIB, 1) for k, v in r.items()} for fw, r in res.items()
        },
    }
    out = a.out or os.path.join(ROOT, "bench_results", f"heap_{a.model}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
