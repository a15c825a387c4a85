"""A worker's side of `distributed_mode: ps` (docs/ps.md): its connection to the parameter servers
(erniekit/distributed/ps/server.py), which hold the token embedding and the LM head, and the
workers' own collectives. The step itself runs in erniekit/train/runners/ps.py.

One micro-batch: pull the embedding rows the batch touches (only those), run the blocks, send the
final hidden states of the trained positions to every server and combine their per-block softmax
statistics into the loss (a vocabulary-parallel cross entropy: the head is never copied here),
send back each position's log-sum-exp and loss weight, receive the hidden states' gradient, run
the backward, push the gradient of the pulled rows. Workers split each global batch like data
ranks and sum their block gradients (all-reduce among the workers); the servers sum the pushes.

With pipeline stages (docs/ps.md "Heterogeneous pipeline") the workers form a pipeline as in
the collective mode (erniekit/train/pipeline_schedule.py: 1F1B over the micro-batches): the
first stage pulls and pushes the rows, the last stage runs the final norm and asks the servers
for the loss, and the stages in between only move activations. Each server serves every worker
link in a thread of its own, so a first stage's pull and a last stage's head request never wait
on each other.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

from erniekit.distributed.collective.pipeline import data_rank_rows
from erniekit.distributed.ps.compression import RowCompressor
from erniekit.distributed.ps.topology import (
    HEAD,
    HEAD_BACK,
    PULL,
    PUSH,
    SAVE,
    STEP,
    STOP,
    SYNC,
    PeerLost,
    PSTopology,
    row_ranges,
)


class HeldByServers(nn.Layer):
    """Stands in for the embedding / LM head on a worker: the parameter servers hold its rows."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "this table lives on the parameter servers (distributed_mode: ps); a full-model "
            "forward cannot run on a worker"
        )


