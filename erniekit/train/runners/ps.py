"""Parameter-server mode on the training side (docs/ps.md): a worker's step runner (its blocks here,
the embedding and LM head rows on the servers, reached through erniekit/distributed/ps/worker.py),
and a server's whole run (erniekit/distributed/ps/server.py holds its rows)."""

from __future__ import annotations

import os

import numpy as np
import paddle

from erniekit.train.losses import position_weights
from erniekit.train.pipeline_schedule import router_loss, run_1f1b, run_layers
from erniekit.train.runners.base import StepRunner, StepSums


class PSRunner(StepRunner):
    name = "ps"
    partial = True

    def __init__(self, worker, token_balance: bool):
        self.worker = worker
        self.token_balance = token_balance
        self.data_ranks = worker.data_ranks
        self.token_terms = None  # the stage's loss as token log-probability terms (bind), None: the LM loss

    def bind(self, trainer) -> None:
        """A stage whose loss is not the LM loss gives it as terms of token log-probabilities
        (`token_logp_terms`: the Distill stage), which the servers' head blocks compute."""
        super().bind(trainer)
        self.token_terms = getattr(trainer.stage, "token_logp_terms", None)

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        loss_sum, aux_sum = self.run(
            micro,
            n_units,
            on_forward=lambda b: trainer.routing.after_forward(b["segment_ids"] > 0),
            normalizer=trainer.stage.normalizer,
        )
        self.worker.reduce_grads(self.named_params)
        return StepSums(loss_sum=loss_sum, aux_sum=aux_sum)

    def run(
        self, micro: list[dict[str, np.ndarray]], n_units: int, on_forward=None, normalizer=None
    ) -> tuple[float, float]:
        """Forward and backward of every micro-batch (block gradients accumulate in .grad, row and
        head gradients on the servers); returns (loss sum, router-loss sum) over all workers.
        Async: this worker's own mean (normalizer: trained units of a batch), scaled so that
        dividing by n_units gives it."""
        wk = self.worker
        if wk.pipe is not None:
            return self._run_pipeline(micro, n_units, on_forward)
        loss_sum = aux_sum = 0.0
        m = len(micro)
        global_units = n_units
        if wk.k_steps:
            n_units = sum(normalizer(wk.local_rows(b)[0]) for b in micro)
        for batch in micro:
            batch, w = wk.local_rows(batch)
            B, S = batch["input_ids"].shape
            rows, inverse, counts, ids = wk.pull(batch["input_ids"])
            x = paddle.gather(rows, paddle.to_tensor(inverse.reshape(-1))).reshape([B, S, wk.hidden])
            core = wk.model.model
            h = core.norm(run_layers(wk.model, batch, x, range(len(core.layers)), wk.dtype))
            if on_forward is not None:
                on_forward(batch)
            loss, tensors, grads = self._loss_and_grad(h, batch, w, n_units)
            loss_sum += loss
            aux = router_loss(wk.model)
            if aux is not None:
                aw = (
                    1.0 if wk.group is not None and not wk.k_steps else w
                )  # beside other workers already this one's share
                aux_sum += float(aux) * aw / m
                tensors.append(aux * (aw / m))
                grads.append(None)
            if tensors:
                paddle.autograd.backward(tensors, grads)
            wk.push(rows.grad if rows.grad is not None else paddle.zeros_like(rows), counts, ids)
        if wk.k_steps:
            return loss_sum * global_units / max(n_units, 1), aux_sum
        vals = [loss_sum, aux_sum]
        if wk.group is not None:
            vals = wk.data_sum(paddle.to_tensor(vals, dtype="float64")).numpy().tolist()
        return vals[0], vals[1]

    def _loss_and_grad(
        self, h: paddle.Tensor, batch: dict[str, np.ndarray], w: float, n_units: int
    ) -> tuple[float, list, list]:
        """The final hidden states [B, S, H] -> (this batch's weighted loss sum, [trained
        positions' states], [their gradient]): the servers' vocabulary blocks give the softmax
        statistics, then d loss / d h."""
        wk = self.worker
        B, S = batch["input_ids"].shape
        h = h.reshape([B * S, wk.hidden])
        weight = position_weights(batch["labels"], batch.get("segment_ids"), self.token_balance).reshape(-1)
        pos = np.nonzero(weight > 0)[0]
        if not len(pos):
            return 0.0, [], []
        target = np.zeros(B * S, dtype="int64")
        target[:-1] = batch["labels"].reshape(-1)[1:]  # position t predicts labels[t+1] (row ends weigh 0)
        sel = paddle.gather(h, paddle.to_tensor(pos))
        if self.token_terms is not None:
            return self._terms_loss_and_grad(sel, self.token_terms(batch), w / max(n_units, 1), w)
        nll, lse = wk.head_loss(sel.detach(), target[pos])
        gh = wk.head_backward(lse, weight[pos] * w / max(n_units, 1))
        return float((nll * weight[pos]).sum()) * w, [sel], [gh]

    def _terms_loss_and_grad(self, sel: paddle.Tensor, terms: list, scale: float, w: float) -> tuple[float, list, list]:
        """A loss given as terms (T, ids [N, m], f: log softmax(z / T) at ids -> loss sum) of the
        trained positions' states sel [N, H], through the servers' head blocks: each position's
        state, divided by T, is sent once per id, so the servers' log-sum-exp and target logit give
        the log-probability of every id. With g = df / d logp, the gradient of f in the logits is
        sum_j g_j (e_j - p) = sum_j (-g_j) (p - e_j): the cross-entropy's gradient (p - e_target)
        weighted by -g_j per (position, id) row, what the servers' head backward computes."""
        wk = self.worker
        total, tensors, grads = 0.0, [], []
        for temperature, ids, f in terms:
            n, m = ids.shape
            if n != sel.shape[0]:
                raise ValueError(f"a loss term names tokens for {n} positions, the batch trains {sel.shape[0]}")
            rows = paddle.repeat_interleave(sel / temperature if temperature != 1.0 else sel, m, axis=0)
            nll, lse = wk.head_loss(rows.detach(), ids.reshape(-1))
            logp = paddle.to_tensor((-nll).reshape(n, m).astype("float32"), stop_gradient=False)
            loss = f(logp)
            (g,) = paddle.grad(loss, logp)
            total += float(loss) * w
            tensors.append(rows)
            grads.append(wk.head_backward(lse, -g.numpy().reshape(-1) * scale))
        return total, tensors, grads

    def _run_pipeline(self, micro: list[dict[str, np.ndarray]], n_units: int, on_forward=None) -> tuple[float, float]:
        """This segment's share of a step in the 1F1B order: F (pull or receive, its layers; on the
        last: the loss through the servers), SEND_F, RECV_B, B (backward, then push the rows or
        send the input's gradient back)."""
        wk = self.worker
        pipe, m, H, local = wk.pipe, len(micro), wk.hidden, [wk.local_rows(b) for b in micro]
        live: dict[int, tuple] = {}
        sums = [0.0, 0.0]  # loss, router loss

        def forward(i: int) -> None:
            batch, w = local[i]
            B, S = batch["input_ids"].shape
            pulled = None
            if pipe.first:
                rows, inverse, counts, ids = wk.pull(batch["input_ids"])
                x = paddle.gather(rows, paddle.to_tensor(inverse.reshape(-1))).reshape([B, S, H])
                pulled = (rows, counts, ids)
            else:
                x = pipe.recv([B, S, H], wk.dtype, forward=True)
                x.stop_gradient = False
            h = run_layers(wk.model, batch, x, pipe.layers, wk.dtype)
            if on_forward is not None:
                on_forward(batch)
            tensors, grads = [], []
            aux = router_loss(wk.model)
            if aux is not None:
                aw = 1.0 if wk.group is not None else w  # beside other data ranks already this one's share
                sums[1] += float(aux) * aw / m
                tensors.append(aux * (aw / m))
                grads.append(None)
            out = None
            if pipe.last:
                loss, t, g = self._loss_and_grad(wk.model.model.norm(h), batch, w, n_units)
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
                wk.push(rows.grad if rows.grad is not None else paddle.zeros_like(rows), counts, ids)
            else:
                pipe.send(x.grad if x.grad is not None else paddle.zeros_like(x), forward=False)

        def recv_grad(i: int) -> paddle.Tensor:
            B, S = local[i][0]["input_ids"].shape
            return pipe.recv([B, S, H], wk.dtype, forward=False)

        run_1f1b(pipe.pp, pipe.segment, m, forward, lambda i: pipe.send(live[i][1], forward=True), recv_grad, backward)
        vals = pipe.sum_over_pipeline(sums)
        if wk.group is not None:
            vals = wk.data_sum(paddle.to_tensor(vals, dtype="float64")).numpy().tolist()
        return vals[0], vals[1]

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        """The servers update their rows with the same norm and rate."""
        return self.worker.finish_step(self.named_params, max_norm, lr), None

    def after_update(self, step: int, final: bool = False) -> None:
        self.worker.after_step(step, final=final)

    def agree_stop(self, local: int) -> int:
        """Workers also carry a server's request (it answers their step's norm request with it);
        servers stop when the workers send STOP."""
        return self.worker.agree_stop(local)

    def before_stop(self, step: int) -> None:
        if self.worker.k_steps and step % self.worker.k_steps:
            self.worker.after_step(step, final=True)  # async: one block replica to save

    def finish(self) -> dict:
        w = self.worker
        out = {
            "ps_bytes_per_worker": {
                "sent": w.bytes_sent,
                "received": w.bytes_received,
                "pushed_row_gradients": w.push_bytes,
            }
        }
        w.stop()
        import paddle.distributed as dist

        dist.barrier()  # every role leaves together (a server gone early tore the store down under others)
        return out

    # ---- checkpoints: worker 0 writes the servers' rows too ---------------------------------------
    def model_state(self, model):
        from erniekit.models.registry import model_state

        return self.worker.full_state(self.full_tensors(model_state(model)))

    def full_tensors(self, tensors):
        pipe = self.worker.pipe
        return tensors if pipe is None else pipe.gather_to_main(tensors)

    def optimizer_state(self, state):
        return self.worker.full_optimizer_state(self.full_tensors(state))

    def sync(self) -> None:
        self.worker.sync()


