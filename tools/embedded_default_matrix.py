#!/usr/bin/env python
"""Run README's first command (the embedded default) over seeds x thread counts x CPU kernel sets
and report the held-out exact match as a range, not as one machine's number.

The accuracy a run reaches depends on the last bits of its arithmetic (GEMM summation order
changes with the thread count and with the vector ISA the kernels pick), so a claim about the
default is a claim about this whole matrix. `--isa native` runs the kernels erniekit picks on this
CPU by itself; `--isa avx2` forces the non-AVX-512 kernels many laptops and AMD machines get
(ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2; on AMD CPUs erniekit maps them to MKL's
AVX2 kernels, erniekit/utils/mkl.py); `--isa generic` runs MKL's generic kernels (what Paddle's
MKL 2019 gives AMD CPUs outside erniekit's CLI: MKL_DEBUG_CPU_TYPE=1). Each run records the MKL
kernel set it got.

Resumable: every finished run is written to the JSON file at once, and a rerun skips the
(seed, threads, isa) cells already there for the same config and overrides. Runs go in parallel
while their threads fit in the cores (`--jobs`).

    python tools/embedded_default_matrix.py                          # the full matrix
    python tools/embedded_default_matrix.py --seeds 1,2 --threads 1 --isa avx2 max_steps=500
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISA_ENV = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"MKL_DEBUG_CPU_TYPE": "1"},
}
ISA_KEYS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE")
MKL_KERNELS = {"5": "AVX2 (MKL_DEBUG_CPU_TYPE=5)", "7": "AVX-512 (MKL_DEBUG_CPU_TYPE=7)"}
NAMED_BY_USER = {"1": "generic"}


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, else platform's guess)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The AVX-512 / AVX2 flags of this CPU, which decide the kernels the native runs get."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx2", "avx512f", "avx512_bf16", "amx")))
    except OSError:
        pass
    return []


def kernels(isa: str) -> str:
    """Which GEMM kernels an `isa` run gets here: MKL's own dispatch, or the set erniekit asks for."""
    sys.path.insert(0, str(ROOT))
    from erniekit.utils.mkl import mkl_cpu_type, read_cpuinfo

    chosen = mkl_cpu_type(ISA_ENV[isa], *read_cpuinfo())
    if "MKL_DEBUG_CPU_TYPE" in ISA_ENV[isa]:
        return NAMED_BY_USER[ISA_ENV[isa]["MKL_DEBUG_CPU_TYPE"]] + " (MKL_DEBUG_CPU_TYPE set by the run)"
    return MKL_KERNELS.get(chosen, "MKL's own dispatch") + (
        "; " + ", ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items()) if ISA_ENV[isa] else ""
    )


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None

    return parse


