"""Pipeline parallelism's topology: which decoder layers a stage holds, its neighbours, its
process groups, and the point-to-point moves of activations and their gradients.

Stages are the outermost mesh dim (pp), so stage s holds ranks [s*k, (s+1)*k) with k = world/pp,
and a rank's neighbours are k ranks away. A stage keeps only its layers: the others become
empty `StageElsewhere` placeholders, so parameter names keep their global layer index
(`model.layers.3...`) and a checkpoint written from the stages is the single-process layout.
The first stage holds the embedding, the last the final norm and LM head (and, with tied
embeddings, a copy of the embedding whose gradient is summed with the first stage's).

Gloo's send blocks until the peer receives, also through `isend` (measured: two ranks that
isend to each other first time out), so the schedule (erniekit/train/pipeline_schedule.py)
orders sends and receives so that both ends of every link agree. Every link between neighbour
stages, and every stage leader's link to rank 0 for checkpoints, is a process group of its own:
Paddle's gloo tags a message with its group's running operation count, so on one shared group a
middle stage, which talks to both neighbours, soon disagrees with each of them on the tag (pp=3
timed out at its first step, measured).

In code a pipeline stage is a *segment* (`segment`, `per_segment`): "stage" is the training
algorithm (erniekit/train/stages). Config keys and messages keep "pipeline stage", as users know it.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

from erniekit.distributed.collective.layout import Layout


class StageElsewhere(nn.Layer):
    """Stands in for a layer another pipeline stage holds (no parameters, never called)."""

    def __init__(self, segment: int):
        super().__init__()
        self.segment = segment

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"this layer lives on pipeline stage {self.segment}; a full-model forward cannot run "
            "in a pipeline-parallel process"
        )


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges whose sizes differ by at most one; the extra layers
    go to the later stages, since the first one also runs the embedding."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s >= pp - extra else 0)
        out.append((start, start + n))
        start += n
    return out


def bounds_from_counts(counts: list[int]) -> list[tuple[int, int]]:
    """`pipeline_stage_layers` (layers per stage, e.g. from a placement) -> [start, end) ranges."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def new_group(ranks: list[int]):
    """A process group of `ranks`; collective: every rank of the job calls it, in the same order.

    On gloo (CPU) the group rendezvouses through a TCP store of its own, hosted by its first rank:
    Paddle's `dist.new_group` rendezvouses every group through the job's one store under the same
    key names, so a member may read a key an earlier group left there before its owner rewrites
    it. Measured on 4-5 processes: a group of 3-4 ranks created after the default one failed in
    about half the runs ("sizeof(impl_) == bytes.size(). 136 vs 181", or "Connection refused" to
    a port decoded from the stale bytes; 3-stage pipelines failed now and then in CI), 2-rank
    groups never; with a store per group, 12 of 12 runs passed. NCCL groups (GPU) are Paddle's."""
    import paddle.distributed.collective as collective

    default = collective._get_default_group()
    if collective._group_map_backend.get(default) != "gloo":
        dist.barrier()
        g = dist.new_group(ranks)
        dist.barrier()
        return g
    import os
    import socket

    from paddle.base import core

    ranks = sorted(ranks)
    me, leader = dist.get_rank(), ranks[0]
    where = paddle.zeros([5], dtype="int64")  # the leader's IPv4 address and a free port
    hosting = None
    if me == leader:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        ip = socket.gethostbyname(host)
        where[:] = paddle.to_tensor([*map(int, ip.split(".")), port], dtype="int64")
        if len(ranks) > 1:
            hosting = _host_store(ip, port, len(ranks))
    dist.broadcast(where, src=leader)
    gid = collective._new_ring_id()
    pg, store = None, None
    if me in ranks and len(ranks) > 1:
        if hosting is not None:
            store = hosting()
        else:
            w = where.numpy().tolist()
            store = core.TCPStore(".".join(str(int(v)) for v in w[:4]), int(w[4]), False, len(ranks), 900)
        pg = core.ProcessGroupGloo.create(store, ranks.index(me), len(ranks), gid)
    group = collective.Group(
        ranks.index(me) if me in ranks else -1, gid, ranks, pg=pg, name=collective._default_group_name + str(gid)
    )
    group._erniekit_store = store  # the store's host lives as long as the group
    collective._group_map[gid] = group
    collective._group_map_by_name[group.name] = group
    collective._group_map_backend[group] = "gloo"
    dist.barrier()
    return group


