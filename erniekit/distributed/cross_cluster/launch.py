"""`erniekit train ... cross_cluster_sizes=[2, 2]`: every cluster of the list on this machine, each its
own unchanged erniekit job (own launcher, rendezvous and process groups), joined only by the
cross-cluster link between ranks of the same number (erniekit/distributed/cross_cluster/link.py).

This is how the scheme is tried on one machine (with `cross_cluster_link_mbit` /
`cross_cluster_link_latency_ms` emulating the slow link); on two real sites each site runs
`erniekit train` itself with `cross_cluster_id` and `cross_cluster_peers` (docs/cross_cluster.md).
Cluster 0 writes `output_dir`, cluster i `output_dir/cluster-i`. A cluster that fails takes the
others down through their links; with `max_restart` all of them start again from the newest
checkpoint every cluster holds.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from erniekit.errors import ConfigError
from erniekit.utils.run_control import stopped_exit_code

KEY_ENV = "ERNIEKIT_CROSS_CLUSTER_KEY"
PARENT_ENV = "ERNIEKIT_CLUSTERS_PARENT"  # "1" in the clusters launch_clusters starts: someone reads their notes
_FORWARDED = ("OMP_NUM_THREADS",)


def noted_for_launch_clusters(cross_cluster_id: int) -> bool:
    """Whether this process is a cluster that launch_clusters started, which reads the start-up
    error it notes (train/run.py). A cluster started by hand on its own site prints its error to
    its own user; a note there would be left unread."""
    return cross_cluster_id >= 0 and os.environ.get(PARENT_ENV) == "1"


def cluster_output_dir(output_dir: str, cluster: int) -> str:
    return output_dir if cluster == 0 else os.path.join(output_dir, f"cluster-{cluster}")


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A base port p with p .. p+n-1 all free on host right now."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise ConfigError(f"cross_cluster_sizes: found no {n} consecutive free ports on {host}; free some ports and retry")


def cluster_args(train_args: list[str], cluster: int, size: int, peers: list[str], output_dir: str) -> list[str]:
    """The arguments of cluster `cluster`'s own `erniekit train` (later keys win over earlier ones)."""
    drop = ("cross_cluster_id=", "cross_cluster_peers=", "nproc_per_node=", "output_dir=")
    kept = [a for a in train_args if not a.startswith(drop)]
    return [
        *kept,
        f"cross_cluster_id={cluster}",
        f"cross_cluster_peers=[{','.join(peers)}]",
        f"nproc_per_node={size}",
        f"output_dir={cluster_output_dir(output_dir, cluster)}",
    ]


FAIL_GRACE_S = 5.0  # after a cluster fails: time the others get to end on their own (mid-run their links fail at once)
KILL_GRACE_S = 10.0  # after SIGTERM to a cluster's process group: time it gets before SIGKILL
TAIL_LINES = 20  # lines of each cluster's output kept (for the failure line); the rest is only printed


class _Cluster:
    """One cluster's `erniekit train` in a process group (and session) of its own: a terminal's Ctrl-C
    reaches the launcher only, which forwards it once, and a failed run's clusters are stopped as
    whole groups. launch_entry.py makes it die with the launcher (PR_SET_PDEATHSIG)."""

    def __init__(self, index: int, cmd: list[str], env: dict):
        self.index = index
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)  # bounded on a long run
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        """Every line of the cluster's output, prefixed with its index (its tqdm bar included)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line)
            sys.stdout.write(f"[cluster {self.index}] {line}")
            sys.stdout.flush()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def last_line(self) -> str:
        lines = [s.strip() for s in self.tail if s.strip()]
        return lines[-1][:300] if lines else "no output"


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N (-N) is 128 + N."""
    return stopped_exit_code(-returncode) if returncode < 0 else returncode


