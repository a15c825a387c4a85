"""What the tools that time `erniekit train` runs share: run one, stop with its log's tail when it
fails, and read the median logged step time."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(cmd: list[str], out: str, env: dict[str, str]) -> None:
    """Run `cmd` (an `erniekit train ... output_dir=out`) from the repository root; on failure
    exit with the first worker's log tail (or the command's output)."""
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        log = Path(out, "launch_logs", "workerlog.0")
        tail = log.read_text()[-3000:] if log.exists() else r.stdout[-2000:] + r.stderr[-2000:]
        raise SystemExit(f"{' '.join(cmd)} failed:\n{tail}")


def median_step_time(out: str, after_step: int = 5) -> float:
    """Median of the logged `train/step_time_s` after the first window (start-up excluded)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    times = [row["train/step_time_s"] for row in rows if "train/step_time_s" in row and row["step"] > after_step]
    return statistics.median(times) if times else float("nan")


def pretrain_cmd(model: str, seq_len: int, steps: int, out: str, *overrides: str) -> list[str]:
    """`erniekit train` of `model` on the packed pretraining corpus (rows of seq_len tokens), logging
    every 5 steps, no checkpoint, then `overrides` (key=value)."""
    return [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        "examples/configs/tiny/pretrain.yaml",
        f"model_name_or_path={model}",
        f"max_seq_len={seq_len}",
        f"max_steps={steps}",
        "logging_steps=5",
        "save_steps=100000",
        "disable_tqdm=true",
        f"output_dir={out}",
        *overrides,
    ]


def layout_step(
    model: str, procs: int, overrides: dict, steps: int, out: str, seq_len: int = 128, threads=None
) -> dict:
    """Train `model` on the packed pretraining corpus (every row seq_len tokens, the planner's
    workload) for `steps` steps through `erniekit train` with the config keys `overrides` (a
    planner Plan's `config_overrides()`) on `procs` processes; -> {"step_s": the median logged
    step time after the first window, "memory": rank 0's peak resident bytes}. threads: OpenMP
    threads per process (None: the CLI splits the cores between the processes)."""
    keys = {**overrides, "nproc_per_node": procs}
    args = [
        f"{k}={'true' if v is True else 'false' if v is False else v if v != '' else 'none'}" for k, v in keys.items()
    ]
    cmd = pretrain_cmd(model, seq_len, steps, out, *args)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    train(cmd, out, env)
    res = json.loads(Path(out, "train_results.json").read_text())
    return {"step_s": median_step_time(out), "memory": res["peak_memory_bytes"]}
