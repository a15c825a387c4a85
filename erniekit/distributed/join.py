"""Joining the job: the one place that reads the parallel degrees and the launcher's environment.

`join(cfg)` is called once per process at the start of a run; what it returns says which
topology this process is part of, and the training side picks its step runner from it
(erniekit/train/runners/)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from erniekit.utils.dtensor import launched_world


@dataclass
class Topology:
    world: int = 1  # processes in the job
    collective: Any = (
        None  # erniekit/distributed/collective/runtime.py ParallelContext: mesh, placements, pipeline segments
    )
    ps: Any = None  # erniekit/distributed/ps/topology.py PSTopology: this process's PS role

    @property
    def kind(self) -> str:
        return "ps" if self.ps is not None else ("collective" if self.collective is not None else "single")


def join(cfg) -> Topology:
    """In a process started by paddle.distributed.launch: join the process group and return its
    topology (a collective mesh, or a parameter-server role); a single process otherwise."""
    world = launched_world()
    if world == 1:
        return Topology()
    if cfg.distributed_mode == "ps":
        return Topology(world, ps=_join_ps(cfg, world))
    from erniekit.distributed.collective import runtime
    from erniekit.distributed.collective.layout import layout_from_config

    topology = Topology(world, collective=runtime.init(layout_from_config(cfg.parallelism, world)))
    agree_on_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    return topology


def resume_found(value: str | None, output_dir: str) -> int:
    """What this rank would resume from: the step of the newest complete checkpoint (`auto`), 0 for
    an explicit directory this rank sees, -1 for none (a fresh start, or a directory it cannot see)."""
    from erniekit.utils.checkpoint_dirs import list_checkpoints

    if value == "auto":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1][0] if ckpts else -1
    return 0 if os.path.isdir(value or "") else -1


def resume_mismatch(value: str, output_dir: str, found: list[int]) -> str | None:
    """The one-line error when the ranks' `found` (resume_found, by rank) differ, else None. Rank 0
    alone writes checkpoints, so on nodes with output_dirs of their own only its node sees them."""
    if len(set(found)) <= 1:
        return None
    shown = ", ".join(
        f"rank {r}: {'none' if f < 0 else (f'checkpoint-{f}' if value == 'auto' else 'found')}"
        for r, f in enumerate(found)
    )
    return (
        f"resume_from_checkpoint={value}: the ranks see different checkpoints in output_dir={output_dir} ({shown}); "
        "every rank reads the checkpoint itself, so each node needs the same files: use an output_dir on a "
        "filesystem every node shares, or copy rank 0's checkpoint to the same path on every node"
    )


def agree_on_resume(value: str | None, output_dir: str) -> None:
    """Every rank resumes from the same checkpoint or none does: a rank that started fresh beside ranks
    that resumed would train a different model (or hang in a collective). One small all-gather."""
    if not value:
        return
    import paddle
    import paddle.distributed as dist

    from erniekit.errors import CheckpointError

    gathered: list = []
    dist.all_gather(gathered, paddle.to_tensor([resume_found(value, output_dir)], dtype="int64"))
    error = resume_mismatch(value, output_dir, [int(t.item()) for t in gathered])
    if error:
        raise CheckpointError(error)


def _join_ps(cfg, world: int):
    import paddle.distributed as dist

    from erniekit.distributed.collective.pipeline import new_group
    from erniekit.distributed.ps.topology import PSTopology, make_links

    dist.init_parallel_env()
    workers = world - cfg.ps_servers
    # the workers' group (their gradient sums): group creation is collective, servers join it too
    group = new_group(list(range(workers))) if workers > 1 else None
    links = make_links(workers, cfg.ps_servers)
    return PSTopology(workers=workers, servers=cfg.ps_servers, rank=dist.get_rank(), worker_group=group, links=links)
