"""Who is who in a parameter-server job, which vocabulary rows each server holds, and the
point-to-point messages between the roles.

Ranks 0..W-1 are workers (rank 0 reports and writes checkpoints), ranks W..W+S-1 servers. The
PyPI CPU wheel has no fleet PS runtime and no paddle.distributed.rpc (../shared/PLATFORM.md), so
the roles talk with send/recv, each (worker, server) pair over a process group of its own: Paddle's
gloo send/recv tag every message with the group's running operation count (`next_tag`), so on
the job's one group a server, which talks to every worker, and a worker, which talks only to its
servers, soon disagree on the tag and wait forever (measured). Gloo's send also blocks until the
peer receives, so the order is fixed: a worker finishes its exchange with server 0 before server
1, and a server serves worker 0's request before worker 1's. No cycle of waits can form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.errors import ConfigError, ErniekitError

# opcodes a worker sends a server; every worker sends the same sequence (synchronous training)
PULL, HEAD, HEAD_BACK, PUSH, STEP, SAVE, SYNC, STOP = range(8)
OP_NAMES = ("pull", "head", "head_back", "push", "step", "save", "sync", "stop")


def row_ranges(vocab: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) vocabulary rows per server, sizes differing by at most one."""
    base, extra = divmod(vocab, servers)
    out, start = [], 0
    for s in range(servers):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class PSTopology:
    workers: int
    servers: int
    rank: int
    worker_group: Any = None  # the workers' process group (None with one worker)
    links: Any = None  # (worker, server index) -> the pair's process group
    pipe: Any = None  # the workers as pipeline stages (erniekit/distributed/pipeline.PipelineTopology), or None

    @property
    def world(self) -> int:
        return self.workers + self.servers

    @property
    def is_server(self) -> bool:
        return self.rank >= self.workers

    @property
    def worker_index(self) -> int:
        return self.rank

    @property
    def server_index(self) -> int:
        return self.rank - self.workers

    def server_rank(self, s: int) -> int:
        return self.workers + s

    def link(self, peer: int) -> Link:
        """This process's channel to worker / server index `peer` (the other role)."""
        if self.is_server:
            return Link(self.links[(peer, self.server_index)], peer, f"worker {peer}")
        return Link(self.links[(self.worker_index, peer)], self.server_rank(peer), f"parameter server {peer}")

    def owner(self, ids: np.ndarray, vocab: int) -> np.ndarray:
        """Server index holding each row id."""
        ends = np.array([b for _, b in row_ranges(vocab, self.servers)])
        return np.searchsorted(ends, ids, side="right")


def with_pipeline(topo: PSTopology, pp: int, num_layers: int, stage_layers: list[int] | None = None) -> PSTopology:
    """The workers as `pp` pipeline stages of workers/pp data ranks each (stage-major ranks, as in
    the collective pipeline); servers join the group creation, which is collective. pp=1: as is."""
    if pp <= 1:
        return topo
    import dataclasses

    from erniekit.distributed.collective.layout import Layout, check_stage_layers
    from erniekit.distributed.collective.pipeline import PipelineTopology

    check_stage_layers(stage_layers, num_layers)
    if pp > num_layers:
        raise ConfigError(
            f"pipeline_parallel_degree {pp} is more than the model's {num_layers} layers (num_hidden_layers); lower it"
        )
    pipe = PipelineTopology(Layout(pp=pp, dp=topo.workers // pp), topo.rank, num_layers, stage_layers)
    return dataclasses.replace(topo, pipe=pipe)


def make_links(workers: int, servers: int) -> dict[tuple[int, int], Any]:
    """A process group per (worker, server) pair. Collective: every rank calls it, in one order;
    a barrier after each group (gloo groups created back to back failed to connect with 4
    processes, erniekit/distributed/collective/pipeline.py)."""
    from erniekit.distributed.collective.pipeline import new_group

    return {(w, s): new_group([w, workers + s]) for w in range(workers) for s in range(servers)}


class PeerLost(ErniekitError):
    """The other end of a PS link stopped answering."""


class Link:
    """One (worker, server) pair's channel, seen from one end. A peer that died or hangs shows as
    gloo's timeout; it becomes one line naming the peer, its log and how to continue."""

    def __init__(self, group, peer: int, peer_name: str):
        self.group, self.peer, self.peer_name = group, peer, peer_name

    def _lost(self, e: RuntimeError) -> PeerLost:
        return PeerLost(
            f"lost {self.peer_name} (rank {self.peer}): no answer within gloo's timeout, its process "
            f"died or hangs (see launch_logs/workerlog.{self.peer} in the output_dir); the job stops: run "
            f"it again with resume_from_checkpoint=auto, or set max_restart, to continue from the latest "
            f"checkpoint [{str(e).splitlines()[0][:120]}]"
        )

    def send_array(self, a: np.ndarray) -> None:
        self.send_tensor(paddle.to_tensor(np.ascontiguousarray(a)))

    def recv_array(self, shape: list[int], dtype: str) -> np.ndarray:
        return self.recv_tensor(shape, dtype).numpy()

    def send_tensor(self, t: paddle.Tensor) -> None:
        try:
            dist.send(t.detach().contiguous(), dst=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._lost(e) from None

    def recv_tensor(self, shape: list[int], dtype: str) -> paddle.Tensor:
        buf = paddle.empty(shape, dtype=dtype)
        try:
            dist.recv(buf, src=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._lost(e) from None
        return buf

    def send_header(self, op: int, n: int) -> None:
        self.send_array(np.array([op, n], dtype="int64"))

    def recv_header(self) -> tuple[int, int]:
        h = self.recv_array([2], "int64")
        return int(h[0]), int(h[1])

    def send_object(self, obj) -> None:
        try:
            dist.send_object_list([obj], dst=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._lost(e) from None

    def recv_object(self):
        got = [None]
        try:
            dist.recv_object_list(got, src=self.peer, group=self.group)
        except RuntimeError as e:
            raise self._lost(e) from None
        return got[0]
