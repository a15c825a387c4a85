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

KEY_ENV = "ERNIEKIT_CROSS_CLUSTER_KEY"
_FORWARDED = ("OMP_NUM_THREADS",)


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


class _Cluster:
    def __init__(self, index: int, cmd: list[str], env: dict):
        self.index = index
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        """Every line of the cluster's output, prefixed with its index (its tqdm bar included)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            sys.stdout.write(f"[cluster {self.index}] {line}")
            sys.stdout.flush()


def launch_clusters(cfg, train_args: list[str], user_threads: str | None = None) -> int:
    """Run every cluster of cfg.cross_cluster_sizes on this machine to its end; the exit code of
    `erniekit train` (the first failing cluster's, 0 when all finished)."""
    sizes = list(cfg.cross_cluster_sizes)
    total = sum(sizes)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = user_threads or str(max(1, (os.cpu_count() or 1) // total))
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
        rc, stopped = _run_once(cfg, args, sizes, peers, env)
        if rc == 0 or stopped or attempt == cfg.max_restart:
            break
        print(
            f"erniekit: a cluster failed (exit code {rc}); restart {attempt + 1} of {cfg.max_restart}: every cluster "
            "resumes from the newest checkpoint all of them hold",
            flush=True,
        )
        args = [a for a in train_args if not a.startswith("resume_from_checkpoint=")] + ["resume_from_checkpoint=auto"]
        peers = [f"127.0.0.1:{free_port_block(n)}" for n in sizes]  # the old ports may linger in TIME_WAIT
    return rc


def _link_note(cfg) -> str:
    if cfg.cross_cluster_link_mbit <= 0 and cfg.cross_cluster_link_latency_ms <= 0:
        return ""
    bw = f"{cfg.cross_cluster_link_mbit:g} Mbit/s" if cfg.cross_cluster_link_mbit > 0 else "unlimited bandwidth"
    return f" (emulated link: {bw}, {cfg.cross_cluster_link_latency_ms:g} ms)"


def _run_once(cfg, args: list[str], sizes: list[int], peers: list[str], env: dict) -> tuple[int, bool]:
    """(exit code, stopped by a signal) of one start of every cluster."""
    clusters = [
        _Cluster(i, [sys.executable, "-m", "erniekit", "train", *cluster_args(args, i, n, peers, cfg.output_dir)], env)
        for i, n in enumerate(sizes)
    ]
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
        codes: dict[int, int] = {}
        while len(codes) < len(clusters):
            for c in clusters:
                if c.index not in codes and c.proc.poll() is not None:
                    codes[c.index] = c.proc.returncode
            time.sleep(0.2)
        for c in clusters:
            c.reader.join(timeout=5)
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for c in clusters:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
    failed = [codes[i] for i in sorted(codes) if codes[i] != 0]
    return (failed[0] if failed else 0), bool(got)
