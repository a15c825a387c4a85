"""The launchers with tiny `python -c` children in place of the real processes: the one-machine
cross-cluster launcher (erniekit/distributed/cross_cluster/launch.py) and `erniekit train`'s side of
a launched job (erniekit/distributed/launch.py)."""

import os
import sys
import time
from types import SimpleNamespace

from erniekit.distributed import launch
from erniekit.distributed.cross_cluster.launch import TAIL_LINES, _Cluster, exit_code, run_clusters

PY = sys.executable


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # killed, not yet reaped by init
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_cluster_that_fails_at_start_stops_the_others_at_once(capsys, tmp_path):
    """One cluster exits 2 at start-up (a config error) while the others wait for their links: they
    are stopped after the grace period (SIGTERM, then SIGKILL to their whole process group, a child
    that ignores SIGTERM included) instead of waiting out the connect timeout, and the result names
    the cluster that failed first, its exit code and its last line. A cluster waited out would say
    "slept out" after its 60 s. The failing cluster waits until the deaf one has started its child
    (a file), so a slow start on a loaded host cannot kill it before it says which child."""
    flag = tmp_path / "child-started"
    waits = [PY, "-c", "import time; time.sleep(60); print('slept out')"]
    fails = [
        PY,
        "-c",
        f"import os, sys, time; [time.sleep(0.05) for _ in range(1200) if not os.path.exists({str(flag)!r})]; "
        "print('error: bad config'); sys.exit(2)",
    ]
    deaf = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"print('child', p.pid, flush=True); open({str(flag)!r}, 'w').close(); time.sleep(60); print('slept out')"
    )
    rc, stopped, why = run_clusters([waits, fails, [PY, "-c", deaf]], dict(os.environ), grace_s=0.3, kill_after_s=0.5)
    assert (rc, stopped) == (2, False)
    assert why == "cluster 1 failed first (exit code 2: error: bad config)"
    out = capsys.readouterr().out
    assert "[cluster 1] error: bad config" in out and "slept out" not in out  # stopped, not waited for
    grandchild = int(out.split("[cluster 2] child ")[1].split()[0])
    assert _gone(grandchild)  # the group went, not only the cluster's main process


def test_only_the_last_lines_of_a_cluster_are_kept(capsys):
    """A long run's output is printed as it comes; memory holds only the last TAIL_LINES lines."""
    c = _Cluster(0, [PY, "-c", "for i in range(3000): print(i)"], dict(os.environ))
    c.proc.wait()
    c.reader.join(timeout=10)
    assert len(c.tail) == TAIL_LINES and c.last_line() == "2999"
    assert "[cluster 0] 2999" in capsys.readouterr().out
    assert (exit_code(-9), exit_code(-15), exit_code(3)) == (137, 143, 3)


def test_a_rank_stopped_while_starting_makes_the_job_stopped_not_failed(tmp_path, monkeypatch, capsys):
    """A rank that a SIGTERM ended while it started (train/start.py) exits 143 with a note; paddle's
    launcher reports any rank's non-zero code as a failure (here 1): `erniekit train` must still
    exit 143 with one line, without a restart (max_restart=2)."""
    out, starts = tmp_path / "o", tmp_path / "starts"
    rank = (
        "import os, sys; from erniekit.distributed.launch import note_stop_before_first_step as note; "
        f"open({str(starts)!r}, 'a').write('x'); os.environ['PADDLE_TRAINER_ID'] = '1'; "
        f"note({str(out)!r}, 15); sys.exit(1)"
    )
    monkeypatch.setattr(launch, "launch_command", lambda cfg, args: [sys.executable, "-c", rank])
    cfg = SimpleNamespace(nproc_per_node=2, nnodes=1, output_dir=str(out), max_restart=2)
    assert launch.relaunch(cfg, []) == 143
    assert starts.read_text() == "x"  # no restart
    assert "erniekit: the job stopped on SIGTERM before its first step; nothing was saved" in capsys.readouterr().out
    assert [n for n in os.listdir(out / "launch_logs") if n.startswith("stopped")]  # kept for other nodes' parents
    stale = time.time() + 1  # a later launch: the note is an earlier launch's, removed and not read
    assert launch.stop_before_first_step(str(out), stale) == 0
    assert not [n for n in os.listdir(out / "launch_logs") if n.startswith("stopped")]


def test_a_clusters_configuration_error_before_its_first_step_is_not_restarted(tmp_path, monkeypatch, capsys):
    """A cross-cluster job on one machine (launch_clusters) restarted every cluster max_restart times
    on a cluster's config or data error, which each restart met again."""
    from erniekit.distributed.cross_cluster import launch as cluster_launch

    out = tmp_path / "o"
    runs, noting = [], [True]

    def one_run(cfg, args, sizes, peers, env):
        assert env[cluster_launch.PARENT_ENV] == "1"  # the clusters know their notes are read
        runs.append(args)
        if noting[0]:  # cluster 1's process refuses its data before its first step (train/run.py)
            time.sleep(0.05)  # as a real process's note comes after its start (mtime ticks may lag time.time())
            monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
            launch.note_failure_before_first_step(cluster_launch.cluster_output_dir(str(out), 1), "train.jsonl:7: bad")
        return 2, False, "cluster 1 failed first (exit code 2: error: train.jsonl:7: bad)"

    monkeypatch.setattr(cluster_launch, "_run_once", one_run)
    cfg = SimpleNamespace(
        cross_cluster_sizes=[1, 1],
        cross_cluster_key_file=None,
        cross_cluster_link_mbit=0,
        cross_cluster_link_latency_ms=0,
        max_restart=2,
        output_dir=str(out),
    )
    assert cluster_launch.launch_clusters(cfg, []) == 2
    assert len(runs) == 1  # not restarted
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: cluster 1: train.jsonl:7: bad"
    runs.clear()  # a failure without such a note (a lost cluster) is restarted as before
    noting[0] = False
    time.sleep(0.01)  # the earlier launch's note is older than this one's start
    assert cluster_launch.launch_clusters(cfg, []) == 2 and len(runs) == 3
