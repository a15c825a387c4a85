"""A parameter server of `distributed_mode: ps` (docs/ps.md): it holds a contiguous block of
vocabulary rows of the token embedding (and of the LM head when it is not tied) with their AdamW
moments, and serves the workers' requests until they stop it.

Per micro-batch every worker, in turn: pulls the rows its batch touches; sends the final hidden
states of its trained positions, gets back per-position softmax statistics of this server's
vocabulary block (max, sum of exp, target logit); sends the global log-sum-exp and the loss
weight of each position, gets back the gradient of its hidden states (the head's backward); pushes
the gradient of the rows it pulled. At the step's end the server reports the squared norm of its
gradients, receives the global norm and learning rate from worker 0 and applies clipped AdamW to
its rows, so a synchronous step equals a single-process step (elementwise, the update of a row
block is the update of those rows).

When the workers form a pipeline (docs/ps.md "Heterogeneous pipeline"), the first stage pulls
and pushes and the last stage asks for the loss, in an order the 1F1B schedule sets: the server
then serves each worker link in a thread of its own (as in async mode), keeps each worker's
gradients apart and, at the step's end, sums them in worker order (the same sum every run).
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.distributed.ps.compression import decode, payload_spec
from erniekit.distributed.ps.topology import (
    HEAD,
    HEAD_BACK,
    OP_NAMES,
    PULL,
    PUSH,
    SAVE,
    STEP,
    STOP,
    SYNC,
    PSTopology,
    row_ranges,
)
from erniekit.errors import ErniekitError

EMBED, HEAD_NAME = "model.embed_tokens.weight", "lm_head.weight"


class ParameterServer:
    def __init__(self, topo: PSTopology, tables: dict[str, np.ndarray], cfg, make_optimizer, stop_signal):
        """tables: HF name -> the full [vocab, hidden] rows (lm_head as HF stores it: one row per
        token); without lm_head the embedding is tied and serves as the head too.
        make_optimizer(named rows) -> the rows' AdamW (the trainer's, so both update alike);
        stop_signal() -> this process's pending stop request (0: none), reported to the workers."""
        self.topo, self.cfg, self.stop_signal = topo, cfg, stop_signal
        vocab, self.hidden = tables[EMBED].shape
        self.lo, self.hi = row_ranges(vocab, topo.servers)[topo.server_index]
        self.w: dict[str, paddle.Tensor] = {}
        for name, full in tables.items():
            p = paddle.create_parameter([self.hi - self.lo, self.hidden], "float32")
            p.set_value(paddle.to_tensor(np.ascontiguousarray(full[self.lo : self.hi], dtype="float32")))
            self.w[name] = p
        self.head_name = HEAD_NAME if HEAD_NAME in self.w else EMBED
        self.opt = make_optimizer(list(self.w.items()))
        # gradient accumulators: one shared in sync mode; one per worker in async mode, each
        # applied as its own update when that worker ends a step, and beside a pipeline (summed
        # in worker order at the step's end)
        self.asynchronous = cfg.ps_sync_mode == "async"
        self.pipelined = topo.pipe is not None
        self.threaded = self.asynchronous or self.pipelined
        self.grads = {w: self._zeros() for w in (range(topo.workers) if self.threaded else [0])}
        self.lock = threading.Lock()  # threads: the tables and optimizer, never held across a send/recv
        self.pulled: dict[int, deque] = {w: deque() for w in range(topo.workers)}  # local row ids of
        # each worker's pulls not pushed yet (a pipeline's first stage pulls ahead of its pushes)
        self.head_ctx: dict[int, tuple] = {}  # worker -> (h, z, local target, owned) of its last head request
        self.bytes_in = self.bytes_out = 0
        self.links = [topo.link(w) for w in range(topo.workers)]
        self._handlers = {
            PULL: self._pull,
            HEAD: self._head,
            HEAD_BACK: self._head_back,
            PUSH: self._push,
            STEP: self._step,
            SAVE: self._save,
        }

    def _zeros(self) -> dict[str, paddle.Tensor]:
        return {n: paddle.zeros_like(p) for n, p in self.w.items()}

    def _acc(self, w: int) -> dict[str, paddle.Tensor]:
        return self.grads[w if self.threaded else 0]

    # ---- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Sync: rounds of one request per worker (worker 0 first), until the workers send STOP.
        Async: a thread per worker link serves it on its own, until it sends STOP."""
        if self.threaded:
            return self._serve_threads()
        W = self.topo.workers
        while True:
            ops = []
            for w in range(W):
                op, n = self.links[w].recv_header()
                ops.append(op)
                if op != ops[0]:
                    raise ErniekitError(
                        f"parameter server {self.topo.server_index}: worker {w} sent "
                        f"{OP_NAMES[op]} while worker 0 sent {OP_NAMES[ops[0]]}; the workers are "
                        "out of step (a bug: report it with the launch_logs)"
                    )
                self._handle(op, n, w)
            op = ops[0]
            if op == STEP:
                norm, lr = self.links[0].recv_array([2], "float64")
                self._update(float(norm), float(lr), self._acc(0))
            elif op == SYNC:
                dist.barrier()
            elif op == STOP:
                return

    def _serve_threads(self) -> None:
        """A thread per worker link. Async: each worker's STEP is an update of its own. Sync beside
        a pipeline: the threads meet at STEP (every worker's gradients are in), thread 0 sums them
        and takes their squared norm, each answers its worker with that norm, thread 0 applies the
        update with worker 0's norm and rate (clipping the sum in place, so no thread reads the sum
        after the meet), and no thread serves a pull before it is applied; SYNC is a barrier of all."""
        W = self.topo.workers
        errors: list[BaseException] = []
        meet = threading.Barrier(W)
        step: dict = {}  # sync: this step's summed gradients and answer, written by thread 0 between meets

        def serve_one(w: int) -> None:
            link = self.links[w]
            try:
                while True:
                    op, n = link.recv_header()
                    if op == STOP:
                        return
                    if self.asynchronous:
                        self._handle(op, n, w)
                        if op == STEP:  # this worker's own update, with its own norm and rate
                            norm, lr = link.recv_array([2], "float64")
                            with self.lock:
                                self._update(float(norm), float(lr) / W, self._acc(w))
                    elif op == STEP:
                        meet.wait()
                        if w == 0:  # and the answer, once: the update below clips the sum in place
                            step["sum"] = self._summed()
                            step["answer"] = self._step_answer(step["sum"])
                        meet.wait()
                        link.send_array(step["answer"])
                        if w == 0:
                            norm, lr = link.recv_array([2], "float64")
                            self._update(float(norm), float(lr), step.pop("sum"))
                        meet.wait()
                    elif op == SYNC:
                        meet.wait()
                        if w == 0:
                            dist.barrier()
                        meet.wait()
                    else:
                        self._handle(op, n, w)
            except threading.BrokenBarrierError:
                pass  # another thread failed: its error is the one reported
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread below
                errors.append(e)
                meet.abort()

        threads = [threading.Thread(target=serve_one, args=(w,), daemon=True) for w in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _summed(self) -> dict[str, paddle.Tensor]:
        """The workers' gradients summed in worker order (the order fixes the rounding), and the
        per-worker accumulators zeroed."""
        total = self._zeros()
        for w in range(self.topo.workers):
            for n in total:
                total[n] += self.grads[w][n]
            self.grads[w] = self._zeros()
        return total

    def _handle(self, op: int, n: int, w: int) -> None:
        handler = self._handlers.get(op)
        if handler is not None:
            handler(n, w)
        elif op not in (SYNC, STOP):
            raise ErniekitError(f"parameter server {self.topo.server_index}: unknown request {op} from worker {w}")

    def _pull(self, n: int, w: int) -> None:
        """The embedding rows a worker's batch touches."""
        H = self.hidden
        link = self.links[w]
        ids = link.recv_array([n], "int64") - self.lo if n else np.zeros([0], "int64")
        self.pulled[w].append(ids)
        if n:
            with self.lock:
                rows = paddle.gather(self.w[EMBED], paddle.to_tensor(ids))
            link.send_tensor(rows)
            self.bytes_in += 8 * n
            self.bytes_out += 4 * n * H

    def _head(self, n: int, w: int) -> None:
        """This block's softmax statistics (max, sum of exp, target logit) of the hidden states."""
        H = self.hidden
        link = self.links[w]
        h = link.recv_tensor([n, H], "float32")
        target = link.recv_array([n], "int64")
        owned = (target >= self.lo) & (target < self.hi)
        local = np.where(owned, target - self.lo, 0)
        with paddle.no_grad():
            with self.lock:
                z = paddle.matmul(h, self.w[self.head_name], transpose_y=True)  # [n, rows]
            m = z.max(axis=1)
            se = paddle.exp(z - m.unsqueeze(1)).sum(axis=1)
            zt = paddle.take_along_axis(z, paddle.to_tensor(local).unsqueeze(1), axis=1).squeeze(1)
            zt = zt * paddle.to_tensor(owned.astype("float32"))
        link.send_tensor(paddle.stack([m, se, zt], axis=1))
        self.head_ctx[w] = (h, z, local, owned)
        self.bytes_in += 4 * n * H + 8 * n
        self.bytes_out += 12 * n

    def _head_back(self, n: int, w: int) -> None:
        """The head's gradient from this block and the hidden states' gradient back."""
        H = self.hidden
        link = self.links[w]
        h, z, local, owned = self.head_ctx.pop(w)
        lse_coef = link.recv_tensor([n, 2], "float32")
        with paddle.no_grad():
            p = paddle.exp(z - lse_coef[:, 0:1])  # this block's columns of the softmax
            rows = np.nonzero(owned)[0]
            if len(rows):  # minus the one-hot of targets in this block
                idx = paddle.to_tensor(np.stack([rows, local[rows]], axis=1))
                p = paddle.scatter_nd_add(p, idx, paddle.full([len(rows)], -1.0, "float32"))
            g = p * lse_coef[:, 1:2]
            acc = self._acc(w)
            with self.lock:
                acc[self.head_name] += paddle.matmul(g, h, transpose_x=True)
                gh = paddle.matmul(g, self.w[self.head_name])
        link.send_tensor(gh)
        self.bytes_in += 8 * n
        self.bytes_out += 4 * n * H

    def _push(self, n: int, w: int) -> None:
        """The pulled rows' gradient, accumulated for the step."""
        H = self.hidden
        link = self.links[w]
        ids = self.pulled[w].popleft()
        if len(ids):
            kind = self.cfg.ps_compress
            if kind == "none":
                g = link.recv_tensor([len(ids), H], "float32")
                self.bytes_in += 4 * len(ids) * H
            else:  # erniekit/distributed/ps/compression.py
                k = max(1, math.ceil(self.cfg.ps_topk_ratio * H))
                payload = [link.recv_array(shape, dtype) for shape, dtype in payload_spec(kind, len(ids), H, k)]
                g = paddle.to_tensor(decode(kind, payload, len(ids), H))
                self.bytes_in += sum(a.nbytes for a in payload)
            acc = self._acc(w)
            with paddle.no_grad(), self.lock:
                acc[EMBED] = paddle.index_add(acc[EMBED], paddle.to_tensor(ids), 0, g)

    def _step(self, n: int, w: int) -> None:
        """The squared norm of this step's gradients and a stop request."""
        link = self.links[w]
        with self.lock:
            answer = self._step_answer(self._acc(w))
        link.send_array(answer)

    def _save(self, n: int, w: int) -> None:
        """This block's rows (and moments) to worker 0."""
        link = self.links[w]
        if w == 0:
            with self.lock:
                state = self.shard_state(with_optimizer=bool(n))
            link.send_object(state)

    def _step_answer(self, acc: dict[str, paddle.Tensor]) -> np.ndarray:
        """[squared gradient norm, stop signal]: a server that got SIGTERM / SIGINT tells the
        workers with its step's norm; they agree on the stop and end the job with a checkpoint
        (a server never leaves on its own: the workers' STOP ends it)."""
        return np.array([self.grad_sq(acc), self.stop_signal()], dtype="float64")

    # ---- the update --------------------------------------------------------------------------
    @staticmethod
    def grad_sq(acc: dict[str, paddle.Tensor]) -> float:
        """Sum of squares of gradients, one float32 sum per table as the trainer's clip does."""
        return float(sum(float(paddle.sum(g**2)) for g in acc.values()))

    @paddle.no_grad()
    def _update(self, norm: float, lr: float, acc: dict[str, paddle.Tensor]) -> None:
        """Clipped AdamW on this server's rows from accumulator `acc`, which is then zeroed. Async:
        every worker's step is an update of its own, at lr / workers, so a step of all the workers
        moves the tables about as far as one synchronous step."""
        max_norm = self.cfg.max_grad_norm
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in acc.values():
                g.scale_(coef)
        self.opt.set_lr(lr)
        self.opt.step({id(p): acc[n] for n, p in self.w.items()})
        for n in acc:
            acc[n] = paddle.zeros_like(self.w[n])

    # ---- checkpoints -------------------------------------------------------------------------
    def shard_state(self, with_optimizer: bool) -> dict:
        """This server's rows (HF layout), or, with_optimizer, their AdamW moments and step."""
        if with_optimizer:
            return {
                "rows": [self.lo, self.hi],
                "step": self.opt.t,
                "moments": {n: (self.opt.m[n].numpy(), self.opt.v[n].numpy()) for n in self.opt.m},
            }
        return {"rows": [self.lo, self.hi], "tables": {n: p.numpy() for n, p in self.w.items()}}

    def load(self, tables: dict[str, np.ndarray], moments: dict[str, tuple[np.ndarray, np.ndarray]], step: int) -> None:
        """Resume: full tables (HF layout) and full moments (same layout) -> this server's rows."""
        for n, p in self.w.items():
            p.set_value(paddle.to_tensor(np.ascontiguousarray(tables[n][self.lo : self.hi], dtype="float32")))
        self.opt.t = step
        for n, (m, v) in moments.items():
            self.opt.m[n] = paddle.to_tensor(np.ascontiguousarray(m[self.lo : self.hi], dtype="float32"))
            self.opt.v[n] = paddle.to_tensor(np.ascontiguousarray(v[self.lo : self.hi], dtype="float32"))


def model_tables(model) -> dict[str, np.ndarray]:
    """The tables a server shards, in HF layout (one row per token): the embedding, and the LM
    head when it is not tied."""
    tables = {EMBED: model.model.embed_tokens.weight.numpy()}
    if not model.config.tie_word_embeddings:
        tables[HEAD_NAME] = model.lm_head.weight.numpy().T  # Linear's [hidden, vocab] -> rows
    return tables