class PSWorker:
    def __init__(self, topo: PSTopology, model, compress: str = "none", topk_ratio: float = 0.1, k_steps: int = 0):
        """k_steps > 0: asynchronous mode (docs/ps.md): this worker trains on its own rows with its
        own block replica, its table gradients are applied by the servers as they come, and the
        workers average their blocks every k_steps steps (the bound on how far they drift)."""
        self.topo, self.model = topo, model
        c = model.config
        self.vocab, self.hidden, self.tied = c.vocab_size, c.hidden_size, bool(c.tie_word_embeddings)
        self.ranges = row_ranges(self.vocab, topo.servers)
        self.dtype = "float32"
        # the data ranks' group: sums of block gradients and of router statistics over the workers
        # (with pipeline stages: over the workers of this stage)
        self.pipe = topo.pipe
        self.group = topo.worker_group if self.pipe is None else self.pipe.dp_group
        self.data_ranks = topo.workers if self.pipe is None else self.pipe.per_segment
        self.data_rank = topo.worker_index if self.pipe is None else self.pipe.column
        # the tables are the servers': drop them here (memory, and the optimizer skips them)
        model.model.embed_tokens = HeldByServers()
        if not self.tied:
            model.lm_head = HeldByServers()
        if self.pipe is not None:  # this stage's layers; the final norm on the last (tables: placeholders anyway)
            self.pipe.keep_segment(model)
        self.k_steps = k_steps
        if self.group is not None and c.is_moe and not k_steps:  # router losses and loads of the whole batch
            for m in model.moe_layers():
                m.data_sum, m.data_ranks = self.data_sum, self.data_ranks
        self.bytes_sent = self.bytes_received = 0
        self.push_bytes = 0  # of bytes_sent: the row gradients (what ps_compress shrinks)
        self.compressor = RowCompressor(compress, self.vocab, self.hidden, topk_ratio)
        self.servers = [topo.link(s) for s in range(topo.servers)]  # in server order
        self.server_stop = 0  # a stop signal a server reported with its step's norm (0: none)

    def _all_reduce(self, t: paddle.Tensor, group=None, op=dist.ReduceOp.SUM) -> None:
        try:
            dist.all_reduce(t, op=op, group=self.group if group is None else group)
        except RuntimeError as e:
            raise PeerLost(
                f"lost another worker: the workers' all-reduce got no answer within gloo's timeout (a "
                "worker process died or hangs; see launch_logs/ in the output_dir); the job stops: run it "
                f"again with resume_from_checkpoint=auto, or set max_restart [{str(e).splitlines()[0][:120]}]"
            ) from None

    def data_sum(self, t: paddle.Tensor) -> paddle.Tensor:
        out = t.detach().clone()
        self._all_reduce(out)
        return out

    def local_rows(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        """This worker's rows of a global micro-batch and its loss weight (workers split batches like data ranks)."""
        return data_rank_rows(batch, self.data_ranks, self.data_rank)

    # ---- the exchanges -----------------------------------------------------------------------
    def pull(self, ids: np.ndarray) -> tuple[paddle.Tensor, np.ndarray, list[int], np.ndarray]:
        """The embedding rows of the distinct ids (a leaf that collects their gradient), each
        id's index into them, how many rows came from each server, and the distinct ids."""
        uniq, inverse = np.unique(ids, return_inverse=True)
        owner = self.topo.owner(uniq, self.vocab)
        parts, counts = [], []
        for s, srv in enumerate(self.servers):
            mine = uniq[owner == s]
            srv.send_header(PULL, len(mine))
            counts.append(len(mine))
            if len(mine):
                srv.send_array(mine.astype("int64"))
                parts.append(srv.recv_tensor([len(mine), self.hidden], self.dtype))
                self.bytes_sent += 8 * len(mine)
                self.bytes_received += 4 * len(mine) * self.hidden
        rows = paddle.concat(parts) if len(parts) > 1 else parts[0]
        rows.stop_gradient = False
        return rows, inverse.reshape(ids.shape), counts, uniq

    def head_loss(self, h: paddle.Tensor, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """h [n, H] (trained positions), target [n] -> (per-position NLL, log-sum-exp), from every
        server's block of the softmax."""
        stats = []
        for srv in self.servers:
            srv.send_header(HEAD, len(target))
            srv.send_tensor(h)
            srv.send_array(target.astype("int64"))
            stats.append(srv.recv_tensor([len(target), 3], "float32").numpy().astype("float64"))
            self.bytes_sent += 4 * h.shape[0] * self.hidden + 8 * len(target)
            self.bytes_received += 12 * len(target)
        st = np.stack(stats)  # [S, n, 3]: block max, sum of exp below it, target logit (0 off-block)
        top = st[:, :, 0].max(axis=0)
        lse = top + np.log((st[:, :, 1] * np.exp(st[:, :, 0] - top)).sum(axis=0))
        return lse - st[:, :, 2].sum(axis=0), lse

    def head_backward(self, lse: np.ndarray, coef: np.ndarray) -> paddle.Tensor:
        """d loss / d h of the positions last sent to head_loss, given each one's loss weight."""
        msg = np.stack([lse, coef], axis=1).astype("float32")
        total = None
        for srv in self.servers:
            srv.send_header(HEAD_BACK, len(lse))
            srv.send_array(msg)
            g = srv.recv_tensor([len(lse), self.hidden], "float32")
            total = g if total is None else total + g
            self.bytes_sent += msg.nbytes
            self.bytes_received += 4 * len(lse) * self.hidden
        return total

    def push(self, grad: paddle.Tensor, counts: list[int], ids: np.ndarray) -> None:
        """The pulled rows' gradients to their servers (compressed with ps_compress); ids: the
        distinct ids of that pull (servers answer pushes in the order of the pulls)."""
        start = 0
        g = grad.numpy() if self.compressor.kind != "none" else None
        for srv, n in zip(self.servers, counts):
            srv.send_header(PUSH, n)
            if n:
                if g is None:
                    srv.send_tensor(grad[start : start + n])
                    sent = 4 * n * self.hidden
                else:
                    payload = self.compressor.encode(ids[start : start + n], g[start : start + n])
                    for a in payload:
                        srv.send_array(a)
                    sent = sum(a.nbytes for a in payload)
                self.bytes_sent += sent
                self.push_bytes += sent
            start += n

    @paddle.no_grad()
    def reduce_grads(self, named_params: list[tuple[str, paddle.Tensor]]) -> None:
        """Block gradients summed over the workers (each worker's loss is its share of the batch);
        async: none (each worker updates its own replica)."""
        if self.group is None or self.k_steps:
            return
        for _, p in named_params:
            if p.grad is not None:
                self._all_reduce(p.grad)

    @paddle.no_grad()
    def finish_step(self, named_params: list[tuple[str, paddle.Tensor]], max_norm: float, lr: float) -> float:
        """Global gradient norm (blocks here + rows on the servers), the blocks' clip here, and the
        servers' clipped AdamW update of their rows; returns the norm before clipping."""
        grads = [p.grad for _, p in named_params if p.grad is not None]
        sq = sum(float(paddle.sum(g.astype("float32") ** 2)) for g in grads)
        if self.pipe is not None:  # each stage holds its own layers (its data ranks the same gradients)
            sq = self.pipe.sum_over_pipeline([sq])[0]
        for srv in self.servers:
            srv.send_header(STEP, 0)
            got = srv.recv_array([2], "float64")  # its squared norm and its stop signal
            sq += float(got[0])
            self.server_stop = max(self.server_stop, int(got[1]))
        norm = float(np.sqrt(sq))
        if self.topo.worker_index == 0 or self.k_steps:  # async: every worker's step is an update
            for srv in self.servers:
                srv.send_array(np.array([norm, lr], dtype="float64"))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in grads:
                g.scale_(coef)
        return norm

    def agree_stop(self, local: int) -> int:
        """The stop signal of any process of the job, the same on every worker: this worker's or a
        server's request, all-reduced (MAX) over all the workers (every pipeline stage)."""
        flag = max(local, self.server_stop)
        if self.topo.worker_group is None:
            return flag
        t = paddle.to_tensor([flag], dtype="int64")
        self._all_reduce(t, group=self.topo.worker_group, op=dist.ReduceOp.MAX)
        return int(t.numpy()[0])

    # ---- checkpoints and shutdown ----------------------------------------------------------------
    def gather_tables(self, with_optimizer: bool) -> list[dict]:
        """Every server's rows (and moments) on worker 0 ([] on the other workers)."""
        out = []
        for srv in self.servers:
            srv.send_header(SAVE, int(with_optimizer))
            if self.topo.worker_index == 0:
                out.append(srv.recv_object())
        return out

    def full_state(self, state: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        """This worker's HF-layout tensors plus the servers' tables, on worker 0 ({} elsewhere)."""
        shards = self.gather_tables(with_optimizer=False)
        if self.topo.worker_index != 0:
            return {}
        out = dict(state)
        for name in shards[0]["tables"]:
            out[name] = paddle.to_tensor(np.concatenate([sh["tables"][name] for sh in shards]))
        return out

    def full_optimizer_state(self, opt: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        """This worker's optimizer state plus the servers' moments (in the parameters' own layout:
        the LM head's as Linear's [hidden, vocab]), on worker 0; unchanged elsewhere."""
        shards = self.gather_tables(with_optimizer=True)
        if self.topo.worker_index != 0:
            return opt
        out = dict(opt)
        for name in shards[0]["moments"]:
            for i, kind in enumerate(("exp_avg", "exp_avg_sq")):
                full = np.concatenate([sh["moments"][name][i] for sh in shards])
                out[f"{name}::{kind}"] = paddle.to_tensor(
                    np.ascontiguousarray(full.T if name == "lm_head.weight" else full)
                )
        return out

    @paddle.no_grad()
    def after_step(self, step: int, final: bool = False) -> None:
        """Async: every k_steps steps (and after the last) the workers average their blocks (all
        parameters, the router biases too), so no replica drifts more than k_steps steps."""
        if not self.k_steps or self.group is None or (step % self.k_steps and not final):
            return
        for p in self.model.parameters():
            self._all_reduce(p)
            p.scale_(1.0 / self.topo.workers)

    def sync(self) -> None:
        """A barrier of every process, servers included (async: of the workers; each server thread
        follows its own worker)."""
        if self.k_steps:
            if self.group is not None:
                dist.barrier(group=self.group)
            return
        for srv in self.servers:
            srv.send_header(SYNC, 0)
        dist.barrier()

    def stop(self) -> None:
        for srv in self.servers:
            srv.send_header(STOP, 0)
