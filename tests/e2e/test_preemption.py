"""Stops and preemption (issue #23): SIGTERM / SIGINT end a run after a step with checkpoint-N and
`erniekit train` exits 128 + N (143 / 130), never 0. In a launched job (2-process data parallel,
the PS example) a SIGTERM to `erniekit train` or to any one rank ends every rank after the same
step, no process of the job survives, and resume_from_checkpoint=auto continues on the
uninterrupted curve. A run resumed after a kill logs no step twice (scalars.jsonl and VisualDL)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import concurrently, head_of, job_processes, worker_pids

ROOT = str(Path(__file__).resolve().parents[2])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic", "train.jsonl")
PS_CFG = os.path.join(ROOT, "examples", "configs", "tiny", "ps.yaml")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _args(out, steps=40, batch=8):
    """tiny-dense, 2 layers: a few steps a second, so a signal lands mid-run. The first 2000 rows of
    DATA: each process encodes its whole training file before the first step (20000 rows: ~1 s),
    and a run here trains on a few hundred."""
    return [
        "model_name_or_path=tiny-dense",
        "model_overrides.num_hidden_layers=2",
        f"train_dataset_path={head_of(DATA, 2000)}",
        "max_seq_len=32",
        f"per_device_train_batch_size={batch}",
        f"max_steps={steps}",
        "learning_rate=3e-3",
        "logging_steps=1",
        "do_eval=false",
        "save_steps=1000",
        "disable_tqdm=true",
        "lr_scheduler_type=constant",
        f"output_dir={out}",
    ]


def _start(args):
    return subprocess.Popen(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rows(out):
    path = os.path.join(out, "vdl_log", "scalars.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _wait_for_steps(out, p, n, timeout=300):
    """Until `n` training steps are logged (bounded; fails if the job ends first)."""
    deadline = time.time() + timeout
    while sum("train/loss" in r for r in _rows(out)) < n:
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.time() < deadline, f"fewer than {n} steps logged within {timeout} s"
        time.sleep(0.1)


def _loss_steps(out):
    return [r["step"] for r in _rows(out) if "train/loss" in r]


def _vdl_loss_steps(out):
    """Steps of train/loss in every VisualDL record file of the run, read by VisualDL itself."""
    from visualdl import LogReader

    logdir = os.path.join(out, "vdl_log")
    steps = []
    for name in sorted(os.listdir(logdir)):
        if "vdlrecords" in name:
            reader = LogReader(file_path=os.path.join(logdir, name))
            if "train/loss" in reader.get_tags().get("scalar", []):
                steps += [rec.id for rec in reader.get_data("scalar", "train/loss")]
    return steps


def _wait_gone(out, timeout=60):
    """PIDs of the job's processes (any command line naming output_dir) still there after `timeout` s."""
    deadline = time.time() + timeout
    while job_processes(out) and time.time() < deadline:
        time.sleep(0.2)
    return job_processes(out)


def _stop_steps(log_text):
    import re

    return [int(m) for m in re.findall(r"stopping at step (\d+)/\d+ on SIG\w+: writing checkpoint-\1", log_text)]


def _assert_complete_checkpoint(out, n):
    ck = out / f"checkpoint-{n}"
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= set(os.listdir(ck)), os.listdir(ck)
    assert json.load(open(ck / "trainer_state.json"))["global_step"] == n
    assert not [d for d in os.listdir(out) if d.startswith("checkpoint-") and d != f"checkpoint-{n}"]


# ---- one process ------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_run_exits_128_plus_the_signal_with_a_checkpoint(tmp_path, sig, code):
    out = tmp_path / "run"
    p = _start(_args(out, steps=500))
    _wait_for_steps(out, p, 3)
    p.send_signal(sig)
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == code, stdout[-2000:]
    (n,) = _stop_steps(stdout)
    _assert_complete_checkpoint(out, n)
    res = json.load(open(out / "train_results.json"))
    assert res["stopped_at_step"] == n and res["stop_signal"] == sig and res["global_step"] == n
    assert (out / "model.safetensors").exists() and not (out / ".erniekit-run.lock").exists()


