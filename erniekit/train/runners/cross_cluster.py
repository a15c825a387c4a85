"""One cluster's side of training across clusters over a slow link (docs/cross_cluster.md).

The cluster's own runner (one process, whole-model replicas, pipeline segments) runs every step as it
would alone; this wrapper adds what crosses the link, between this process and the process of the same
rank in every other cluster (erniekit/distributed/cross_cluster/link.py):

- `gradients`: plain data parallelism across clusters. Each cluster computes its rows of the global
  batch, the intra-cluster sum of the gradients is summed across clusters before the optimizer step
  (uncompressed), and the loss is divided by the global batch's count: the step of one data-parallel
  job over all the clusters' processes. The baseline the local mode is measured against.
- `local`: each cluster trains alone on its rows and every `cross_cluster_sync_every` steps the
  trainable parameters are synchronised: the change since the last sync (anchor - local) is
  compressed with error feedback, averaged over the clusters, and the outer optimizer moves the
  anchor (erniekit/distributed/cross_cluster/outer.py); with `cross_cluster_overlap_steps` the
  exchange runs in the background and lands that many steps later.

In a cluster of data-parallel replicas, replica i syncs the i-th of dp equal chunks of the flat
parameter vector and the cluster all-gathers them afterwards, so the link carries each value once.
A checkpoint written at a synchronised step keeps this process's sync state beside it
(`cross_cluster_state/checkpoint-N/rank-R.safetensors`); a restart resumes from the newest
checkpoint every cluster holds.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import zlib

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.distributed.cross_cluster.plan import BIASES_WITH_GRADIENTS
from erniekit.errors import CheckpointError, ConfigError
from erniekit.train.runners.base import StepRunner, StepSums
from erniekit.utils.dtensor import host_view

STATE_DIR = "cross_cluster_state"


def cluster_rows(batch: dict[str, np.ndarray], n: int, c: int) -> dict[str, np.ndarray]:
    """Cluster c's contiguous rows of a global micro-batch (sizes differ by at most one row)."""
    b = len(batch["input_ids"])
    lo, hi = c * b // n, (c + 1) * b // n
    return {k: (v[lo:hi] if isinstance(v, np.ndarray) and v.ndim > 0 and len(v) == b else v) for k, v in batch.items()}


def link_shape(cfg):
    """The emulated link of the config (none unless cross_cluster_link_mbit / _latency_ms are set); shared
    by a cluster's processes through one clock file per direction, named after the job's addresses."""
    import hashlib
    import tempfile

    from erniekit.distributed.cross_cluster.link import LinkShape

    mbit = cfg.cross_cluster_link_mbit
    shared = None
    if cfg.cross_cluster_link_shared and (mbit > 0 or cfg.cross_cluster_link_latency_ms > 0):
        job = hashlib.sha1("|".join(cfg.cross_cluster_peers).encode()).hexdigest()[:16]
        shared = os.path.join(tempfile.gettempdir(), f"erniekit-links-{job}")
        os.makedirs(shared, exist_ok=True)
    return LinkShape(mbit if mbit > 0 else None, cfg.cross_cluster_link_latency_ms, shared)


class FlatParams:
    """A rank's trainable tensors as one float32 vector, read and written in place."""

    def __init__(self, tensors: list[paddle.Tensor]):
        # a DistTensor's own shard (tensor / expert parallel, sharding): rank r of every cluster holds the same one
        self.tensors = [t._local_value() if t.is_dist() else t for t in tensors]
        self.sizes = [int(np.prod(t.shape)) if t.shape else 1 for t in self.tensors]
        self.n = sum(self.sizes)

    def read(self) -> np.ndarray:
        out = np.empty(self.n, np.float32)
        start = 0
        for t, k in zip(self.tensors, self.sizes):
            v = host_view(t)
            out[start : start + k] = (v if v is not None else t.numpy()).reshape(-1)
            start += k
        return out

    @paddle.no_grad()
    def write(self, vec: np.ndarray) -> None:
        start = 0
        for t, k in zip(self.tensors, self.sizes):
            part = vec[start : start + k]
            v = host_view(t)
            if v is not None:
                v.reshape(-1)[:] = part
            else:
                paddle.assign(paddle.to_tensor(part.reshape(t.shape), dtype=t.dtype), output=t)
            start += k


