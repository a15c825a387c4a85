"""Two nodes on one host, as Paddle's own tests simulate them: two `erniekit train ... nnodes=2
master=127.0.0.1:PORT nproc_per_node=1` started together (no real network between them)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from launched_jobs import concurrently, free_port, head_of

ROOT = str(Path(__file__).resolve().parents[2])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic", "train.jsonl")


def _args(out, *extra: str) -> list[str]:
    return [
        "model_name_or_path=tiny-dense",
        "model_overrides.num_hidden_layers=2",
        f"train_dataset_path={head_of(DATA, 200)}",
        "max_seq_len=32",
        "per_device_train_batch_size=4",
        "max_steps=3",
        "learning_rate=3e-3",
        "logging_steps=1",
        "do_eval=false",
        "save_steps=2",
        "disable_tqdm=true",
        f"output_dir={out}",
        *extra,
    ]


def _train(args):
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _two_nodes(out_a, out_b, *extra: str):
    """Both nodes' CompletedProcess; each node's own output_dir (the same one: a shared filesystem)."""
    master = f"master=127.0.0.1:{free_port()}"
    node = ["nproc_per_node=1", "nnodes=2", master, *extra]
    return concurrently(lambda: _train(_args(out_a, *node)), lambda: _train(_args(out_b, *node)))


def _stop_rank_0s_node(out_a, out_b) -> tuple[dict, str]:
    """Two nodes with output_dirs of their own, training long; SIGTERM to the `erniekit train` of the
    node holding rank 0 (the one whose output_dir gets the logged steps) after its first logged step.
    Each node's (exit code, output), by output_dir, and rank 0's output_dir."""
    master = f"master=127.0.0.1:{free_port()}"
    node = ["nproc_per_node=1", "nnodes=2", master, "max_steps=200", "save_steps=1000"]
    logs = {out: open(f"{out}.log", "w+") for out in (out_a, out_b)}
    procs = {
        out: subprocess.Popen(
            [sys.executable, "-m", "erniekit", "train", *_args(out, *node)],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=logs[out],
            stderr=subprocess.STDOUT,
        )
        for out in (out_a, out_b)
    }
    deadline = time.time() + 240
    while not (rank_0 := next((o for o in procs if (Path(o) / "vdl_log" / "scalars.jsonl").is_file()), None)):
        assert time.time() < deadline and all(p.poll() is None for p in procs.values()), "no step logged"
        time.sleep(0.1)
    procs[rank_0].send_signal(signal.SIGTERM)
    ended = {}
    for out, p in procs.items():
        p.wait(timeout=240)
        logs[out].seek(0)
        ended[out] = (p.returncode, logs[out].read())
        logs[out].close()
    return ended, rank_0


def _losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    return np.array([r["train/loss"] for r in rows if "train/loss" in r])


def _ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_two_nodes_follow_one_node_stop_together_and_local_disks_refuse_a_resume(tmp_path):
    shared, one, node_a, node_b = tmp_path / "shared", tmp_path / "one", tmp_path / "a", tmp_path / "b"
    (a, b), single, (stopped, rank_0) = concurrently(
        lambda: _two_nodes(shared, shared),
        lambda: _train(_args(one, "nproc_per_node=2")),
        lambda: _stop_rank_0s_node(node_a, node_b),
    )
    for r in (a, b, single):
        _ok(r)
    np.testing.assert_allclose(_losses(shared), _losses(one), rtol=1e-5)
    assert len(_losses(shared)) == 3
    # each node's paddle logs in a folder of its own: both nodes' rank-0-on-the-node log is workerlog.0
    folders = [d for d in (shared / "launch_logs").iterdir() if d.is_dir()]
    assert len(folders) == 2 and all((d / "workerlog.0").is_file() for d in folders)
    assert sum("step 3/3" in (d / "workerlog.0").read_text() for d in folders) == 1  # rank 0 reports
    assert (shared / "checkpoint-2").is_dir() and (shared / "run_config.yaml").is_file()

    # output_dirs on each node's own disk, SIGTERM to rank 0's node: every rank stops after the same
    # step, and the other node (not signalled, rank 0's results not on its disk) exits 143 too, from
    # its ranks' stop notes, not 0 ("the run finished")
    step = json.loads((rank_0 / "train_results.json").read_text())["stopped_at_step"]
    other = node_b if rank_0 == node_a else node_a
    for code, output in stopped.values():
        assert code == 143, output[-3000:]
    assert f"stopped on SIGTERM after step {step} with checkpoint-{step} in rank 0's output_dir" in stopped[other][1]
    assert (rank_0 / f"checkpoint-{step}").is_dir() and not list(other.glob("checkpoint-*"))

    # so only rank 0's node holds checkpoint-N: a resume is refused on both nodes with one line
    # (exit 2, no restart) instead of one rank starting fresh
    results = _two_nodes(node_a, node_b, "max_steps=200", "resume_from_checkpoint=auto", "max_restart=1")
    for r in results:
        assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: resume_from_checkpoint=auto: the ranks see different checkpoints"), last
        assert f"checkpoint-{step}" in last and ": none" in last
        assert "restart" not in r.stdout
