"""`erniekit train`'s side of a launched job on one or several nodes (erniekit/distributed/launch.py):
where ranks leave their notes, where paddle writes their logs, what a stop means on a node without
rank 0; and the ranks' agreement on the checkpoint they resume from (erniekit/distributed/join.py)."""

import os
import signal
import socket
import sys
import time
from types import SimpleNamespace

from erniekit.distributed import launch
from erniekit.distributed.join import resume_found, resume_mismatch


def test_a_rank_that_cannot_write_its_output_dir_still_leaves_its_note(tmp_path, monkeypatch, capsys):
    """The rank refuses its output_dir (here a path under a file: not creatable) before its first step.
    Its note goes to the folder the parent passed in the environment, so `erniekit train` reports the
    error once and exits 2 instead of restarting the job max_restart times."""
    out, starts = tmp_path / "o", tmp_path / "starts"
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "out"
    rank = (
        "import os, sys; from erniekit.distributed.launch import note_failure_before_first_step as note; "
        f"open({str(starts)!r}, 'a').write('x'); os.environ['PADDLE_TRAINER_ID'] = '1'; "
        f"note({str(bad)!r}, 'output_dir={bad}: not a directory'); sys.exit(1)"
    )
    monkeypatch.setattr(launch, "launch_command", lambda cfg, args: [sys.executable, "-c", rank])
    cfg = SimpleNamespace(nproc_per_node=2, nnodes=1, output_dir=str(out), max_restart=2)
    assert launch.relaunch(cfg, []) == 2
    assert starts.read_text() == "x"  # no restart
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: output_dir={bad}: not a directory"
    assert os.listdir(out / "launch_logs") == ["failed-before-first-step.rank-1"]


def test_without_a_parent_the_note_goes_to_the_output_dir(tmp_path, monkeypatch):
    """A cluster process of launch_clusters (no relaunch parent, no NOTES_ENV) notes into its own
    output_dir's launch_logs/, which launch_clusters reads."""
    monkeypatch.delenv(launch.NOTES_ENV, raising=False)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    launch.note_failure_before_first_step(str(tmp_path), "bad data")
    assert launch.failure_before_first_step(str(tmp_path), time.time() - 5) == ("0", "bad data")


def test_each_node_gets_a_log_folder_of_its_own():
    """Paddle names logs by the rank on the node: two nodes sharing an output_dir both wrote
    launch_logs/workerlog.0 into one file. One node keeps launch_logs/ itself."""
    one = SimpleNamespace(nproc_per_node=2, nnodes=1, output_dir="/o", master=None)
    two = SimpleNamespace(nproc_per_node=1, nnodes=2, output_dir="/o", master="10.0.0.1:8090")
    log_dir = lambda cmd: cmd[cmd.index("--log_dir") + 1]  # noqa: E731
    assert log_dir(launch.launch_command(one, [])) == "/o/launch_logs"
    cmd = launch.launch_command(two, ["x=1"])
    assert log_dir(cmd) == f"/o/launch_logs/{socket.gethostname()}-{os.getpid()}"
    assert cmd[cmd.index("--nnodes") + 1 :][:3] == ["2", "--master", "10.0.0.1:8090"]


def test_a_stop_on_a_node_without_rank_0_is_not_reported_as_finished(tmp_path, capsys):
    """SIGTERM to the `erniekit train` of a node whose output_dir rank 0 does not write: its ranks
    stop after the agreed step and exit 0. That node cannot tell a stop from the end of the run, so
    it exits 143 and says where to look, instead of 'the run finished' and 0."""
    started = time.time() - 1
    assert launch.launch_outcome(str(tmp_path), 0, started, signal.SIGTERM, nnodes=2) == 143
    assert "rank 0 runs on another node" in capsys.readouterr().out
    (tmp_path / "train_results.json").write_text('{"global_step": 4}')  # rank 0 here: it finished
    assert launch.launch_outcome(str(tmp_path), 0, started, signal.SIGTERM, nnodes=2) == 0
    assert "the run finished" in capsys.readouterr().out


def test_ranks_that_would_resume_from_different_checkpoints_are_refused(tmp_path):
    """Rank 0 alone writes checkpoints: with an output_dir on each node's own disk, a restart found
    checkpoint-N on rank 0's node and nothing on the others."""
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    assert resume_found("auto", str(tmp_path)) == 4
    assert resume_found("auto", str(tmp_path / "other")) == -1
    assert resume_found(str(ckpt), "unused") == 0 and resume_found(str(tmp_path / "none"), "unused") == -1
    assert resume_mismatch("auto", "/o", [4, 4, 4]) is None
    error = resume_mismatch("auto", "/o", [4, -1])
    assert error.startswith("resume_from_checkpoint=auto: the ranks see different checkpoints in output_dir=/o ")
    assert "(rank 0: checkpoint-4, rank 1: none)" in error and "\n" not in error
    assert "(rank 0: none, rank 1: found)" in resume_mismatch("/c", "/o", [-1, 0])


def test_a_stop_sent_to_another_node_is_reported_as_a_stop_on_every_node(tmp_path, monkeypatch, capsys):
    """Nodes with output_dirs of their own, the stop sent to rank 0's node: this node (not signalled,
    rank 0 elsewhere) saw its ranks return 0 and exited 0, 'the run finished'. Each rank that returns
    after the agreed stop leaves a note (train/start.py), so this node exits 143 too."""
    from erniekit.train.start import stopped_after_step

    out, started = tmp_path / "node-b", time.time() - 1
    cfg = SimpleNamespace(output_dir=str(out))
    monkeypatch.setenv(launch.NOTES_ENV, str(out / "launch_logs"))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    assert stopped_after_step(cfg, {"stop_signal": int(signal.SIGTERM), "stopped_at_step": 6}) == 0  # for paddle
    assert os.listdir(out / "launch_logs") == ["stopped-after-step.rank-1"]
    # a rank notes its stop before rank 0 has saved: a launch that then failed is no stop with a checkpoint
    assert launch.launch_outcome(str(out), 1, started, 0, nnodes=2) is None
    assert "checkpoint-6" not in capsys.readouterr().out
    assert launch.launch_outcome(str(out), 0, started, 0, nnodes=2) == 143
    assert (
        "erniekit: the job stopped on SIGTERM after step 6 with checkpoint-6 in rank 0's output_dir, on another node"
        in capsys.readouterr().out
    )
    assert launch.launch_outcome(str(out), 0, time.time() + 1, 0, nnodes=2) == 0  # a later launch: the note is old
    assert os.listdir(out / "launch_logs") == []


def test_a_single_process_run_stopped_after_a_step_exits_128_plus_the_signal(tmp_path, monkeypatch):
    from erniekit.train.start import stopped_after_step

    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    cfg = SimpleNamespace(output_dir=str(tmp_path))
    assert stopped_after_step(cfg, {"stop_signal": int(signal.SIGINT), "stopped_at_step": 3}) == 130
    assert os.listdir(tmp_path) == []  # no note outside a launched job
