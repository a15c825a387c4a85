"""`erniekit train ... nproc_per_node=N` relaunches itself through `python -m paddle.distributed.launch`.

The launcher starts N workers (each runs `erniekit train` with the same arguments), sets their
rank variables, shows rank 0's output and writes every rank's log under
`<output_dir>/launch_logs/` (workerlog.0, workerlog.1, ...; with nnodes > 1 in a folder per node,
worker_log_dir). Gloo on CPU, NCCL on GPU: Paddle picks from the build, nothing else changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_entry.py")


def in_launched_worker() -> bool:
    from erniekit.utils.dtensor import launched_world

    return "PADDLE_TRAINER_ID" in os.environ and launched_world() > 1


def launch_command(cfg, train_args: list[str]) -> list[str]:
    # restarts are ours (`relaunch`): paddle's own need elastic_level > 0 and did not restart on CPU;
    # ENTRY --launcher runs paddle.distributed.launch so that it dies with this process (PDEATHSIG)
    cmd = [
        sys.executable,
        ENTRY,
        LAUNCHER_FLAG,
        "--nproc_per_node",
        str(cfg.nproc_per_node),
        "--log_dir",
        worker_log_dir(cfg.output_dir, cfg.nnodes),
        "--max_restart",
        "0",
    ]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--master", cfg.master]
    return cmd + [ENTRY, "train", *train_args]


def notes_dir(output_dir: str) -> str:
    """Where `erniekit train` reads its ranks' notes (and, on one node, paddle writes their logs)."""
    return os.path.join(output_dir, "launch_logs")


def worker_log_dir(output_dir: str, nnodes: int) -> str:
    """Paddle's --log_dir. It names logs by the rank on the node (workerlog.0 on every node), so with
    nnodes > 1 each node's `erniekit train` gets a folder of its own: on a shared output_dir two
    nodes' workerlog.0 would otherwise be one file. Host name + this process's id: unique per node
    (two launchers on one host too) and the same across this process's restarts."""
    if nnodes <= 1:
        return notes_dir(output_dir)
    return os.path.join(notes_dir(output_dir), f"{socket.gethostname()}-{os.getpid()}")


LAUNCHER_FLAG = "--launcher"
JOB_ENV = "ERNIEKIT_JOB"  # in the environment of every process of one launched job: how it is found
NOTES_ENV = "ERNIEKIT_LAUNCH_NOTES"  # the folder (on the rank's own node) where `erniekit train` reads its ranks' notes
RELAYED_TWICE_S = 0.5  # the same signal again within this: one stop request delivered twice, not a second
STOP_GRACE_S = 600.0  # after a stop signal: time the ranks get to finish their step and checkpoint
REAP_GRACE_S = 30.0  # after the launcher is gone: SIGTERM to any process of the job left, then SIGKILL
LAUNCHER_STOP_S = 5.0  # a launcher without ranks that a SIGTERM has not ended by then is SIGKILLed


def job_pids(job: str) -> list[int]:
    """Every live process (this one excepted) whose environment has ERNIEKIT_JOB=job: the launcher,
    the ranks, PS servers. The ranks run in sessions of their own (paddle's launcher setsid()s
    them), so neither the process tree nor a process group finds them all; the environment does."""
    if not os.path.isdir("/proc"):
        return []
    needle, me, found = f"{JOB_ENV}={job}".encode(), os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(d))
        except OSError:  # gone meanwhile, or another user's process
            continue
    return found