class CrossClusterRunner(StepRunner):
    def __init__(self, inner: StepRunner, cfg, ctx=None):
        self.inner, self.cfg = inner, cfg
        self.name = f"{inner.name}+cross-cluster"
        self.partial = inner.partial
        self.optimizer_state_placements = inner.optimizer_state_placements
        self.n = len(cfg.cross_cluster_peers)
        self.cid = cfg.cross_cluster_id
        self.mode = cfg.cross_cluster_sync
        self.every = cfg.cross_cluster_sync_every
        self.overlap = cfg.cross_cluster_overlap_steps if self.mode == "local" else 0
        replicas = getattr(inner, "replicas", None)  # whole-model replicas: dp chunks
        self.dp, self.dp_rank = (replicas.size, replicas.rank) if replicas is not None else (1, 0)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.links = None
        self.outer_sync = None  # OuterSync (local mode)
        self.apply_at = -1  # the step whose end applies the exchange in flight
        self.synced_at = 0  # the last step after which every cluster held the same weights
        self.step = 0
        self.t_link = 0.0  # seconds this process waited on the link (exchanges it could not hide)
        self.interval = self.every  # steps between syncs (adaptive: chosen at each sync)
        self.next_sync = self.every
        self.adaptive = cfg.cross_cluster_compress == "adaptive" and self.mode == "local"
        self.meter = None  # LinkMeter (adaptive)
        self._compute = [0.0, 0]  # seconds of local work and steps since the last sync
        self._clock: tuple[float, float] | None = None  # (time, t_link) at the last step's end
        self._compute_total = 0.0
        self._headers: dict[int, tuple[float, float, float]] = {}  # cluster -> its measurements (adaptive)

    # ---- the wrapped runner ------------------------------------------------------------------
    @property
    def data_ranks(self) -> int:
        return self.inner.data_ranks * self.n

    def model_state(self, model):
        return self.inner.model_state(model)

    def full_tensors(self, tensors):
        return self.inner.full_tensors(tensors)

    def optimizer_state(self, state):
        return self.inner.optimizer_state(state)

    def sync(self) -> None:
        self.inner.sync()

    def agree_stop(self, local: int) -> int:
        return self.inner.agree_stop(local)

    def before_stop(self, step: int) -> None:
        self.inner.before_stop(step)

    def eval_loss(self, trainer):
        return self.inner.eval_loss(trainer)

    def clip(self, trainer, max_norm: float, lr: float):
        return self.inner.clip(trainer, max_norm, lr)

    # ---- joining the other clusters -------------------------------------------------------------
    def bind(self, trainer) -> None:
        from erniekit.distributed.cross_cluster.auth import load_key
        from erniekit.distributed.cross_cluster.link import CrossClusterLinks
        from erniekit.utils.run_control import stop_signal

        self.inner.bind(trainer)
        self.trainer = trainer
        self.flat = FlatParams(self._synced_tensors(trainer))
        self.chunk = -(-self.flat.n // self.dp)  # this replica's share of the vector (padded)
        tail = len(trainer.batches.rows) % trainer.batches.batch_size
        if 0 < tail < self.n:
            raise ConfigError(
                f"the {len(trainer.batches.rows)} training rows end each epoch with a batch of {tail} row(s), fewer "
                f"than the {self.n} clusters; change per_device_train_batch_size or the dataset size"
            )
        cfg = self.cfg
        start = self.flat.read()
        hello = {
            "sync": self.mode,
            "every": self.every,
            "overlap": self.overlap,
            "compress": cfg.cross_cluster_compress,
            "outer": cfg.cross_cluster_outer,
            "world": self.world,
            "elements": self.flat.n,
            "resume": bool(cfg.resume_from_checkpoint),
            "checkpoints": self._own_checkpoints(),
            "start_crc": zlib.crc32(start.tobytes()),
        }
        self.links = CrossClusterLinks.open(
            self.cid,
            self.rank,
            list(cfg.cross_cluster_peers),
            load_key(cfg.cross_cluster_key_file),
            link_shape(cfg),
            hello=hello,
            timeout_s=cfg.cross_cluster_timeout_s,
            stop=stop_signal,  # a SIGTERM while waiting for the other clusters ends the wait
        )
        self._check_hellos(hello)
        if self.mode == "local":
            self._start_outer_sync(start)

    def _synced_tensors(self, trainer) -> list:
        """The trainable parameters, and the router correction biases each cluster moves on its own."""
        tensors = list(trainer.params)
        if getattr(trainer.model.config, "moe_bias_update_rate", 0.0) > 0:
            if self.mode == "gradients":
                raise ConfigError(BIASES_WITH_GRADIENTS)
            tensors += [p for n, p in trainer.model.named_parameters() if n.endswith("e_score_correction_bias")]
        return tensors

    def _start_outer_sync(self, start: np.ndarray) -> None:
        from erniekit.distributed.cross_cluster.outer import OuterSync

        cfg = self.cfg
        nesterov = cfg.cross_cluster_outer == "nesterov"
        if self.adaptive:
            self._probe_link()
        self.outer_sync = OuterSync(
            self._my_chunk(start),
            self._all_gather_measured if self.adaptive else self.links.all_gather,
            self.n,
            self.cid,
            compress=self._compression(),
            topk_ratio=cfg.cross_cluster_topk_ratio,
            outer=cfg.cross_cluster_outer,
            outer_lr=cfg.cross_cluster_outer_lr if nesterov else 1.0,
            outer_momentum=cfg.cross_cluster_outer_momentum if nesterov else 0.0,
            timeout_s=cfg.cross_cluster_timeout_s,
        )

    def _compression(self) -> str:
        if self.outer_sync is not None:
            return self.outer_sync.compressor.kind
        kind = self.cfg.cross_cluster_compress
        return "int8" if kind == "adaptive" else kind

    # ---- adaptive interval and compression -------------------------------------------------------
    def _probe_link(self) -> None:
        """Two exchanges of different sizes: the link meter needs both to tell latency from bandwidth."""
        from erniekit.distributed.cross_cluster.adaptive import LinkMeter
        from erniekit.distributed.cross_cluster.link import frame_bytes

        self.meter = LinkMeter()
        for size in (1 << 10, 1 << 18):
            t0 = time.perf_counter()
            self.links.all_gather(f"probe/{size}", bytes(size))
            self.meter.observe(frame_bytes("probe", size), time.perf_counter() - t0)

    _MEASURED = struct.Struct("<ddd")  # step seconds, link bytes/s, link latency s

    def _all_gather_measured(self, tag: str, payload: bytes) -> list[bytes]:
        """The sync's exchange with this rank's measurements in front of its payload (adaptive)."""
        secs, n = self._compute
        bw, lat = self.meter.estimate()
        head = self._MEASURED.pack(secs / max(n, 1), min(bw, 1e15), lat)
        got = self.links.all_gather(tag, head + payload)
        k = self._MEASURED.size
        if min(len(g) for g in got) < k:
            raise ConfigError(
                f"cross-cluster sync {tag!r}: a cluster sent no measurements (rank {self.rank}); every cluster "
                "needs cross_cluster_compress=adaptive and the same erniekit version"
            )
        self._headers = {c: self._MEASURED.unpack(g[:k]) for c, g in enumerate(got)}
        return [g[k:] for g in got]

    def _adapt(self) -> None:
        """Every cluster's pair r decides from the same exchanged measurements (the slowest step, the
        slowest link); a cluster's ranks then take the most cautious decision of their pairs, which is
        the same set in every cluster, so all switch at the same step."""
        from erniekit.distributed.cross_cluster.adaptive import INTERVALS, choose
        from erniekit.distributed.cross_cluster.compress import FlatCompressor
        from erniekit.distributed.cross_cluster.link import frame_bytes
        from erniekit.distributed.ps.compression import KINDS

        last = self.outer_sync.history[-1]
        self.meter.observe(frame_bytes("outer", last.payload_bytes + self._MEASURED.size), last.exchange_s)
        h = list(self._headers.values())
        intervals = tuple(i for i in INTERVALS if i > self.overlap)
        measured = (max(x[0] for x in h), self.chunk, min(x[1] for x in h), max(x[2] for x in h))
        kw = dict(intervals=intervals, topk_ratio=self.cfg.cross_cluster_topk_ratio, n_clusters=self.n)
        pick = choose(*measured, self.cfg.cross_cluster_max_sync_fraction, self.overlap, **kw)
        code = INTERVALS.index(pick.interval) * len(KINDS) + KINDS.index(pick.kind)
        if self.world > 1:
            t = paddle.to_tensor([code], dtype="int64")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            code = int(t.item())
        self.interval, kind = INTERVALS[code // len(KINDS)], KINDS[code % len(KINDS)]
        old = self.outer_sync.compressor
        if kind != old.kind:  # what the old codec still owed is carried into the new one
            new = FlatCompressor(kind, old.n, self.cfg.cross_cluster_topk_ratio)
            if new.residual is not None and old.residual is not None:
                new.residual[:] = old.residual
            self.outer_sync.compressor = new

    def _check_hellos(self, mine: dict) -> None:
        for c, other in enumerate(self.links.hellos):
            if c == self.cid:
                continue
            for key in ("sync", "every", "overlap", "compress", "outer", "world", "elements", "resume"):
                if other.get(key) != mine[key]:
                    raise ConfigError(
                        f"cluster {c} runs with {key}={other.get(key)} but cluster {self.cid} with {mine[key]} "
                        f"(rank {self.rank}); every cluster needs the same cross_cluster_* keys, layout and model"
                    )
            held = other.get("checkpoints")
            if not isinstance(held, list) or not all(isinstance(x, int) for x in held):
                raise ConfigError(
                    f"cluster {c} sent no list of checkpoints in its hello (rank {self.rank}): it runs another "
                    "erniekit version; use the same on every cluster"
                )
            if not mine["resume"] and other.get("start_crc") != mine["start_crc"]:
                raise ConfigError(
                    f"cluster {c} starts from other weights than cluster {self.cid} (rank {self.rank}): give every "
                    "cluster the same model_name_or_path and seed"
                )

    # ---- the batch ---------------------------------------------------------------------------------
    def cluster_share(self, micro, n_units, normalizer):
        mine = [cluster_rows(b, self.n, self.cid) for b in micro]
        if self.mode == "gradients":  # divided by the global batch's count: the clusters' sum is its gradient
            return mine, n_units
        return mine, sum(normalizer(b) for b in mine)

    def forward_backward(self, trainer, micro, n_units: int, specs: list) -> StepSums:
        if self._clock is None:  # the first step of this run (resumed or not) starts the clock
            self._clock = (time.perf_counter(), self.t_link)
        sums = self.inner.forward_backward(trainer, micro, n_units, specs)
        if self.mode == "gradients":
            self._sum_gradients(trainer, sums)
        sums.metrics.update(self.step_metrics())
        return sums

    @paddle.no_grad()
    def _sum_gradients(self, trainer, sums: StepSums) -> None:
        from erniekit.distributed.cross_cluster.outer import gradient_sum

        grads = []
        for p in trainer.params:
            if p.grad is None:
                p.grad = paddle.zeros_like(p)
            grads.append(p.grad)
        flat = FlatParams(grads)
        vec = flat.read()
        extra = np.array([sums.loss_sum, sums.aux_sum], np.float32)
        t0 = time.perf_counter()
        part = np.concatenate([self._my_chunk(vec), extra])
        total = gradient_sum(self.links.all_gather, part, tag=f"grad/{self.step}")
        self.t_link += time.perf_counter() - t0
        flat.write(self._gather_chunks(total[: self.chunk]))
        sums.loss_sum, sums.aux_sum = float(total[-2]), float(total[-1])

    # ---- chunks of the vector over the data-parallel replicas ---------------------------------------
    def _my_chunk(self, vec: np.ndarray) -> np.ndarray:
        if self.dp == 1:
            return vec
        out = np.zeros(self.chunk, np.float32)
        part = vec[self.dp_rank * self.chunk : (self.dp_rank + 1) * self.chunk]
        out[: len(part)] = part
        return out

    def _gather_chunks(self, mine: np.ndarray) -> np.ndarray:
        """Every replica's chunk, in order: the whole vector on each replica (the cluster's fast link)."""
        if self.dp == 1:
            return mine
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, paddle.to_tensor(np.ascontiguousarray(mine, np.float32)))
        return np.concatenate([p.numpy() for p in parts])[: self.flat.n]

    # ---- the sync --------------------------------------------------------------------------------
    def after_update(self, step: int, final: bool = False) -> None:
        self.inner.after_update(step, final)
        self.step = step
        now, t_link = time.perf_counter(), self.t_link
        own = (now - self._clock[0]) - (t_link - self._clock[1])  # this step's own work, link waits excluded
        self._compute[0] += own
        self._compute[1] += 1
        self._compute_total += own
        if self.mode != "local":
            self.synced_at = step
        else:
            self._local_sync(step, final)
        self._clock = (time.perf_counter(), self.t_link)

    def _local_sync(self, step: int, final: bool) -> None:
        t0 = time.perf_counter()
        save = self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0
        if self.outer_sync.pending and (step == self.apply_at or final or save):
            self._finish()
        if step >= self.next_sync or final or save:
            mine = self._my_chunk(self.flat.read())
            if self.overlap == 0 or final or save:  # a checkpoint and the end hold synchronised weights
                self.outer_sync.begin(step, mine)
                self._finish(mine)
                self.synced_at = step
            else:
                self.outer_sync.begin(step, mine)
                self.apply_at = step + self.overlap
            self.next_sync = step + self.interval
        self.t_link += time.perf_counter() - t0  # what the sync cost this step (the part overlap did not hide)

    def _finish(self, mine: np.ndarray | None = None) -> None:
        mine = self._my_chunk(self.flat.read()) if mine is None else mine
        self.flat.write(self._gather_chunks(self.outer_sync.end(mine)))
        self.apply_at = -1
        if self.adaptive:
            self._adapt()
            self.next_sync = self.outer_sync.history[-1].step + self.interval
        self._compute = [0.0, 0]

    def step_metrics(self) -> dict[str, float]:
        """Cross-cluster bytes this process sent and seconds it waited on the link, per step so far."""
        steps = max(self.step, 1)
        st = self.links.stats()
        return {
            "cross_cluster/bytes_sent_per_step": st.bytes_sent / steps,
            "cross_cluster/wait_s_per_step": self.t_link / steps,
        }

    def finish(self) -> dict:
        out = dict(self.inner.finish())
        if self.links is not None:
            if self.outer_sync is not None and self.outer_sync.pending:
                self._finish()
            st = self.links.stats()
            steps = max(self.step, 1)
            out["cross_cluster"] = {
                "clusters": self.n,
                "cluster": self.cid,
                "sync": self.mode,
                "sync_every": self.interval if self.mode == "local" else 1,
                "compress": self._compression() if self.mode == "local" else "none",
                "steps": self.step,
                "bytes_sent": st.bytes_sent,
                "bytes_received": st.bytes_received,
                "bytes_sent_per_step": st.bytes_sent / steps,
                "link_wait_s_per_step": self.t_link / steps,
                "compute_s_per_step": self._compute_total / steps,
                "syncs": len(self.outer_sync.history) if self.outer_sync is not None else self.step,
            }
            self.links.close()
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def _state_file(self, ckpt: str) -> str:
        out = os.path.dirname(ckpt) or "."
        return os.path.join(out, STATE_DIR, os.path.basename(ckpt), f"rank-{self.rank}.safetensors")

    def save_state(self, path: str) -> None:
        """This process's sync state, only for a checkpoint of synchronised weights (the ones a restart
        of every cluster can start from together)."""
        if self.synced_at != self.step or (self.outer_sync is not None and self.outer_sync.pending):
            return
        from safetensors.numpy import save_file

        from erniekit.utils.io import atomic_write

        tensors: dict[str, np.ndarray] = {}
        if self.outer_sync is not None:
            st = self.outer_sync.state_dict()
            res, buf = st["compressor"]["residual"], st["outer"]["buf"]
            tensors["residual"] = np.asarray(res if res is not None else np.zeros(0), np.float32)
            tensors["outer_buf"] = np.asarray(buf if buf is not None else np.zeros(0), np.float32)
        info = {"elements": self.flat.n, "dp": self.dp, "interval": self.interval, "kind": self._compression()}
        meta = {"step": str(self.step), "meta": json.dumps(info)}
        file = self._state_file(path)
        os.makedirs(os.path.dirname(file), exist_ok=True)
        atomic_write(file, lambda tmp: save_file(tensors or {"none": np.zeros(0, np.float32)}, tmp, metadata=meta))
        self._prune(os.path.dirname(path) or ".", os.path.basename(path))

    def _prune(self, output_dir: str, keep: str) -> None:
        """State of checkpoints that rotation removed (the one being written is not there yet)."""
        root = os.path.join(output_dir, STATE_DIR)
        for name in os.listdir(root) if os.path.isdir(root) and self.rank == 0 else []:
            if name != keep and not os.path.isdir(os.path.join(output_dir, name)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _own_checkpoints(self) -> list[int]:
        from erniekit.train.checkpointing import list_checkpoints

        return [s for s, p in list_checkpoints(self.cfg.output_dir) if os.path.isfile(self._state_file(p))]

    def agree_resume(self, path: str | None) -> str | None:
        """The newest checkpoint every cluster (and every rank of each) holds with its sync state."""
        if not self.cfg.resume_from_checkpoint:
            return None
        common = set(self.links.hellos[0]["checkpoints"])
        for h in self.links.hellos[1:]:
            common &= set(h["checkpoints"])
        best = max(common, default=0)
        if self.world > 1:
            t = paddle.to_tensor([best], dtype="int64")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            best = int(t.item())
        if best == 0:
            if any(h["checkpoints"] for h in self.links.hellos):
                raise CheckpointError(
                    f"resume_from_checkpoint: no checkpoint is held by every cluster (cluster checkpoints: "
                    f"{[h['checkpoints'] for h in self.links.hellos]}); start every cluster with a new output_dir"
                )
            return None
        chosen = os.path.join(self.cfg.output_dir, f"checkpoint-{best}")
        if path is not None and os.path.abspath(path) != os.path.abspath(chosen):
            self.trainer.log(f"cross-cluster: resuming from {chosen}, the newest checkpoint every cluster holds")
        return chosen

    def load_state(self, path: str) -> None:
        from safetensors.numpy import load_file

        file = self._state_file(path)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing; resume from a checkpoint written at a cross-cluster sync")
        from safetensors import safe_open

        st = load_file(file)
        with safe_open(file, "np") as f:
            info = json.loads((f.metadata() or {}).get("meta", "{}"))
        if info.get("elements") != self.flat.n or info.get("dp") != self.dp:
            raise CheckpointError(
                f"{file}: written by a rank of {info.get('elements')} values in {info.get('dp')} replica chunk(s), this "
                f"rank has {self.flat.n} in {self.dp}; resume every cluster with the layout it was saved with"
            )
        self.step = self.synced_at = int(os.path.basename(path).rsplit("-", 1)[1])
        if self.outer_sync is not None:
            if self.adaptive:  # the interval and codec the clusters had agreed on
                from erniekit.distributed.cross_cluster.compress import FlatCompressor

                self.interval = int(info["interval"])
                self.outer_sync.compressor = FlatCompressor(info["kind"], self.chunk, self.cfg.cross_cluster_topk_ratio)
            self.next_sync = self.step + self.interval
            anchor = self._my_chunk(self.flat.read())
            state = self.outer_sync.state_dict()
            if st["residual"].size:
                state["compressor"]["residual"] = st["residual"]
            state["outer"]["buf"] = st["outer_buf"] if st["outer_buf"].size else None
            state["anchor"] = anchor
            self.outer_sync.load_state_dict(state)