def serve_tables(cfg, model, topo, log) -> dict:
    """A parameter server's whole run: its rows of the tables (resumed from the checkpoint the
    workers resume from), then requests until the workers stop it."""
    from erniekit.distributed.ps.server import EMBED, ParameterServer, model_tables
    from erniekit.train.checkpointing import resolve_resume
    from erniekit.train.optim import AdamW
    from erniekit.utils.run_control import stop_signal

    def make_optimizer(rows):  # the trainer's rule (optim.build_optimizer): no weight decay on the embedding
        return AdamW(
            rows,
            cfg.learning_rate,
            cfg.adam_beta1,
            cfg.adam_beta2,
            cfg.adam_epsilon,
            cfg.weight_decay,
            no_decay={EMBED},
        )

    tables = model_tables(model)
    server = ParameterServer(topo, tables, cfg, make_optimizer, stop_signal)
    path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if path is not None:
        server.load(*checkpoint_tables(path, model, list(tables)))
    del model, tables
    server.serve()
    import paddle.distributed as dist

    dist.barrier()  # leave with the workers
    return {"ps_server": topo.server_index, "bytes_in": server.bytes_in, "bytes_out": server.bytes_out}


def checkpoint_tables(path: str, model, names: list[str]) -> tuple[dict, dict, int]:
    """(full tables in HF layout, their AdamW moments in the same layout, optimizer step) of a
    training checkpoint: what a server resumes its rows from. `model` is this process's full
    model, filled from the checkpoint on the way."""
    from safetensors import safe_open

    from erniekit.distributed.ps.server import HEAD_NAME, model_tables
    from erniekit.models.registry import load_weights
    from erniekit.train.checkpointing import OPTIMIZER_NAME

    load_weights(model, path)
    tables = model_tables(model)
    moments, step = {}, 0
    opt_file = os.path.join(path, OPTIMIZER_NAME)
    if os.path.isfile(opt_file):
        with safe_open(opt_file, framework="numpy") as f:
            keys = set(f.keys())
            step = int(f.get_tensor("__step__")[0]) if "__step__" in keys else 0
            for n in names:
                if f"{n}::exp_avg" in keys:
                    m, v = f.get_tensor(f"{n}::exp_avg"), f.get_tensor(f"{n}::exp_avg_sq")
                    moments[n] = (m.T, v.T) if n == HEAD_NAME else (m, v)  # ours: Linear's [in, out]
    return tables, moments, step


def stage_device(kind: str, model) -> str:
    """A PS pipeline segment's device (ps_stage_devices): gpu segments take this node's GPUs in
    rank order. The model was built on the default device; it moves when that differs."""
    if kind == "cpu":
        device = "cpu"
    else:
        local = int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")))
        device = f"gpu:{local % max(1, paddle.device.cuda.device_count())}"
    if paddle.get_device() != device:
        paddle.set_device(device)
        model.to(device=device)
    return device