def test_a_run_resumed_after_a_kill_logs_no_step_twice(tmp_path):
    """The state a kill leaves (steps 5-8 logged, checkpoint-8 never written, checkpoint-4 the
    latest) is made exactly by deleting checkpoint-8 of an 8-step run; the resume trains 5-8 again
    and they must be logged once (scalars.jsonl and VisualDL), with the same values."""
    import shutil

    out = tmp_path / "run"
    args = [a for a in _args(out, steps=8) if not a.startswith("save_steps=")] + ["save_steps=4"]
    assert _run(args).returncode == 0
    first = {r["step"]: r["train/loss"] for r in _rows(out) if "train/loss" in r}
    shutil.rmtree(out / "checkpoint-8")
    r = _run([*args, "resume_from_checkpoint=auto"])
    assert r.returncode == 0 and "checkpoint-4 at step 4" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert _loss_steps(out) == list(range(1, 9))
    assert sorted(_vdl_loss_steps(out)) == list(range(1, 9))
    again = {r["step"]: r["train/loss"] for r in _rows(out) if "train/loss" in r}
    np.testing.assert_allclose([again[s] for s in range(5, 9)], [first[s] for s in range(5, 9)], rtol=1e-6)


def test_a_sigkilled_run_resumes_with_every_step_logged_once(tmp_path):
    """A real SIGKILL at some step past checkpoint-4: after the resume scalars.jsonl and the
    VisualDL files hold steps 1..end once each (the checkpoint flushed VisualDL's buffered records,
    the resume dropped the ones past its checkpoint)."""
    out = tmp_path / "run"
    args = [a for a in _args(out, steps=500) if not a.startswith("save_steps=")] + ["save_steps=4"]
    p = _start(args)
    deadline = time.time() + 300
    while not (out / "checkpoint-4").is_dir() or max(_loss_steps(out), default=0) < 6:
        assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:]
        time.sleep(0.05)
    p.kill()
    p.communicate(timeout=60)
    end = max(_loss_steps(out)) + 2
    r = _run([*args, f"max_steps={end}", "resume_from_checkpoint=auto"])
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert _loss_steps(out) == list(range(1, end + 1))
    assert sorted(_vdl_loss_steps(out)) == list(range(1, end + 1))


# ---- launched jobs ----------------------------------------------------------------------------
STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """model -> the uninterrupted curve's run: one process, global batch 8 (what 2 data ranks x 4
    train on); each model's run once per module."""
    base, done = tmp_path_factory.mktemp("ref"), {}

    def run(model):
        if model not in done:
            out = base / model
            r = _run(_args(out, steps=STEPS) + [f"model_name_or_path={model}"])
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            done[model] = out
        return done[model]

    return run


def _by_step(out):
    rows = [r for r in _rows(out) if "train/loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["train/loss"] for r in rows}


LAYOUTS = {
    "dp": (4, []),
    "tp": (8, ["tensor_parallel_degree=2"]),
    "pp": (8, ["pipeline_parallel_degree=2"]),
    "ep": (4, ["model_name_or_path=tiny-moe", "expert_parallel_degree=2"]),
}


@pytest.mark.parametrize(
    "layout, target, sig",
    [
        ("dp", "erniekit train", signal.SIGTERM),
        ("dp", "rank 1", signal.SIGTERM),
        ("tp", "erniekit train", signal.SIGINT),
        ("pp", "rank 1", signal.SIGTERM),
        ("ep", "erniekit train", signal.SIGTERM),
    ],
)
def test_a_signal_stops_every_rank_of_a_launched_job_after_the_same_step(reference, tmp_path, layout, target, sig):
    """2 processes (data, tensor, pipeline or expert parallel), the signal to `erniekit train` (a scheduler,
    Ctrl-C) or to one rank: one checkpoint-N that both ranks wrote after the same step N, exit
    128 + the signal, no survivor; the resume follows the 1-process curve."""
    out = tmp_path / layout
    batch, extra = LAYOUTS[layout]
    args = _args(out, steps=STEPS, batch=batch) + ["nproc_per_node=2", *extra]
    p = _start(args + ["max_restart=1"])  # a stop is not a failure: no restart
    _wait_for_steps(out, p, 3)
    pids = worker_pids(out)
    assert sorted(pids) == [0, 1], pids
    os.kill(p.pid if target == "erniekit train" else pids[1], sig)
    stdout, _ = p.communicate(timeout=180)
    assert p.returncode == 128 + sig and "restart 1 of 1" not in stdout, stdout[-3000:]
    assert _wait_gone(out) == [], "processes of the job outlived erniekit train"
    logs = [(out / "launch_logs" / f"workerlog.{r}").read_text() for r in (0, 1)]
    (n,), (n1,) = _stop_steps(logs[0]), _stop_steps(logs[1])
    assert n == n1 and 3 <= n < STEPS, (n, n1)
    _assert_complete_checkpoint(out, n)
    res = json.load(open(out / "train_results.json"))
    assert res["stopped_at_step"] == n and res["stop_signal"] == sig
    assert "FatalError" not in logs[0] + logs[1]
    r = _run(args + ["resume_from_checkpoint=auto"])
    assert r.returncode == 0 and f"checkpoint-{n} at step {n}" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = _by_step(out), _by_step(reference("tiny-moe" if layout == "ep" else "tiny-dense"))
    assert sorted(got) == list(range(1, STEPS + 1))
    # 1e-5: what a 2-process layout keeps from the 1-process curve over 20 steps (tests/e2e/test_distributed.py)
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)],
        [want[s] for s in sorted(got)],
        rtol=1e-5,
        err_msg=f"stopped at {n}; resumed run:\n{r.stdout[-3000:]}",
    )


