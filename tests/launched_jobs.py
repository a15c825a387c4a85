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
    return erniekit("train", args, cwd, timeout)


def erniekit(command: str, args: list[str], cwd: str, timeout: float = 600.0):
    """`python -m erniekit COMMAND ARGS` at 1 OpenMP thread, which must succeed: its CompletedProcess."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "erniekit", command, *args],
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def tiny_teacher(root: str, out, steps: int, *extra: str) -> str:
    """The embedded default trained `steps` steps on the first 2000 rows of its data, as a teacher
    for the distillation tests (they check mechanics; the gains are measured by tools/*_demo.py);
    its output directory."""
    data = os.path.join(root, "examples", "data", "arithmetic", "train.jsonl")
    args = [os.path.join(root, "examples", "configs", "tiny", "sft.yaml"), f"output_dir={out}", f"max_steps={steps}"]
    args += [f"train_dataset_path={head_of(data, 2000)}", "do_eval=false", "save_steps=1000", "disable_tqdm=true"]
    train([*args, *extra], root)
    return str(out)


def concurrently(*calls):
    """Call the zero-argument callables `calls` at the same time, one thread each, and return their
    results in order (the first exception is raised, after every call has ended). For independent
    training runs of one test: a launched job spends most of its time waiting (process start-up,
    gloo rendezvous), so its runs overlap instead of queueing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
    return [f.result() for f in futures]


_HEADS: dict[tuple[str, int], str] = {}


def head_of(path: str, rows: int) -> str:
    """A copy of the first `rows` lines of the JSONL file `path`, made once per process and removed
    at exit. Every process of a run encodes its whole training file before the first step: 20000
    rows cost ~1 s a process (more when processes share the cores) in tests that train on a few
    hundred."""
    import atexit
    import shutil
    import tempfile

    key = (os.path.abspath(path), rows)
    if key not in _HEADS:
        d = tempfile.mkdtemp(prefix="erniekit-test-data-")
        atexit.register(shutil.rmtree, d, True)
        out = os.path.join(d, os.path.basename(path))
        with open(key[0], encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
            for _, line in zip(range(rows), src):
                dst.write(line)
        _HEADS[key] = out
    return _HEADS[key]


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


def run_two_rank_script(script: str, out, cwd: str) -> None:
    """`python -m paddle.distributed.launch --nproc_per_node 2 SCRIPT OUT` (a worker that writes
    OUT/rank<r>.json); asserts it succeeded, with the ranks' log tails as the message."""
    import subprocess
    import sys

    logs = os.path.join(str(out), "logs")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            "2",
            "--log_dir",
            logs,
            script,
            str(out),
        ],
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    tails = "".join(open(os.path.join(logs, f)).read()[-3000:] for f in os.listdir(logs) if f.startswith("workerlog"))
    assert r.returncode == 0, tails
