"""A worker of `distributed_mode: ps` (docs/ps.md): the transformer blocks and the final norm run
here; the token embedding and the LM head live on the parameter servers (erniekit/train/ps_server.py).

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

from erniekit.distributed.ps.topology import (HEAD, HEAD_BACK, PULL, PUSH, SAVE, STEP, STOP, SYNC, PeerLost,
                                              PSTopology, row_ranges)
from erniekit.distributed.ps.compression import RowCompressor
from erniekit.train.losses import position_weights
from erniekit.train.pipeline_schedule import data_rank_rows, router_loss, run_1f1b, run_layers

class HeldByServers(nn.Layer):
    """Stands in for the embedding / LM head on a worker: the parameter servers hold its rows."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this table lives on the parameter servers (distributed_mode: ps); a full-model "
                           "forward cannot run on a worker")


class PSWorker:
    def __init__(self, topo: PSTopology, model, token_balance: bool = False, compress: str = "none",
                 topk_ratio: float = 0.1, k_steps: int = 0):
        """k_steps > 0: asynchronous mode (docs/ps.md): this worker trains on its own rows with its
        own block replica, its table gradients are applied by the servers as they come, and the
        workers average their blocks every k_steps steps (the bound on how far they drift)."""
        self.topo, self.model = topo, model
        c = model.config
        self.vocab, self.hidden, self.tied = c.vocab_size, c.hidden_size, bool(c.tie_word_embeddings)
        self.token_balance = token_balance
        self.ranges = row_ranges(self.vocab, topo.servers)
        self.dtype = "float32"
        # the data ranks' group: sums of block gradients and of router statistics over the workers
        # (with pipeline stages: over the workers of this stage)
        self.pipe = topo.pipe
        self.group = topo.worker_group if self.pipe is None else self.pipe.dp_group
        self.data_ranks = topo.workers if self.pipe is None else self.pipe.per_stage
        self.data_rank = topo.worker_index if self.pipe is None else self.pipe.column
        # the tables are the servers': drop them here (memory, and the optimizer skips them)
        model.model.embed_tokens = HeldByServers()
        if not self.tied:
            model.lm_head = HeldByServers()
        if self.pipe is not None:  # this stage's layers; the final norm on the last (tables: placeholders anyway)
            self.pipe.keep_stage(model)
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
            raise PeerLost(f"lost another worker: the workers' all-reduce got no answer within gloo's timeout (a "
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
                    srv.send_tensor(grad[start:start + n])
                    sent = 4 * n * self.hidden
                else:
                    payload = self.compressor.encode(ids[start:start + n], g[start:start + n])
                    for a in payload:
                        srv.send_array(a)
                    sent = sum(a.nbytes for a in payload)
                self.bytes_sent += sent
                self.push_bytes += sent
            start += n

    # ---- one step ------------------------------------------------------------------------------
    def run(self, micro: list[dict[str, np.ndarray]], n_units: int, on_forward=None,
            normalizer=None) -> tuple[float, float]:
        """Forward and backward of every micro-batch (block gradients accumulate in .grad, row and
        head gradients on the servers); returns (loss sum, router-loss sum) over all workers.
        Async: this worker's own mean (normalizer: trained units of a batch), scaled so that
        dividing by n_units gives it."""
        if self.pipe is not None:
            return self._run_pipeline(micro, n_units, on_forward)
        loss_sum = aux_sum = 0.0
        m = len(micro)
        global_units = n_units
        if self.k_steps:
            n_units = sum(normalizer(self.local_rows(b)[0]) for b in micro)
        for batch in micro:
            batch, w = self.local_rows(batch)
            B, S = batch["input_ids"].shape
            rows, inverse, counts, ids = self.pull(batch["input_ids"])
            x = paddle.gather(rows, paddle.to_tensor(inverse.reshape(-1))).reshape([B, S, self.hidden])
            core = self.model.model
            h = core.norm(run_layers(self.model, batch, x, range(len(core.layers)), self.dtype))
            if on_forward is not None:
                on_forward(batch)
            loss, tensors, grads = self._loss_and_grad(h, batch, w, n_units)
            loss_sum += loss
            aux = router_loss(self.model)
            if aux is not None:
                aw = 1.0 if self.group is not None and not self.k_steps else w  # beside other workers already this one's share
                aux_sum += float(aux) * aw / m
                tensors.append(aux * (aw / m))
                grads.append(None)
            if tensors:
                paddle.autograd.backward(tensors, grads)
            self.push(rows.grad if rows.grad is not None else paddle.zeros_like(rows), counts, ids)
        if self.k_steps:
            return loss_sum * global_units / max(n_units, 1), aux_sum
        vals = [loss_sum, aux_sum]
        if self.group is not None:
            vals = self.data_sum(paddle.to_tensor(vals, dtype="float64")).numpy().tolist()
        return vals[0], vals[1]

    def _loss_and_grad(self, h: paddle.Tensor, batch: dict[str, np.ndarray], w: float,
                       n_units: int) -> tuple[float, list, list]:
        """The final hidden states [B, S, H] -> (this batch's weighted loss sum, [trained
        positions' states], [their gradient]): the servers' vocabulary blocks give the softmax
        statistics, then d loss / d h."""
        B, S = batch["input_ids"].shape
        h = h.reshape([B * S, self.hidden])
        weight = position_weights(batch["labels"], batch.get("segment_ids"), self.token_balance).reshape(-1)
        pos = np.nonzero(weight > 0)[0]
        if not len(pos):
            return 0.0, [], []
        target = np.zeros(B * S, dtype="int64")
        target[:-1] = batch["labels"].reshape(-1)[1:]  # position t predicts labels[t+1] (row ends weigh 0)
        sel = paddle.gather(h, paddle.to_tensor(pos))
        nll, lse = self.head_loss(sel.detach(), target[pos])
        gh = self.head_backward(lse, weight[pos] * w / max(n_units, 1))
        return float((nll * weight[pos]).sum()) * w, [sel], [gh]

    def _run_pipeline(self, micro: list[dict[str, np.ndarray]], n_units: int, on_forward=None) -> tuple[float, float]:
        """This stage's share of a step in the 1F1B order: F (pull or receive, this stage's
        layers; on the last: the loss through the servers), SEND_F, RECV_B, B (backward, then
        push the rows or send the input's gradient back)."""
        pipe, m, H = self.pipe, len(micro), self.hidden
        local = [self.local_rows(b) for b in micro]
        live: dict[int, tuple] = {}
        sums = [0.0, 0.0]  # loss, router loss

        def forward(i: int) -> None:
            batch, w = local[i]
            B, S = batch["input_ids"].shape
            pulled = None
            if pipe.first:
                rows, inverse, counts, ids = self.pull(batch["input_ids"])
                x = paddle.gather(rows, paddle.to_tensor(inverse.reshape(-1))).reshape([B, S, H])
                pulled = (rows, counts, ids)
            else:
                x = pipe.recv([B, S, H], self.dtype, forward=True)
                x.stop_gradient = False
            h = run_layers(self.model, batch, x, pipe.layers, self.dtype)
            if on_forward is not None:
                on_forward(batch)
            tensors, grads = [], []
            aux = router_loss(self.model)
            if aux is not None:
                aw = 1.0 if self.group is not None else w  # beside other data ranks already this one's share
                sums[1] += float(aux) * aw / m
                tensors.append(aux * (aw / m))
                grads.append(None)
            out = None
            if pipe.last:
                loss, t, g = self._loss_and_grad(self.model.model.norm(h), batch, w, n_units)
                sums[0] += loss
                tensors, grads = t + tensors, g + grads
            else:
                out = h
            live[i] = (x, out, tensors, grads, pulled)

        def backward(i: int, grad: paddle.Tensor | None) -> None:
            x, out, tensors, grads, pulled = live.pop(i)
            if out is not None:
                tensors, grads = [out] + tensors, [grad] + grads
            if tensors:
                paddle.autograd.backward(tensors, grads)
            if pulled is not None:
                rows, counts, ids = pulled
                self.push(rows.grad if rows.grad is not None else paddle.zeros_like(rows), counts, ids)
            else:
                pipe.send(x.grad if x.grad is not None else paddle.zeros_like(x), forward=False)

        def recv_grad(i: int) -> paddle.Tensor:
            B, S = local[i][0]["input_ids"].shape
            return pipe.recv([B, S, H], self.dtype, forward=False)

        run_1f1b(pipe.pp, pipe.stage, m, forward, lambda i: pipe.send(live[i][1], forward=True), recv_grad, backward)
        vals = pipe.sum_over_pipeline(sums)
        if self.group is not None:
            vals = self.data_sum(paddle.to_tensor(vals, dtype="float64")).numpy().tolist()
        return vals[0], vals[1]

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
                out[f"{name}::{kind}"] = paddle.to_tensor(np.ascontiguousarray(full.T if name == "lm_head.weight" else full))
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
