"""`erniekit train ... nproc_per_node=N` relaunches itself through `python -m paddle.distributed.launch`.

The launcher starts N workers (each runs `erniekit train` with the same arguments), sets their
rank variables, shows rank 0's output and writes every rank's log under
`<output_dir>/launch_logs/` (workerlog.0, workerlog.1, ...). Gloo on CPU, NCCL on GPU: Paddle
picks from the build, nothing else changes.
"""

from __future__ import annotations

import os
import subprocess
import sys

ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_entry.py")


def in_launched_worker() -> bool:
    from erniekit.utils.dtensor import launched_world

    return "PADDLE_TRAINER_ID" in os.environ and launched_world() > 1


def launch_command(cfg, train_args: list[str]) -> list[str]:
    # restarts are ours (`relaunch`): paddle's own need elastic_level > 0 and did not restart on CPU
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(cfg.nproc_per_node),
           "--log_dir", os.path.join(cfg.output_dir, "launch_logs"), "--max_restart", "0"]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--master", cfg.master]
    return cmd + [ENTRY, "train", *train_args]


def relaunch(cfg, train_args: list[str], user_threads: str | None = None) -> int:
    """Run the job's workers on this machine and return the launcher's exit code.

    Unless the user set OMP_NUM_THREADS, the cores are split between the workers (oversubscribed
    OpenMP threads spin against each other). A failed job (a worker killed or crashed: the
    launcher stops the others) is started again up to `max_restart` times with
    `resume_from_checkpoint=auto`, so it continues from the latest complete checkpoint.
    Checkpoints are unsharded, so a restart may also use another process count.
    """
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = user_threads or str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    env.setdefault("PYTHONWARNINGS", "ignore:No ccache found")  # the launcher imports paddle too
    env.setdefault("GLOG_minloglevel", "1")  # gloo's connection chatter is INFO
    os.makedirs(cfg.output_dir, exist_ok=True)
    logs = os.path.join(cfg.output_dir, "launch_logs")
    print(f"erniekit: launching {cfg.nproc_per_node} processes x {cfg.nnodes} node(s) through "
          f"paddle.distributed.launch; logs of every rank in {logs}", flush=True)
    args = list(train_args)
    for attempt in range(cfg.max_restart + 1):
        rc = subprocess.call(launch_command(cfg, args), env=env)
        if rc == 0 or attempt == cfg.max_restart:
            break
        print(f"erniekit: the job failed (launcher exit code {rc}, see {logs}); restart {attempt + 1} of "
              f"{cfg.max_restart} from the latest checkpoint in {cfg.output_dir}", flush=True)
        args = [a for a in train_args if not a.startswith("resume_from_checkpoint=")] + ["resume_from_checkpoint=auto"]
    if rc:
        print(f"erniekit: the job failed (launcher exit code {rc}); every rank's log is in {logs}; run it again with "
              f"resume_from_checkpoint=auto to continue from the latest checkpoint in {cfg.output_dir}", flush=True)
    return rc
