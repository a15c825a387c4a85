"""What the tools that time `erniekit train` runs share: run one, stop with its log's tail when it
fails, and read the median logged step time."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
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