def launch_clusters(cfg, train_args: list[str], user_threads: str | None = None) -> int:
    """Run every cluster of cfg.cross_cluster_sizes on this machine to its end; the exit code of
    `erniekit train` (the first failing cluster's, 0 when all finished)."""
    sizes = list(cfg.cross_cluster_sizes)
    total = sum(sizes)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = user_threads or str(max(1, (os.cpu_count() or 1) // total))
    env[PARENT_ENV] = "1"
    if not cfg.cross_cluster_key_file and not env.get(KEY_ENV):
        env[KEY_ENV] = secrets.token_hex(32)  # this run's own key, passed to the clusters only
    peers = [f"127.0.0.1:{free_port_block(n)}" for n in sizes]
    print(
        f"erniekit: {len(sizes)} clusters of {', '.join(map(str, sizes))} processes on this machine, linked at "
        f"{', '.join(peers)}" + _link_note(cfg),
        flush=True,
    )
    args = list(train_args)
    rc = 0
    for attempt in range(cfg.max_restart + 1):
        started = time.time()
        rc, stopped, why = _run_once(cfg, args, sizes, peers, env)
        if rc == 0 or stopped:
            break
        failed = _failure_before_first_step(cfg.output_dir, len(sizes), started)
        if failed:  # a cluster's configuration or data error: a restart would meet it again
            print(f"error: {failed}", file=sys.stderr, flush=True)
            return 2
        why = why or f"a cluster failed (exit code {rc})"
        if attempt == cfg.max_restart:
            print(
                f"erniekit: {why}; the other clusters were stopped; fix the cause and run again "
                "(resume_from_checkpoint=auto continues from the newest checkpoint every cluster holds)",
                flush=True,
            )
            break
        print(
            f"erniekit: {why}; restart {attempt + 1} of {cfg.max_restart}: every cluster "
            "resumes from the newest checkpoint all of them hold",
            flush=True,
        )
        args = [a for a in train_args if not a.startswith("resume_from_checkpoint=")] + ["resume_from_checkpoint=auto"]
        peers = [f"127.0.0.1:{free_port_block(n)}" for n in sizes]  # the old ports may linger in TIME_WAIT
    return rc


def _failure_before_first_step(output_dir: str, clusters: int, since: float) -> str | None:
    """The one-line error a cluster's process noted when its configuration, data or checkpoint failed
    before its first step (train/run.py), as `cluster N: ...`; None when none did."""
    from erniekit.distributed.launch import failure_before_first_step

    for i in range(clusters):
        found = failure_before_first_step(cluster_output_dir(output_dir, i), since)
        if found:
            return f"cluster {i}: {found[1]}"
    return None


def _link_note(cfg) -> str:
    if cfg.cross_cluster_link_mbit <= 0 and cfg.cross_cluster_link_latency_ms <= 0:
        return ""
    bw = f"{cfg.cross_cluster_link_mbit:g} Mbit/s" if cfg.cross_cluster_link_mbit > 0 else "unlimited bandwidth"
    return f" (emulated link: {bw}, {cfg.cross_cluster_link_latency_ms:g} ms)"


def _run_once(cfg, args: list[str], sizes: list[int], peers: list[str], env: dict) -> tuple[int, bool, str]:
    """(exit code, stopped by a signal, which cluster failed first) of one start of every cluster."""
    from erniekit.distributed.launch import ENTRY

    cmds = [
        [sys.executable, ENTRY, "train", *cluster_args(args, i, n, peers, cfg.output_dir)] for i, n in enumerate(sizes)
    ]
    return run_clusters(cmds, env)


def run_clusters(
    cmds: list[list[str]], env: dict, grace_s: float = FAIL_GRACE_S, kill_after_s: float = KILL_GRACE_S
) -> tuple[int, bool, str]:
    """Run one process group per command to its end: (exit code, stopped by a signal, "" or which
    cluster failed first). A cluster that fails (not on a stop) ends the run: the others get
    `grace_s` to end on their own (their links fail), then SIGTERM, then after `kill_after_s`
    SIGKILL to their groups; a cluster that dies at start-up would otherwise leave them waiting
    out cross_cluster_timeout_s for it."""
    clusters = [_Cluster(i, cmd, env) for i, cmd in enumerate(cmds)]
    got: list[int] = []

    def forward(signum, frame) -> None:
        got.append(signum)
        for c in clusters:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, forward)
    try:
        codes, first = _wait(clusters, got, grace_s, kill_after_s)
        for c in clusters:
            c.reader.join(timeout=5)
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for c in clusters:
            if c.proc.poll() is None:
                c.signal_group(signal.SIGKILL)
                c.proc.wait()
    if first is not None:
        c = clusters[first]
        return codes[first], bool(got), f"cluster {first} failed first (exit code {codes[first]}: {c.last_line()})"
    failed = [codes[i] for i in sorted(codes) if codes[i] != 0]
    return (failed[0] if failed else 0), bool(got), ""


def _wait(clusters: list[_Cluster], got: list[int], grace_s: float, kill_after_s: float) -> tuple[dict, int | None]:
    """Every cluster's exit code, and the index of the one that failed first (None: none failed
    outside a stop); stops the others once one has failed."""
    codes: dict[int, int] = {}
    first, term_at, kill_at = None, float("inf"), float("inf")
    while len(codes) < len(clusters):
        for c in clusters:
            if c.index not in codes and c.proc.poll() is not None:
                codes[c.index] = exit_code(c.proc.returncode)
                if codes[c.index] != 0 and first is None and not got:
                    first, term_at = c.index, time.monotonic() + grace_s
        now = time.monotonic()
        for when, sig in ((term_at, signal.SIGTERM), (kill_at, signal.SIGKILL)):
            if now >= when:
                for c in clusters:
                    if c.index not in codes:
                        c.signal_group(sig)
        if now >= term_at:
            term_at, kill_at = float("inf"), now + kill_after_s
        elif now >= kill_at:
            kill_at = float("inf")
        time.sleep(0.1)
    return codes, first
