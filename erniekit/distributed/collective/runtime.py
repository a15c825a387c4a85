"""A worker's side of a multi-process run: the ProcessMesh, a placement for every parameter,
batches split over the data ranks.

The model code does not change: parameters become DistTensors and Paddle's SPMD rules insert
the collectives (all-reduce of partial sums after a row-parallel matmul, all-gather before an
op that needs the full tensor). The loop builds the same global batch on every rank and each
rank keeps its slice, so a 2-process run trains on exactly the batches of a 1-process run.

Placements over the mesh dims (pp, dp, sharding, tp):
  tp  column-parallel q/k/v/gate/up (shared and routed experts' too), row-parallel o/down (their
      input width), vocab-parallel embedding (tied to the LM head); the routed experts' partial
      sums and input gradients are summed over the tp ranks (local_experts.py); a VL model's vision
      transformer and resampler whole (`whole_over_tp`);
  dp, sharding  experts split by expert over all the data ranks when expert_parallel_degree > 1,
      tokens moved to them and back by all-to-all (erniekit/distributed/collective/expert_exchange.py);
  sharding  optimizer moments split by rows (ZeRO stage 1; `optimizer_state_placements`);
            at stage 3 the parameters too.

A job that only splits the batch, training a causal-LM stage, runs as whole-model replicas on
plain tensors instead (`use_replicas`, erniekit/distributed/collective/replicas.py): no op pays
the SPMD bookkeeping, and the gradients are summed in one bucketed all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import paddle
import paddle.distributed as dist

from erniekit.distributed.collective.expert_exchange import ExpertExchange, make_pair_groups
from erniekit.distributed.collective.layout import COLUMN_PARALLEL, DIMS, ROW_PARALLEL, Layout, whole_over_tp
from erniekit.distributed.collective.local_experts import TensorParallelExperts
from erniekit.distributed.collective.pipeline import PipelineTopology, new_group
from erniekit.distributed.collective.replicas import DataReplicas
from erniekit.distributed.collective.replicated_experts import ReplicatedExperts
from erniekit.nn.moe import StackedExperts

# routed experts' [E, in, out] tensors over tp, as the dense MLP: gate/up column-parallel (their
# output width), down row-parallel (its input width); a LoRA adapter follows its base (column: B
# and DoRA's magnitude split, A whole; row: A split, B and the magnitude whole)
_EXPERT_TP_DIM = {
    "column": {"": 2, "_lora_A": None, "_lora_B": 2, "_lora_magnitude_vector": 1},
    "row": {"": 1, "_lora_A": 1, "_lora_B": None, "_lora_magnitude_vector": None},
}

# the context whose data ranks split the batches built while a run is in progress: set for the
# duration of one run by `placing_batches` (never left behind for the next run in this process)
_PLACING: ContextVar["ParallelContext | None"] = ContextVar("erniekit_placing_batches", default=None)


def expert_tp_dim(name: str) -> int | None:
    """The dim a routed-expert parameter (`...experts.<proj>[_lora_A|_lora_B|_lora_magnitude_vector]`)
    splits over tp; None: whole on every tp rank."""
    leaf = name.rsplit(".", 1)[-1]
    for proj, kind in (("gate_proj", "column"), ("up_proj", "column"), ("down_proj", "row")):
        if leaf.startswith(proj) and leaf[len(proj) :] in _EXPERT_TP_DIM[kind]:
            return _EXPERT_TP_DIM[kind][leaf[len(proj) :]]
    return None


class ParallelContext:
    def __init__(self, layout: Layout):
        self.layout = layout
        self.mesh = layout.mesh()
        self.axis = {d: i for i, d in enumerate(DIMS)}
        # pp > 1: each stage keeps its layers as plain tensors and the schedule moves activations
        # (erniekit/distributed/collective/pipeline.py); built in `init`, once the process group exists
        self.pipeline: PipelineTopology | None = None
        self._exchange: ExpertExchange | None = None
        self._replicated: ReplicatedExperts | None = None
        self._tensor: list[TensorParallelExperts | None] = []  # [the tp ranks of this one], once made
        # plain data parallelism on whole-model replicas (set by `use_replicas` before shard_model)
        self.replicas: DataReplicas | None = None

    @property
    def data_ranks(self) -> int:
        """Ranks that see different data: the global batch is per-device batch x this."""
        return self.layout.dp * self.layout.sharding

    def use_replicas(self) -> bool:
        """Run this job as whole-model replicas on plain tensors when it only splits the batch;
        True if it does. The caller decides whether its stage's losses split by rows (the LM stages)."""
        if self.layout.data_only:
            self.replicas = DataReplicas(self.layout.world, dist.get_rank())
        return self.replicas is not None

    def init_pipeline(self, num_layers: int, stage_layers: list[int] | None = None) -> None:
        """This job's pipeline groups (collective: every rank calls it), when pp > 1."""
        if self.layout.pp > 1:
            self.pipeline = PipelineTopology(self.layout, dist.get_rank(), num_layers, stage_layers)

    def _placements(self, **shard_dims: int) -> list:
        out = [dist.Replicate() for _ in DIMS]
        for mesh_dim, tensor_dim in shard_dims.items():
            if getattr(self.layout, mesh_dim) > 1:
                out[self.axis[mesh_dim]] = dist.Shard(tensor_dim)
        return out

    def param_placements(self, name: str, p: paddle.Tensor, is_expert: bool | None = None) -> list:
        """is_expert: indexed by routed expert (StackedExperts' [E, ...] parameters, adapters
        included); None: guessed from the shape ([E, in, out])."""
        lay = self.layout
        dims: dict[str, int] = {}
        is_expert = p.ndim == 3 if is_expert is None else is_expert
        if lay.tp > 1 and not whole_over_tp(name):
            if "embed_tokens" in name or "lm_head" in name:
                dims["tp"] = 0 if p.shape[0] % lay.tp == 0 and p.ndim == 2 else None
            elif is_expert:
                dims["tp"] = expert_tp_dim(name)
            elif any(k in name for k in COLUMN_PARALLEL):
                dims["tp"] = p.ndim - 1
            elif any(k in name for k in ROW_PARALLEL) and p.ndim == 2:
                dims["tp"] = 0
        if is_expert and lay.ep > 1:  # experts over every data rank: nested Shard(0), dp outer
            dims["dp"] = dims["sharding"] = 0
        if lay.sharding_stage == 3 and "sharding" not in dims and p.shape[0] % lay.sharding == 0 and not is_expert:
            dims["sharding"] = 0
        return self._placements(**{k: v for k, v in dims.items() if v is not None})

    def optimizer_state_placements(self, p: paddle.Tensor) -> list:
        """Adam moments: as the parameter, plus rows split over the sharding dim (ZeRO-1)."""
        out = list(p.placements) if p.is_dist() else [dist.Replicate() for _ in DIMS]
        ax = self.axis["sharding"]
        if self.layout.sharding > 1 and out[ax].is_replicated():
            taken = {pl.get_dim() for pl in out if pl.is_shard()}
            for d in range(p.ndim):
                if d not in taken and p.shape[d] % self.layout.sharding == 0:
                    out[ax] = dist.Shard(d)
                    break
        return out

    def shard_model(self, model: paddle.nn.Layer) -> None:
        """Turn every parameter into a DistTensor with its placements (in place, names kept);
        in a pipeline run, drop the layers other stages hold instead."""
        if self.pipeline is not None:
            self.pipeline.keep_segment(model)
            return
        if self.replicas is not None:  # every parameter stays a plain tensor, whole on each rank
            self.replicas.attach(model)
            return
        names = {id(p): n for n, p in model.named_parameters()}
        exchange = self.expert_exchange()
        replicated = self.replicated_experts()

        def shard_fn(layer_name, layer, mesh):
            experts = layer.expert_params() if isinstance(layer, StackedExperts) else {}
            for pname, p in list(layer.named_parameters(include_sublayers=False)):
                full = names.get(id(p), f"{layer_name}.{pname}")
                is_expert = pname in experts if isinstance(layer, StackedExperts) else None
                setattr(layer, pname, dist.shard_tensor(p, mesh, self.param_placements(full, p, is_expert)))
            if isinstance(layer, StackedExperts):
                layer.expert_parallel = exchange
                layer.replicated = replicated
                layer.tensor_parallel = self.tensor_experts()

        dist.shard_layer(model, self.mesh, shard_fn)

    def expert_exchange(self) -> ExpertExchange | None:
        """The all-to-all among the data ranks that share this process's tp (and pp) coordinates,
        in the order the nested Shard(0) gives them expert slices (dp outer, sharding inner);
        None without expert parallelism. The first call creates the pair groups of every exchange
        in the job (collective: every rank makes it, from shard_model)."""
        lay = self.layout
        if lay.ep == 1:
            return None
        if self._exchange is None:
            me = dist.get_rank()
            c = lay.coords(me)
            every = [self._data_ranks_at(pp, tp) for pp in range(lay.pp) for tp in range(lay.tp)]
            groups = make_pair_groups(every, me) if lay.ep > 2 else {}  # 2 ranks: each group's ops pair up
            self._exchange = ExpertExchange(
                self._data_ranks_at(c["pp"], c["tp"]), me, self.mesh, groups, self.tensor_experts()
            )
        return self._exchange

    def _data_ranks_at(self, pp: int, tp: int) -> list[int]:
        """The global ranks with these pipeline and tensor coordinates: dp outer, sharding inner."""
        lay = self.layout
        return [
            ((pp * lay.dp + d) * lay.sharding + s) * lay.tp + tp for d in range(lay.dp) for s in range(lay.sharding)
        ]

    def replicated_experts(self) -> ReplicatedExperts | None:
        """Local expert GEMMs with weight gradients summed over the data ranks, for a multi-process
        run whose experts are whole on every rank (no expert or pipeline parallelism). The first
        call creates the data-rank groups when tp > 1 (collective: every rank makes them all)."""
        lay = self.layout
        if lay.ep > 1 or lay.pp > 1 or lay.world == 1 or self.replicas is not None:
            return None
        if self._replicated is None:
            group = None  # the data ranks are the whole job
            if self.data_ranks > 1 and lay.tp > 1:
                me = dist.get_rank()
                for tp in range(lay.tp):
                    ranks = self._data_ranks_at(0, tp)
                    g = new_group(ranks)
                    if me in ranks:
                        group = g
            self._replicated = ReplicatedExperts(self.mesh, group, self.data_ranks, self.tensor_experts())
        return self._replicated

    def tensor_experts(self) -> TensorParallelExperts | None:
        """The tp ranks that split every routed expert's width with this process, None without tp.
        The first call creates the tp groups when the job has more ranks than tp (collective:
        every rank makes them all, from shard_model)."""
        lay = self.layout
        if lay.tp == 1:
            return None
        if not self._tensor:
            group = None  # the tp ranks are the whole job
            if lay.world > lay.tp:
                me = dist.get_rank()
                for start in range(0, lay.world, lay.tp):  # tp innermost: consecutive ranks
                    ranks = list(range(start, start + lay.tp))
                    g = new_group(ranks)
                    if me in ranks:
                        group = g
            self._tensor.append(TensorParallelExperts(group, self.axis["tp"]))
        return self._tensor[0]

    def plan(self, model: paddle.nn.Layer) -> dict:
        if self.pipeline is not None:  # rank 0 writes it: the first stage's parameters
            t = self.pipeline
            return {
                "mesh": {d: getattr(self.layout, d) for d in DIMS},
                "pipeline_schedule": "1F1B",
                "stage_layers": [list(range(a, b)) for a, b in t.bounds],
                "parameters": {n: {"stage": t.segment, "shape": list(p.shape)} for n, p in model.named_parameters()},
            }
        if self.replicas is not None:
            return {
                "mesh": {d: getattr(self.layout, d) for d in DIMS},
                "data_parallel": "whole-model replicas on plain tensors, gradients all-reduced",
                "parameters": {
                    n: {"placements": ["replicated"], "shape": list(p.shape)} for n, p in model.named_parameters()
                },
            }
        ex = self.expert_exchange()
        return {
            "mesh": {d: getattr(self.layout, d) for d in DIMS},
            "expert_parallel_degree": self.layout.ep,
            "sharding_stage": self.layout.sharding_stage,
            # groups of ranks that swap tokens by all-to-all (this rank's; rank 0 writes the file)
            "expert_all_to_all": [ex.ranks] if ex is not None else [],
            "parameters": {
                n: {
                    "placements": [str(pl) for pl in p.placements],
                    "shape": list(p.shape),
                    "local_shape": list(p._local_value().shape),
                }
                for n, p in model.named_parameters()
                if p.is_dist()
            },
        }

    def place_batch(self, t: paddle.Tensor) -> paddle.Tensor:
        """A global-batch tensor -> rows split over the data ranks (replicated over tp and pp).
        A batch that does not split evenly (an epoch's last, an eval remainder) stays replicated:
        every rank computes all of it, the result is the same. A pipeline run and data replicas
        slice their rows themselves (their runners) and keep plain tensors."""
        if self.pipeline is not None or self.replicas is not None:
            return t
        if t.ndim == 0 or t.shape[0] % self.data_ranks:
            return dist.shard_tensor(t, self.mesh, self._placements())
        return dist.shard_tensor(t, self.mesh, self._placements(dp=0, sharding=0))


def init(layout: Layout) -> ParallelContext:
    """Join the job (gloo on CPU, NCCL on GPU: Paddle picks); the context of this rank."""
    dist.init_parallel_env()
    return ParallelContext(layout)


@contextmanager
def placing_batches(ctx: ParallelContext | None) -> Iterator[None]:
    """Within the block, `place_batch` splits global-batch tensors over ctx's data ranks (ctx None:
    a single process, tensors stay whole). A run holds this around its loop and evaluation."""
    token = _PLACING.set(ctx)
    try:
        yield
    finally:
        _PLACING.reset(token)


def place_batch(t: paddle.Tensor) -> paddle.Tensor:
    """Identity outside `placing_batches` and in a single-process run."""
    ctx = _PLACING.get()
    return t if ctx is None else ctx.place_batch(t)