def _runs_entry(pid: int) -> bool:
    """Whether process `pid` runs launch_entry.py (as a rank does: `python -u ENTRY train ...`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.fsencode(ENTRY) in f.read().split(b"\0")
    except OSError:  # gone meanwhile
        return False


def rank_pids(job: str, launcher_pid: int | None) -> list[int]:
    """The job's ranks on this node (and their children): its processes that run ENTRY, the launcher
    excepted. Not job_pids alone: paddle's launcher runs helpers in the job's environment too
    (nvidia-smi every 5 s for its GPU log, also while it waits at the rendezvous)."""
    return [p for p in job_pids(job) if p != launcher_pid and _runs_entry(p)]


def _signal(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def reap(job: str, grace: float = REAP_GRACE_S) -> list[int]:
    """Make sure no process of the job outlives `erniekit train`: SIGTERM to those left, SIGKILL
    to those still there after `grace` seconds. Returns the PIDs it had to signal."""
    left = job_pids(job)
    if not left:
        return []
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and job_pids(job):
        time.sleep(0.2)
    _signal(job_pids(job), signal.SIGKILL)
    return left


class Supervisor:
    """`erniekit train`'s side of a launched job: runs the launcher in a session of its own (a
    terminal's Ctrl-C reaches this process only) and passes a stop on.

    SIGTERM / SIGINT here are forwarded to every rank (not to paddle's launcher: it would SIGKILL
    them 30 s later); the ranks agree on a step, checkpoint and exit 0, the launcher follows. A
    second signal, or STOP_GRACE_S without an end, kills the job. Before this node's ranks start
    (the launcher waits at the rendezvous for the other nodes) a stop ends the launcher at once:
    there is nothing to save. Whatever happens, no process of the job is left when `run` returns.

    After `run`: `ranks_started` (this node's ranks appeared) and `gave_up_waiting` (the
    rendezvous did not complete within `rendezvous_s`)."""

    def __init__(self, job: str):
        self.job = job
        self.signum = 0
        self.signal_time = 0.0
        self.launcher = None
        self.forwarded: set[int] = set()
        self.ranks_started = False
        self.gave_up_waiting = False

    @contextlib.contextmanager
    def handling_signals(self):
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum == signum and time.monotonic() - self.signal_time < RELAYED_TWICE_S:
            return  # one Ctrl-C relayed twice (e.g. `timeout` sends it to its child and to its group)
        if self.signum:  # a second signal: no more waiting
            os.write(2, f"erniekit: {name} again: killing every process of the job\n".encode())
            _signal(job_pids(self.job), signal.SIGKILL)
            return
        self.signum, self.signal_time = signum, time.monotonic()
        os.write(
            2,
            f"erniekit: {name}: every rank stops after the same step and writes a checkpoint; a second "
            f"signal kills the job\n".encode(),
        )
        self._forward()

    def _forward(self) -> None:
        """The stop signal to each process of the job but the launcher, once (ranks that start
        after the signal get it when they appear)."""
        fresh = [p for p in job_pids(self.job) if p != getattr(self.launcher, "pid", None) and p not in self.forwarded]
        _signal(fresh, self.signum)
        self.forwarded.update(fresh)

    def run(self, cmd: list[str], env: dict, rendezvous_s: float | None = None) -> int:
        """Run the launcher to its end; returns its exit code. `rendezvous_s`: how long this node's
        ranks may take to appear (None: no limit) before the launcher is stopped (gave_up_waiting)."""
        self.launcher = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.ranks_started = self.gave_up_waiting = False
        began = time.monotonic()
        try:
            while True:
                try:
                    return self.launcher.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
                self.ranks_started = self.ranks_started or bool(rank_pids(self.job, self.launcher.pid))
                if self.signum and not self.ranks_started:
                    return self._stop_launcher(
                        f"{signal.Signals(self.signum).name} before any rank of this node started"
                    )
                if self.signum:
                    self._forward()
                    self._kill_after_grace()
                elif rendezvous_s is not None and not self.ranks_started and time.monotonic() - began > rendezvous_s:
                    self.gave_up_waiting = True
                    return self._stop_launcher(f"no rank of this node started within {rendezvous_s:.0f} s")
        finally:
            self._end_job()

    def _kill_after_grace(self) -> None:
        if time.monotonic() - self.signal_time > STOP_GRACE_S:
            print(f"erniekit: the job did not stop within {STOP_GRACE_S:.0f} s of the signal; killing it", flush=True)
            _signal(job_pids(self.job), signal.SIGKILL)

    def _stop_launcher(self, why: str) -> int:
        """The launcher ends now, as no rank of this node would stop or save anything: SIGTERM, then
        SIGKILL after LAUNCHER_STOP_S. Its exit code."""
        print(f"erniekit: {why}; stopping the launcher", flush=True)
        _signal([self.launcher.pid], signal.SIGTERM)
        try:
            return self.launcher.wait(timeout=LAUNCHER_STOP_S)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            return self.launcher.wait()

    def _end_job(self) -> None:
        """No process of the job outlives `run`."""
        if self.launcher.poll() is None:  # an error here: the launcher goes first, with its ranks
            _signal([self.launcher.pid], signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.launcher.wait(timeout=REAP_GRACE_S)
        left = reap(self.job)
        if left:
            print(
                f"erniekit: {len(left)} process(es) of the job were still running after the launcher "
                f"ended; stopped them (pids {', '.join(map(str, left))})",
                flush=True,
            )
        if self.launcher.poll() is None:
            self.launcher.kill()
            self.launcher.wait()


def stop_signal_of_run(output_dir: str, since: float) -> tuple[int, int | None]:
    """(stop signal, step) from the train_results.json rank 0 wrote after `since` (time.time()):
    a stop any rank received ends the job like one sent here. (0, None) when the run did not stop
    (or wrote no results)."""
    res = _results_since(output_dir, since)
    if res is None:
        return 0, None
    return int(res.get("stop_signal") or 0), res.get("stopped_at_step")


def _results_since(output_dir: str, since: float) -> dict | None:
    """The train_results.json rank 0 wrote into output_dir after `since` (time.time()); None when there
    is none that new (also when rank 0 runs on another node whose output_dir is not this one)."""
    path = os.path.join(output_dir, "train_results.json")
    try:
        if os.stat(path).st_mtime < since:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


_EARLY_STOP = "stopped-before-first-step.rank-"  # + rank: a rank's note in launch_logs/
_EARLY_FAILURE = "failed-before-first-step.rank-"  # + rank: the one-line error a rank stopped on while starting
_STOPPED = "stopped-after-step.rank-"  # + rank: "SIGNAL STEP", left by a rank that returned after an agreed stop


def _leave_note(output_dir: str, prefix: str, text: str) -> None:
    """This rank's note to `relaunch`, in the folder its `erniekit train` reads (NOTES_ENV, which that
    parent created on this node), else in output_dir's launch_logs/ (a cluster process of
    launch_clusters). Not output_dir first: the error being noted may be that output_dir."""
    logs = os.environ.get(NOTES_ENV) or notes_dir(output_dir)
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, prefix + os.environ.get("PADDLE_TRAINER_ID", "0")), "w", encoding="utf-8") as f:
        f.write(text)


def _take_notes(output_dir: str, prefix: str, since: float) -> list[tuple[str, str]]:
    """(rank, text) of each `prefix` note written after `since` (time.time()), lowest rank first.
    Older notes (an earlier launch's) are removed; this launch's stay, since on a shared output_dir
    the `erniekit train` parent of every node reads them (the first to read must not hide a rank's
    config error from the others, which would restart alone toward a master that has gone)."""
    logs = notes_dir(output_dir)
    try:
        names = [n for n in os.listdir(logs) if n.startswith(prefix)]
    except FileNotFoundError:
        return []
    found = []
    for name in sorted(names, key=lambda n: (len(n), n)):  # rank 2 before rank 10
        path = os.path.join(logs, name)
        try:
            if os.stat(path).st_mtime < since:
                os.remove(path)
                continue
            with open(path, encoding="utf-8") as f:
                found.append((name[len(prefix) :], f.read().strip()))
        except OSError:
            continue
    return found


def note_stop_before_first_step(output_dir: str, signum: int) -> None:
    """Left by a rank that a stop signal ended while it was starting (train/start.py): it exits
    128 + N, which paddle's launcher reports as a failure; the note tells `relaunch` it was a stop."""
    _leave_note(output_dir, _EARLY_STOP, str(int(signum)))


def stop_before_first_step(output_dir: str, since: float) -> int:
    """The stop signal of a rank that stopped while starting, noted after `since` (time.time());
    0 when none (_take_notes: an earlier launch's notes are removed, not read)."""
    for _, text in _take_notes(output_dir, _EARLY_STOP, since):
        try:
            return int(text or 0)
        except ValueError:
            continue
    return 0


def note_failure_before_first_step(output_dir: str, message: str) -> None:
    """Left by a rank that a configuration, data or checkpoint error ended before its first step
    (train/run.py): `relaunch` reports the error and does not restart the job."""
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    _leave_note(output_dir, _EARLY_FAILURE, line)


def failure_before_first_step(output_dir: str, since: float) -> tuple[str, str] | None:
    """(rank, its one-line error) of the lowest rank that noted a failure before its first step
    after `since` (time.time()); None when none did (_take_notes: earlier launches' notes are removed)."""
    found = _take_notes(output_dir, _EARLY_FAILURE, since)
    return found[0] if found else None


def note_stop_after_step(output_dir: str, signum: int, step: int | None) -> None:
    """Left by every rank that returns after the stop all ranks agreed on (train/start.py): it exits 0,
    as paddle's launcher needs, and rank 0 alone writes train_results.json, which a node without rank 0
    and with an output_dir of its own cannot see; the note tells that node's `relaunch` it was a stop."""
    _leave_note(output_dir, _STOPPED, f"{int(signum)} {step if step is not None else -1}")


def stop_after_step(output_dir: str, since: float) -> tuple[int, int | None]:
    """(stop signal, step) a rank of this node noted after `since` (time.time()) when it returned after
    an agreed stop; (0, None) when none did (_take_notes: earlier launches' notes are removed)."""
    for _, text in _take_notes(output_dir, _STOPPED, since):
        try:
            signum, step = (int(v) for v in text.split())
        except ValueError:
            continue
        return signum, (step if step >= 0 else None)
    return 0, None


def relaunch(cfg, train_args: list[str], user_threads: str | None = None) -> int:
    """Run the job's workers on this machine and return the exit code of `erniekit train`.

    Unless the user set OMP_NUM_THREADS, the cores are split between the workers (oversubscribed
    OpenMP threads spin against each other). A failed job (a worker killed or crashed: the
    launcher stops the others) is started again up to `max_restart` times with
    `resume_from_checkpoint=auto`, so it continues from the latest complete checkpoint.
    Checkpoints are unsharded, so a restart may also use another process count.
    A stop (SIGTERM / SIGINT here or to any rank) is not a failure: no restart, exit code
    128 + the signal (run_control.stopped_exit_code). Nor is a configuration, data or checkpoint
    error a rank met before its first step: its one line, exit code 2, no restart. With nnodes > 1
    a restart that the other nodes do not join within `restart_rendezvous_s` ends the job as failed.
    """
    env = _job_env(cfg, user_threads)
    job = env[JOB_ENV]
    logs = worker_log_dir(cfg.output_dir, cfg.nnodes)
    print(
        f"erniekit: launching {cfg.nproc_per_node} processes on this node"
        + (f" (one of {cfg.nnodes} nodes)" if cfg.nnodes > 1 else "")
        + " through "
        f"paddle.distributed.launch; logs of every rank in {logs}",
        flush=True,
    )
    args = list(train_args)
    sup, rc = Supervisor(job), 0
    with sup.handling_signals():
        for attempt in range(cfg.max_restart + 1):
            started = time.time()
            rc_now = sup.run(launch_command(cfg, args), env, restart_rendezvous_limit(cfg, attempt))
            if sup.gave_up_waiting and not sup.signum:
                return _restart_not_joined(cfg, attempt, rc)  # rc: the failed launch before this restart
            rc = rc_now
            code = launch_outcome(cfg.output_dir, rc, started, sup.signum, cfg.nnodes, sup.ranks_started)
            if code is not None:
                return code
            if attempt == cfg.max_restart:
                break
            print(
                f"erniekit: the job failed (launcher exit code {rc}, see {logs}); restart {attempt + 1} of "
                f"{cfg.max_restart} from the latest checkpoint in {cfg.output_dir}",
                flush=True,
            )
            args = [a for a in train_args if not a.startswith("resume_from_checkpoint=")] + [
                "resume_from_checkpoint=auto"
            ]
    print(
        f"erniekit: the job failed (launcher exit code {rc}); every rank's log is in {logs}; run it again with "
        f"resume_from_checkpoint=auto to continue from the latest checkpoint in {cfg.output_dir}",
        flush=True,
    )
    return rc


def restart_rendezvous_limit(cfg, attempt: int) -> float | None:
    """How long a launch may wait at the rendezvous before its ranks start: a restart of a job of
    several nodes is bounded (a node that gave up, e.g. on a start-up error only its own disk holds,
    never joins); a first launch is not (the nodes are started by hand, in any order)."""
    return cfg.restart_rendezvous_s if attempt > 0 and cfg.nnodes > 1 else None


def _restart_not_joined(cfg, attempt: int, rc: int) -> int:
    """One line for a restart the other nodes did not join; the exit code of the failed launch before it."""
    print(
        f"erniekit: restart {attempt} of {cfg.max_restart}: the other nodes did not join at master={cfg.master} "
        f"within {cfg.restart_rendezvous_s:g} s (restart_rendezvous_s); a node that gave up does not restart (a rank's start-up error, "
        f"printed by that node's erniekit train with exit code 2, or a stop): check the other nodes' output, then "
        f"start every node again with resume_from_checkpoint=auto (exit code {rc})",
        flush=True,
    )
    return rc


def _job_env(cfg, user_threads: str | None) -> dict:
    """The launcher's (and so every rank's) environment: OpenMP threads, the job's id, and the notes
    folder, created here on this node so that a rank refusing its output_dir can still leave its note."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = user_threads or str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    env.setdefault("GLOG_minloglevel", "1")  # gloo's connection chatter is INFO
    env[JOB_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env[NOTES_ENV] = os.path.abspath(notes_dir(cfg.output_dir))
    os.makedirs(env[NOTES_ENV], exist_ok=True)
    return env


def launch_outcome(
    output_dir: str, rc: int, started: float, signum: int = 0, nnodes: int = 1, ranks_started: bool = True
) -> int | None:
    """What one launch that began at `started` (time.time()) and ended with launcher exit code rc
    means for the job: the exit code of `erniekit train` when it is over (finished, stopped, or a
    rank's configuration error before its first step), None when it failed and may be restarted.
    `signum`: a stop signal `erniekit train` received meanwhile (0: none); `nnodes`: the job's nodes;
    `ranks_started`: whether this node's ranks had started (Supervisor.ranks_started)."""
    from erniekit.utils.run_control import stopped_exit_code

    stopped, step = stop_signal_of_run(output_dir, started)
    noted, noted_step = stop_after_step(output_dir, started)  # read either way: the notes are this launch's
    noted = noted if rc == 0 else 0  # a rank notes its stop before rank 0 has saved: only a clean end proves it
    if stopped or noted:
        where = output_dir if stopped else "rank 0's output_dir" + (", on another node" if nnodes > 1 else "")
        stopped, step = (stopped, step) if stopped else (noted, noted_step)
        print(
            f"erniekit: the job stopped on {signal.Signals(stopped).name} after step {step} with "
            f"checkpoint-{step} in {where}; continue with resume_from_checkpoint=auto "
            f"(exit code {stopped_exit_code(stopped)})",
            flush=True,
        )
        return stopped_exit_code(stopped)
    failed = failure_before_first_step(output_dir, started) if rc else None
    early = stop_before_first_step(output_dir, started)  # read either way: the notes are this launch's
    if failed:  # before a stop note: paddle's launcher SIGTERMs the other ranks, which note a stop
        print(f"error: {failed[1]}", file=sys.stderr, flush=True)
        return 2
    if early:  # a rank (or every one) stopped while starting: a stop with nothing to resume from
        print(
            f"erniekit: the job stopped on {signal.Signals(early).name} before its first step; nothing was "
            f"saved; start it again the same way (exit code {stopped_exit_code(early)})",
            flush=True,
        )
        return stopped_exit_code(early)
    if signum and not ranks_started:  # the launcher was starting, or waiting at the rendezvous
        print(
            f"erniekit: the job stopped on {signal.Signals(signum).name} before any rank of this node started; "
            f"this launch saved nothing (exit code {stopped_exit_code(signum)})",
            flush=True,
        )
        return stopped_exit_code(signum)
    if signum:
        return _signalled_outcome(output_dir, rc, started, signum, nnodes)
    return 0 if rc == 0 else None


def _signalled_outcome(output_dir: str, rc: int, started: float, signum: int, nnodes: int) -> int:
    """The exit code of a launch this process passed a stop signal to, when no rank noted a stop."""
    from erniekit.utils.run_control import stopped_exit_code

    name = signal.Signals(signum).name
    if rc == 0 and nnodes > 1 and _results_since(output_dir, started) is None:  # rank 0 elsewhere, no note here
        print(
            f"erniekit: {name}: this node's ranks ended; rank 0 runs on another node, whose output_dir says "
            "whether the job stopped (with a checkpoint) or finished",
            flush=True,
        )
        return stopped_exit_code(signum)
    if rc == 0:  # the signal came after the last step: the run is complete
        print(f"erniekit: {name} came after the last step; the run finished", flush=True)
        return 0
    print(
        f"erniekit: the job ended on {name} before a checkpoint of the stop (launcher exit code {rc}); every "
        f"rank's log is in {worker_log_dir(output_dir, nnodes)}; resume_from_checkpoint=auto continues from "
        f"the latest checkpoint in {output_dir}",
        flush=True,
    )
    return stopped_exit_code(signum)