def loss_summary(out_dir: Path) -> dict:
    """First / lowest / last logged training loss and the eval exact match at every eval step."""
    path = out_dir / "vdl_log" / "scalars.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    losses = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    if not losses:
        return {"eval_exact_match": evals}
    return {
        "first_loss": losses[0][1],
        "min_loss": min(v for _, v in losses),
        "final_loss": losses[-1][1],
        "loss_at": {str(s): round(v, 4) for s, v in losses[:: max(1, len(losses) // 8)]},
        "eval_exact_match": evals,
    }


def train_data_sha256(config: str, overrides: list[str]) -> str | None:
    """sha256 of the training file the runs read (an override's train_dataset_path, else the
    config's; None when it is not one file here): a matrix of other data is another matrix."""
    path = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("train_dataset_path=")), None)
    if path is None:
        import yaml

        path = (yaml.safe_load((ROOT / config).read_text()) or {}).get("train_dataset_path")
    if not isinstance(path, str) or not (ROOT / path).is_file():
        return None
    return hashlib.sha256((ROOT / path).read_bytes()).hexdigest()


def run_cell(config: str, overrides: list[str], seed: int, threads: int, isa: str, out_dir: Path) -> dict:
    """One `erniekit train` run of the matrix; its record (exact match None when it failed)."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_KEYS}
    env.update(ISA_ENV[isa], OMP_NUM_THREADS=str(threads))
    cmd = [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        config,
        f"seed={seed}",
        f"output_dir={out_dir}",
        "disable_tqdm=true",
        *overrides,
    ]
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rec = {
        "seed": seed,
        "threads": threads,
        "isa": isa,
        "cpu": cpu_model(),
        "kernels": kernels(isa),
        "wall_s": round(wall, 1),
        "returncode": r.returncode,
        "exact_match": None,
    }
    results = out_dir / "train_results.json"
    if r.returncode == 0 and results.exists():
        res = json.loads(results.read_text())
        ev = res.get("eval", {})
        # a tool-calling config (sft_tools.yaml) reports its two lines, its score being the final
        # answer; the VL default its majority-answer baseline
        for k in ("tool_call_match", "final_answer_accuracy", "baseline_exact_match"):
            if k in ev:
                rec[k] = ev[k]
        rec["exact_match"] = ev.get("exact_match", ev.get("final_answer_accuracy"))
        rec["global_step"] = res.get("global_step")
        rec["train_runtime_s"] = round(res.get("train_runtime_s", float("nan")), 1)
    else:
        rec["error_tail"] = (r.stdout[-1500:] + r.stderr[-1500:]).strip()
    rec.update(loss_summary(out_dir))
    return rec


def run_all(cells: list[tuple], capacity: int, jobs: int, run, done) -> None:
    """Run every cell (seed, threads, isa) with at most `jobs` at once and their threads summed
    within `capacity`: the first cell in order that fits starts; `done` gets each record."""
    pending, running = list(cells), {}
    free = capacity
    with futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        while pending or running:
            fits = next((c for c in pending if c[1] <= free or (not running and c[1] > capacity)), None)
            if fits is not None and len(running) < jobs:
                pending.remove(fits)
                free -= fits[1]
                running[pool.submit(run, fits)] = fits
                continue
            finished, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for f in finished:
                free += running.pop(f)[1]
                done(f.result())


def summarize(runs: list[dict]) -> dict:
    scores = [r["exact_match"] for r in runs if r.get("exact_match") is not None]
    if not scores:
        return {"runs": len(runs), "finished": 0}
    return {
        "runs": len(runs),
        "finished": len(scores),
        "min": min(scores),
        "median": statistics.median(scores),
        "max": max(scores),
        "mean": statistics.fmean(scores),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to every run (part of the cell key)")
    p.add_argument("--config", default="examples/configs/tiny/sft.yaml", help="training config (default: %(default)s)")
    p.add_argument("--seeds", type=_csv(int), default=[1, 2, 3, 42], help="comma-separated seeds (default: 1,2,3,42)")
    p.add_argument("--threads", type=_csv(int), default=[1, 2], help="OMP_NUM_THREADS values (default: 1,2)")
    p.add_argument(
        "--isa",
        type=_csv(str),
        default=["native", "avx2"],
        help="kernel sets: native, avx2 and/or generic (default: native,avx2)",
    )
    p.add_argument("--jobs", type=int, default=0, help="runs at once (default: as many as the cores hold)")
    p.add_argument(
        "--out", default="bench_results/embedded_default_matrix.json", help="JSON file (default: %(default)s)"
    )
    p.add_argument("--workdir", default="output/embedded_default_matrix", help="run directories (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="ignore finished runs in --out and run every cell again")
    args = p.parse_args(argv)
    bad = [i for i in args.isa if i not in ISA_ENV]
    if bad:
        p.error(f"--isa {','.join(bad)}: use some of {', '.join(ISA_ENV)}")
    if any(t < 1 for t in args.threads) or args.jobs < 0:
        p.error("--threads must be >= 1 and --jobs >= 0")

    out_path = ROOT / args.out
    # the training data is part of what a run measures: regenerated data starts a fresh matrix
    key = {
        "config": args.config,
        "overrides": args.overrides,
        "train_data_sha256": train_data_sha256(args.config, args.overrides),
    }
    doc = json.loads(out_path.read_text()) if out_path.exists() and not args.fresh else {}
    if doc.get("key") != key:
        if doc.get("runs"):  # another matrix's record (other config, overrides or data): never overwritten
            p.error(
                f"--out {args.out} holds {len(doc['runs'])} runs of another matrix (key {doc.get('key')}; "
                f"this one: {key}); pass --fresh to replace them, or another --out"
            )
        doc = {"key": key, "runs": []}
    doc.update(cpu=cpu_model(), cpu_flags=cpu_flags(), cores=os.cpu_count(), python=platform.python_version())
    done = {(r["seed"], r["threads"], r["isa"]) for r in doc["runs"] if r.get("exact_match") is not None}
    doc["runs"] = [r for r in doc["runs"] if (r["seed"], r["threads"], r["isa"]) in done]
    cells = [(s, t, i) for i in args.isa for t in args.threads for s in args.seeds if (s, t, i) not in done]
    cores = os.cpu_count() or 1
    lock = threading.Lock()

    def finish(rec: dict) -> None:
        with lock:
            doc["runs"].append(rec)
            doc["summary"] = summarize(doc["runs"])
            out_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = out_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, out_path)
        print(
            f"seed {rec['seed']:>3} threads {rec['threads']} isa {rec['isa']:<6} exact match "
            f"{rec['exact_match'] if rec['exact_match'] is not None else 'FAILED'}  ({rec['wall_s']:.0f} s)",
            flush=True,
        )

    print(f"{len(done)} cells done, {len(cells)} to run on {cpu_model()} ({cores} cores)", flush=True)
    # Runs share the cores: a run starts when its threads fit in the free cores (never two runs
    # holding half the cores each), widest first, and the narrow ones fill the gaps; a wide run
    # waiting for cores never keeps a narrow one from starting on a free core.
    jobs = args.jobs or max(1, cores // max(1, min(args.threads)))
    capacity = max(cores, max(args.threads))
    run_all(
        sorted(cells, key=lambda c: -c[1]),
        capacity,
        jobs,
        lambda c: run_cell(args.config, args.overrides, *c, ROOT / args.workdir / f"s{c[0]}_t{c[1]}_{c[2]}"),
        lambda rec: finish({**rec, "parallel_jobs": jobs}),
    )
    summary = summarize(doc["runs"])
    if not summary.get("finished"):
        print("no run finished")
        return 1
    print(
        f"held-out exact match over {summary['finished']} runs: min {summary['min']:.3f}  median "
        f"{summary['median']:.3f}  max {summary['max']:.3f}  ({cpu_model()}; {os.path.relpath(out_path, ROOT)})"
    )
    return 0 if summary["finished"] == summary["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
