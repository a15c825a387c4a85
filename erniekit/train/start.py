"""`erniekit train` after its arguments are parsed: plan the layout, start the processes, run,
turn the result into an exit code."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from erniekit.train.run import StoppedBeforeFirstStep


def start_training(cfg, path: str | None, overrides: list[str], user_threads: str | None) -> int:
    """A validated config -> the exit code: 0 finished, 128 + N stopped by signal N with a
    checkpoint (docs/reliability.md); a multi-process config relaunches itself under
    paddle.distributed.launch."""
    from erniekit.distributed.launch import in_launched_worker, relaunch

    if not in_launched_worker():  # the parent decides, before any process starts
        refuse_earlier_run(cfg)
    args = ([path] if path else []) + list(overrides)
    if cfg.parallel == "auto" and not in_launched_worker():
        from erniekit.distributed.planner import auto_plan

        best = auto_plan(cfg)
        print(
            f"erniekit: parallel: auto chose {best.plan.describe()} (predicted {best.step_s:.3f} s/step, "
            f"{best.memory / 1e9:.2f} GB per device; erniekit plan shows the ranking)",
            flush=True,
        )
    if cfg.distributed_mode == "ps" and cfg.ps_placement == "auto" and not in_launched_worker():
        cfg, args = apply_ps_placement(cfg, path, overrides)
    from erniekit.distributed.collective.layout import world_size

    if world_size(cfg.parallelism) > 1 and not in_launched_worker():  # what the ranks check on their model
        from erniekit.train.model_checks import check_model_before_launch

        check_model_before_launch(cfg)
    if cfg.cross_cluster_sizes and cfg.cross_cluster_id < 0 and not in_launched_worker():
        from erniekit.distributed.cross_cluster.launch import launch_clusters

        return launch_clusters(cfg, args, user_threads)  # each cluster a job of its own (docs/cross_cluster.md)
    if world_size(cfg.parallelism) > 1 and not in_launched_worker():
        return relaunch(cfg, args, user_threads)
    from erniekit.train.run import StoppedBeforeFirstStep, run_train

    try:
        result = run_train(cfg)
    except StoppedBeforeFirstStep as e:
        return stopped_at_start(cfg, e)
    if isinstance(result, dict) and result.get("stop_signal"):
        return stopped_after_step(cfg, result)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def stopped_after_step(cfg, result: dict) -> int:
    """A run that stopped after a step, with a checkpoint: 128 + N (143 SIGTERM / 130 SIGINT), stopped,
    not finished. A launched rank exits 0 instead (paddle.distributed.launch reads any other code as a
    failure and kills the other ranks) and leaves a note, so that its node's `erniekit train` reports
    the stop even where rank 0's train_results.json is on another node's disk (distributed/launch.py
    stop_after_step)."""
    from erniekit.distributed.launch import in_launched_worker, note_stop_after_step
    from erniekit.utils.run_control import stopped_exit_code

    if in_launched_worker():
        note_stop_after_step(cfg.output_dir, result["stop_signal"], result.get("stopped_at_step"))
        return 0
    return stopped_exit_code(result["stop_signal"])


def stopped_at_start(cfg, stop: StoppedBeforeFirstStep) -> int:
    """A stop while the run was starting: one line and 128 + N, as a stop after a step. A launched
    rank exits with it too (paddle's launcher then stops the other ranks at once) and leaves a note
    the parent reads (distributed/launch.py stop_before_first_step), so the job is reported
    stopped, not failed and restarted."""
    from erniekit.distributed.launch import in_launched_worker, note_stop_before_first_step
    from erniekit.utils.run_control import stopped_exit_code

    code = stopped_exit_code(stop.signum)
    if in_launched_worker():
        note_stop_before_first_step(cfg.output_dir, stop.signum)
        rank = os.environ.get("PADDLE_TRAINER_ID", "?")
        print(f"erniekit: rank {rank} {stop}", flush=True)
        return code
    print(f"erniekit: {stop}; start it again the same way (exit code {code})", flush=True)
    return code


def refuse_earlier_run(cfg) -> None:
    """A fresh run (no resume_from_checkpoint) into an output_dir holding another run's checkpoints
    would rotate its own away beside them, and `auto` would later resume the wrong one."""
    from erniekit.errors import ConfigError
    from erniekit.utils.checkpoint_dirs import list_checkpoints

    earlier = list_checkpoints(cfg.output_dir) if cfg.do_train and cfg.resume_from_checkpoint is None else []
    if earlier:
        names = ", ".join(os.path.basename(p) for _, p in earlier[-3:])
        raise ConfigError(
            f"output_dir={cfg.output_dir} holds an earlier run's checkpoints ({names}); continue that run with "
            "resume_from_checkpoint=auto, or start this one in a new output_dir (or delete them)"
        )


def apply_ps_placement(cfg, path: str | None, overrides: list[str]):
    """ps_placement: auto: the scheduler's stages become overrides every launched process gets
    (and the restart after a failure), and the plan is written to output_dir/ps_placement.json."""
    from erniekit.config import load_config, validate
    from erniekit.distributed.ps.plan import placement_for_config

    auto = placement_for_config(cfg)
    print(f"erniekit: ps_placement auto on {cfg.cluster}: {auto.describe()}", flush=True)
    args = ([path] if path else []) + list(overrides) + auto.overrides()
    cfg = validate(load_config(path, list(overrides) + auto.overrides()))
    os.makedirs(cfg.output_dir, exist_ok=True)
    rows = [r.as_dict() for r in auto.rows]
    with open(os.path.join(cfg.output_dir, "ps_placement.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "cluster": cfg.cluster,
                "target_tokens_per_s": auto.target,
                "stage_layers": auto.stage_layers,
                "stage_types": auto.stage_types,
                "stage_devices": auto.stage_devices,
                "workers_per_stage": auto.replicas,
                "processes": auto.processes,
                "predicted_tokens_per_s": auto.evaluation.throughput,
                "cost_per_batch": auto.evaluation.cost_per_batch,
                "candidates": rows,
            },
            f,
            indent=1,
        )
    return cfg, args