def test_a_sigkilled_erniekit_train_leaves_no_process_of_its_job(tmp_path):
    """The parent cannot forward a SIGKILL: the launcher and every rank get SIGTERM from the
    kernel when their parent dies (PR_SET_PDEATHSIG) and end after a step with a checkpoint."""
    out = tmp_path / "dp"
    p = _start(_args(out, steps=100000, batch=4) + ["nproc_per_node=2"])
    _wait_for_steps(out, p, 3)
    assert sorted(worker_pids(out)) == [0, 1]
    p.kill()
    p.communicate(timeout=60)
    assert _wait_gone(out, timeout=120) == [], "processes of the job outlived a SIGKILLed erniekit train"
    res = json.load(open(out / "train_results.json"))
    _assert_complete_checkpoint(out, res["stopped_at_step"])


def _ps_args(out, steps=200):
    return [
        PS_CFG,
        f"output_dir={out}",
        f"max_steps={steps}",
        "logging_steps=1",
        "save_steps=1000",
        "disable_tqdm=true",
        "max_seq_len=64",
        "model_overrides.num_hidden_layers=2",
        "lr_scheduler_type=constant",
        "warmup_steps=0",
    ]


@pytest.mark.parametrize("target", ["erniekit train", "server"])
def test_sigterm_stops_the_ps_example_with_a_checkpoint_and_no_survivors(tmp_path, target):
    """examples/configs/tiny/ps.yaml (2 workers, 1 server): SIGTERM to `erniekit train` or to the
    server (it tells the workers with its answer to their step's norm request)."""
    out = tmp_path / "ps"
    p = _start(_ps_args(out))
    _wait_for_steps(out, p, 3)
    pids = worker_pids(out)
    assert sorted(pids) == [0, 1, 2], pids
    os.kill(p.pid if target == "erniekit train" else pids[2], signal.SIGTERM)
    stdout, _ = p.communicate(timeout=180)
    assert p.returncode == 143, stdout[-3000:]
    assert _wait_gone(out) == [], "processes of the job outlived erniekit train"
    logs = [(out / "launch_logs" / f"workerlog.{r}").read_text() for r in (0, 1, 2)]
    (n,), (n1,) = _stop_steps(logs[0]), _stop_steps(logs[1])
    assert n == n1, (n, n1)
    _assert_complete_checkpoint(out, n)
    assert "FatalError" not in "".join(logs)
    if target == "server":  # the resume continues the curve of an uninterrupted run (the two run at once)
        steps = 2 * n if n < 20 else n + 4
        ref = tmp_path / "ref"
        r, r_ref = concurrently(
            lambda: _run(_ps_args(out, steps) + ["resume_from_checkpoint=auto"]), lambda: _run(_ps_args(ref, steps))
        )
        assert r.returncode == 0 and f"checkpoint-{n} at step {n}" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        assert r_ref.returncode == 0, r_ref.stdout[-3000:] + r_ref.stderr[-3000:]
        got, want = _by_step(out), _by_step(ref)
        assert sorted(got) == list(range(1, steps + 1))
        np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=1e-5)


def test_a_run_started_by_the_webui_takes_a_repeated_sigterm_as_one(tmp_path):
    """systemd signals every process of the service and the WebUI forwards its own SIGTERM to its
    runs (webui/runs.py stop_all): a run started with STOP_ONCE_ENV, as the WebUI starts them, takes
    the second SIGTERM as the first and still ends after its step with the checkpoint (without it
    the second one kills the run before its checkpoint)."""
    from erniekit.utils.run_control import STOP_ONCE_ENV

    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "erniekit", "train", *_args(out, steps=500)],
        cwd=ROOT,
        env=dict(ENV, **{STOP_ONCE_ENV: "1"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for_steps(out, p, 3)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # handled apart, not coalesced into one
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 143, stdout[-2000:]
    (n,) = _stop_steps(stdout)
    _assert_complete_checkpoint(out, n)
