"""Helpers for tests that start `erniekit train ... nproc_per_node=N` jobs and act on their processes."""

import os


def worker_pids(out) -> dict[int, int]:
    """rank -> PID of the job writing to `out` (found by command line and rank variable)."""
    found = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{d}/cmdline").read().split("\0")
            if not any(c.endswith("launch_entry.py") for c in cmd) or f"output_dir={out}" not in cmd:
                continue
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{d}/environ").read().split("\0") if "=" in kv)
            found[int(env["PADDLE_TRAINER_ID"])] = int(d)
        except (OSError, KeyError, ValueError):
            continue
    return found
