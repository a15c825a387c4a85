"""Joining the job: the one place that reads the parallel degrees and the launcher's environment.

`join(cfg)` is called once per process at the start of a run; what it returns says which
topology this process is part of, and the training side picks its step runner from it
(erniekit/train/runners/)."""

from __future__ import annotations

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

    return Topology(world, collective=runtime.init(layout_from_config(cfg.parallelism, world)))


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
