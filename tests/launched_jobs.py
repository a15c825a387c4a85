"""Helpers for tests that start `erniekit` processes: training jobs (and their ranks), servers."""

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


def train(args: list[str], cwd: str, timeout: float = 600.0):
    """`python -m erniekit train ARGS` at 1 OpenMP thread, which must succeed: its CompletedProcess."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], url: str, cwd: str, timeout: float = 180.0):
    """Start `python -m erniekit ARGS` (a server) and wait until `url` answers; a generator for
    pytest fixtures: yields the process, stops it afterwards."""
    import subprocess
    import sys
    import time
    import urllib.request

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "erniekit", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            if p.poll() is not None:
                raise RuntimeError(p.stdout.read()) from None
            if time.time() > deadline:
                p.kill()
                raise TimeoutError(f"{url} did not answer within {timeout} s") from None
            time.sleep(0.3)
    try:
        yield p
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def job_processes(out) -> list[int]:
    """PIDs of live processes whose command line names `output_dir=<out>` (`erniekit train`, the
    launcher, every rank and server of the job): what must be gone once `erniekit train` ended."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{d}/cmdline").read().split("\0")
        except OSError:
            continue
        if f"output_dir={out}" in cmd:
            found.append(int(d))
    return found