def _host_store(ip: str, port: int, members: int, timeout: float = 60.0):
    """Start the group's TCP store on this rank and return once it listens (a function that
    waits for the members and returns the store). A member that connects before the store
    listens is retried by Paddle only 3 s later: measured, that was ~3 s per group, several
    seconds of every pipeline or PS job's start."""
    import socket
    import threading
    import time

    from paddle.base import core

    out: dict = {}

    def host() -> None:
        try:  # blocks until every member has connected
            out["store"] = core.TCPStore(ip, port, True, members, 900)
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread below
            out["error"] = e

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((ip, port), timeout=1).close()
            break
        except OSError:
            if "error" in out:
                raise out["error"] from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the process group's store on {ip}:{port} did not start listening within {timeout:.0f} s; "
                    "check PADDLE_CURRENT_ENDPOINT names an address of this host"
                ) from None
            time.sleep(0.005)

    def wait():
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["store"]

    return wait


class PipelineTopology:
    """This rank's stage, neighbours and groups. Every rank must build it (group creation is
    collective), in the same order; a rank at or past layout.world (a parameter server beside a
    pipeline of PS workers) only joins the group creation.

    stage_layers: layers per stage (`pipeline_stage_layers`, a placement's cuts); [] = even."""

    def __init__(self, layout: Layout, rank: int, num_layers: int, stage_layers: list[int] | None = None):
        self.pp = layout.pp
        self.per_segment = layout.world // layout.pp  # the data ranks of one stage
        self.member = rank < layout.world
        self.segment, self.column = divmod(rank, self.per_segment) if self.member else (None, None)
        self.first, self.last = self.segment == 0, self.segment == self.pp - 1
        self.prev = rank - self.per_segment if self.member and not self.first else None
        self.next = rank + self.per_segment if self.member and not self.last else None
        self.bounds = bounds_from_counts(stage_layers) if stage_layers else stage_bounds(num_layers, self.pp)
        self.layers = range(*self.bounds[self.segment]) if self.member else range(0)
        self.data_rank = self.column  # rows of the global batch this rank trains: its slice
        self.pp_group = self.tied_group = self.dp_group = None
        self.prev_link = self.next_link = None  # groups of this rank and its neighbour stages
        self.gather_links: dict[int, object] = {}  # stage -> group of rank 0 and that stage's leader
        self.tied = False  # embedding tied to the LM head: set by `keep_segment`
        for c in range(self.per_segment):  # one pipeline per data rank; first+last share the tied embedding
            ranks = [c + s * self.per_segment for s in range(self.pp)]
            g = new_group(ranks)
            t = g if self.pp == 2 else new_group([ranks[0], ranks[-1]])
            if c == self.column:
                self.pp_group, self.tied_group = g, t
        if self.per_segment > 1:
            for s in range(self.pp):
                g = new_group(list(range(s * self.per_segment, (s + 1) * self.per_segment)))
                if s == self.segment:
                    self.dp_group = g
        if self.pp == 2:  # the column's pipeline group is the one link: no more groups to create
            self.next_link = self.prev_link = self.pp_group
            if self.member and self.column == 0:
                self.gather_links[1] = self.pp_group
            return
        for c in range(self.per_segment):  # neighbour links, one group each (see the module docstring)
            for s in range(self.pp - 1):
                a, b = c + s * self.per_segment, c + (s + 1) * self.per_segment
                g = new_group([a, b])
                if rank == a:
                    self.next_link = g
                if rank == b:
                    self.prev_link = g
        for s in range(1, self.pp):  # checkpoints: each stage leader to rank 0
            g = new_group([0, s * self.per_segment])
            if rank in (0, s * self.per_segment):
                self.gather_links[s] = g

    def describe(self) -> str:
        a, b = self.bounds[self.segment]
        return f"pipeline stage {self.segment + 1}/{self.pp}: layers {a}-{b - 1}"

    # ---- the model -------------------------------------------------------------------------
    def keep_segment(self, model) -> None:
        """Drop what other stages hold (in place): layers outside this stage, the embedding
        except on the first stage (and the last, when tied to the LM head), the final norm and
        LM head except on the last."""
        core = model.model
        for i in range(len(core.layers)):
            if i not in self.layers:
                core.layers[i] = StageElsewhere(self._owner(i))
        tied = self.tied = bool(model.config.tie_word_embeddings)
        if not (self.first or (self.last and tied)):
            core.embed_tokens = StageElsewhere(0)
        if not self.last:
            core.norm = StageElsewhere(self.pp - 1)
            if not tied:
                model.lm_head = StageElsewhere(self.pp - 1)
        if self.dp_group is not None:  # router losses and load counts over the whole batch
            for m in model.moe_layers():
                m.data_sum, m.data_ranks = self.data_sum, self.per_segment

    def data_sum(self, t: paddle.Tensor) -> paddle.Tensor:
        """t summed over this stage's data ranks (a copy; no gradient flows through it)."""
        out = t.detach().clone()
        dist.all_reduce(out, group=self.dp_group)
        return out

    def _owner(self, layer: int) -> int:
        return next(s for s, (a, b) in enumerate(self.bounds) if a <= layer < b)

    def counted_once(self, name: str) -> bool:
        """False for the last stage's copy of a tied embedding (the first stage counts it)."""
        return not (self.tied and self.last and not self.first and name.startswith("model.embed_tokens."))

    # ---- point to point --------------------------------------------------------------------
    def send(self, t: paddle.Tensor, forward: bool) -> None:
        dist.send(
            t.contiguous(), dst=self.next if forward else self.prev, group=self.next_link if forward else self.prev_link
        )

    def recv(self, shape: list[int], dtype, forward: bool) -> paddle.Tensor:
        t = paddle.empty(shape, dtype=dtype)
        dist.recv(t, src=self.prev if forward else self.next, group=self.prev_link if forward else self.next_link)
        return t

    # ---- reductions ------------------------------------------------------------------------
    def sum_over_pipeline(self, values: list[float]) -> list[float]:
        """Scalars that each stage holds part of (the loss lives on the last), summed."""
        t = paddle.to_tensor(values, dtype="float64")
        dist.all_reduce(t, group=self.pp_group)
        return t.numpy().tolist()

    def reduce_grads(self, named_params: list[tuple[str, paddle.Tensor]]) -> None:
        """Sum gradients over the stage's data ranks, and the tied embedding's over first + last."""
        for name, p in named_params:
            if p.grad is None:
                continue
            if self.dp_group is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
            if self.tied and name.startswith("model.embed_tokens.") and (self.first or self.last):
                dist.all_reduce(p.grad, group=self.tied_group)

    # ---- checkpoints -----------------------------------------------------------------------
    def gather_to_main(self, tensors: dict[str, paddle.Tensor]) -> dict:
        """The union of every stage's tensors on rank 0 (one stage leader sends at a time, so
        only rank 0 holds the whole model); {} elsewhere. Tensors travel as numpy arrays."""
        import numpy as np

        leader = self.column == 0
        if self.segment == 0 and leader:
            out = dict(tensors)
            for s in range(1, self.pp):
                got = [None]
                dist.recv_object_list(got, src=s * self.per_segment, group=self.gather_links[s])
                for k, v in got[0].items():
                    out.setdefault(k, paddle.to_tensor(v))
            return out
        if leader:
            dist.send_object_list(
                [{k: np.asarray(v.numpy()) for k, v in tensors.items()}], dst=0, group=self.gather_links[self.segment]
            )
        return {}


def data_rank_rows(batch: dict[str, np.ndarray], ranks: int, rank: int) -> tuple[dict[str, np.ndarray], float]:
    """Data rank `rank` of `ranks`: its rows of a global micro-batch, and the weight of its loss.
    A batch that does not split evenly is computed whole by every data rank, each with weight
    1/ranks. Shared by pipeline stages and parameter-server workers."""
    b = len(batch["input_ids"])
    if ranks == 1:
        return batch, 1.0
    if b % ranks:
        return batch, 1.0 / ranks
    n = b // ranks
    sl = slice(rank * n, (rank + 1) * n)
    return {key: v[sl] for key, v in batch.items()}, 1.0
