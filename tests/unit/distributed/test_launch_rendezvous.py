"""`erniekit train` while its launcher waits at the rendezvous (erniekit/distributed/launch.py), with
`python -c` children in place of paddle's launcher and the ranks: a restart that the other nodes never
join ends within a bound, and a stop before any rank started ends the launcher at once."""

import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from erniekit.distributed import launch

PY = sys.executable
# a launcher at the rendezvous: deaf to SIGTERM, no rank, a helper in the job's environment (paddle's
# runs nvidia-smi every 5 s for its GPU log) that must not be taken for a rank
WAITING = (  # deaf first: a slow start must not leave a window where SIGTERM ends it (-15, not -9)
    "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
)


def _env(job: str) -> dict:
    return dict(os.environ, **{launch.JOB_ENV: job})


def _signal_me_after(seconds: float, sig: int = signal.SIGTERM) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


def test_a_restart_the_other_nodes_never_join_ends_with_one_line(tmp_path, monkeypatch, capsys):
    """Nodes with output_dirs of their own: a start-up error on node A ends A (exit 2, its note is on
    A's disk only); node B's launch fails and B restarts, and its launcher waited at the rendezvous
    for A forever. The restart's wait is bounded: one line that says what to check, B's failed
    launch's exit code, and no further restart. The deaf launcher is killed (-9), not waited out
    (it would end on its own after 30 s, exit code 0)."""
    launches, codes = [], []

    def command(cfg, args):
        launches.append(args)
        return [PY, "-c", "import sys; sys.exit(1)" if len(launches) == 1 else WAITING]

    real_run = launch.Supervisor.run

    def run(sup, *a, **kw):
        codes.append(real_run(sup, *a, **kw))
        return codes[-1]

    monkeypatch.setattr(launch, "launch_command", command)
    monkeypatch.setattr(launch.Supervisor, "run", run)
    monkeypatch.setattr(launch, "LAUNCHER_STOP_S", 0.5)
    cfg = SimpleNamespace(
        nproc_per_node=1,
        nnodes=2,
        master="10.0.0.1:8090",
        output_dir=str(tmp_path),
        max_restart=3,
        restart_rendezvous_s=1.0,
    )
    assert launch.relaunch(cfg, ["x=1"]) == 1
    assert codes == [1, -signal.SIGKILL]  # the deaf launcher was killed, not waited for
    assert len(launches) == 2 and launches[1][-1] == "resume_from_checkpoint=auto"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(
        "erniekit: restart 1 of 3: the other nodes did not join at master=10.0.0.1:8090 within 1 s (restart_rendezvous_s)"
    )
    assert "check the other nodes' output" in last and last.endswith("(exit code 1)")


def test_only_a_restart_of_several_nodes_has_a_bounded_rendezvous():
    """The first launch waits as long as the nodes take to be started by hand; one node has no rendezvous;
    the bound is the config's restart_rendezvous_s (default 300 s)."""
    from erniekit.config import load_config

    assert load_config(None, ["nnodes=2", "master=10.0.0.1:8090"]).restart_rendezvous_s == 300.0
    two = SimpleNamespace(nnodes=2, restart_rendezvous_s=42.0)
    assert launch.restart_rendezvous_limit(two, 0) is None
    assert launch.restart_rendezvous_limit(two, 1) == 42.0
    assert launch.restart_rendezvous_limit(SimpleNamespace(nnodes=1, restart_rendezvous_s=42.0), 1) is None


def test_restart_rendezvous_s_must_be_a_positive_time():
    from erniekit.config import load_config, validate
    from erniekit.errors import ConfigError

    base = ["nnodes=2", "master=10.0.0.1:8090", "nproc_per_node=1"]
    assert validate(load_config(None, [*base, "restart_rendezvous_s=30"])).restart_rendezvous_s == 30.0
    for bad in ("0", "-5", "1e9"):
        with pytest.raises(ConfigError, match=r"restart_rendezvous_s=.* in \(0, 1e\+08\] seconds"):
            validate(load_config(None, [*base, f"restart_rendezvous_s={bad}"]))


def test_a_stop_before_any_rank_started_ends_the_launcher_at_once(tmp_path, monkeypatch, capsys):
    """SIGTERM while the launcher waits at the rendezvous: there is no rank to pass it to, and the
    Supervisor waited STOP_GRACE_S (600 s) for ranks that never came. It ends the launcher (SIGKILL
    when SIGTERM does not do it) and the launch is reported as a stop that saved nothing. A launcher
    waited out would end on its own after 30 s with exit code 0, not -9."""
    monkeypatch.setattr(launch, "LAUNCHER_STOP_S", 0.5)
    sup = launch.Supervisor("test-rendezvous-stop")
    with sup.handling_signals():
        timer = _signal_me_after(1.0)
        rc = sup.run([PY, "-c", WAITING], _env(sup.job))
        timer.join()
    assert rc == -signal.SIGKILL
    assert not sup.ranks_started and not sup.gave_up_waiting
    assert launch.launch_outcome(str(tmp_path), rc, time.time() - 20, sup.signum, 2, sup.ranks_started) == 143
    out = capsys.readouterr().out
    assert "erniekit: SIGTERM before any rank of this node started; stopping the launcher" in out
    assert "the job stopped on SIGTERM before any rank of this node started; this launch saved nothing" in out


def test_a_stop_with_ranks_running_goes_to_the_ranks_and_the_launcher_stays(tmp_path):
    """Once a rank runs (a process of the job running launch_entry.py), the stop is passed to it and
    the launcher is left to end with it; nor does the rendezvous bound stop a launch whose ranks run."""
    marker = tmp_path / "rank-got"
    rank = (
        "import signal, sys, time; "
        f"signal.signal(signal.SIGTERM, lambda s, f: (open({str(marker)!r}, 'w').write(str(s)), sys.exit(0))); "
        "time.sleep(30)"
    )
    launcher = (
        "import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"sys.exit(subprocess.call([sys.executable, '-c', {rank!r}, {launch.ENTRY!r}, 'train']))"
    )
    sup = launch.Supervisor("test-rendezvous-ranks")
    with sup.handling_signals():
        timer = _signal_me_after(2.5)
        rc = sup.run([PY, "-c", launcher], _env(sup.job), rendezvous_s=1.0)
        timer.join()
    assert rc == 0 and marker.read_text() == str(int(signal.SIGTERM))
    assert sup.ranks_started and not sup.gave_up_waiting


def test_one_stop_request_relayed_twice_is_not_a_second_signal(monkeypatch, capfd):
    """`timeout` (and some schedulers) deliver one SIGINT to erniekit train and again to its process
    group: read as a second signal, it killed the job without its checkpoint."""
    sup = launch.Supervisor("test-relayed-twice")
    killed = []
    monkeypatch.setattr(launch, "_signal", lambda pids, sig: killed.append(sig))
    monkeypatch.setattr(launch, "job_pids", lambda job: [])
    clock = [100.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    sup._on_signal(signal.SIGINT, None)
    clock[0] += 0.1
    sup._on_signal(signal.SIGINT, None)  # the same press, relayed
    assert signal.SIGKILL not in killed and "again" not in capfd.readouterr().err
    clock[0] += 2.0
    sup._on_signal(signal.SIGINT, None)  # a second press
    assert signal.SIGKILL in killed
