"""One optimizer step of a pipeline-parallel run: the 1F1B schedule over the step's micro-batches
(PipeDream-Flush, Megatron-LM's non-interleaved schedule), and the held-out loss by a
forward-only pass.

Stage s of P runs min(P-s-1, M) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards, so at most P-s micro-batches' activations are alive on
stage s (GPipe keeps all M). Sends block until the peer receives (gloo), so in the steady state
a stage receives the gradient of its oldest micro-batch *before* it sends the activation of its
newest one: the downstream stage sends that gradient before it receives that activation, and
both ends of every link see the same order of messages. The last stage never waits on a
downstream one, so by induction no stage waits forever.

Gradients match a single-process step: the last stage's loss is divided by the step's trained
units as the plain loop does, and each stage adds its own MoE router losses / M.
"""

from __future__ import annotations

import numpy as np
import paddle

from erniekit.distributed.collective.pipeline import PipelineTopology, data_rank_rows  # noqa: F401  (data_rank_rows: used here)
from erniekit.nn.moe import router_loss_sum
from erniekit.train.losses import batch_tensor, causal_lm_loss_sum, count_target_tokens, token_balanced_loss_sum


def one_f_one_b(pp: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Stage `stage`'s operations for `m` micro-batches: F (receive the activation unless first,
    forward), SEND_F (to the next stage), RECV_B (the gradient from the next stage), B (backward,
    then send the input's gradient unless first). The last stage has no SEND_F / RECV_B."""
    last = stage == pp - 1
    warmup = min(pp - stage - 1, m)
    ops: list[tuple[str, int]] = []
    for i in range(warmup):
        ops += [("F", i), ("SEND_F", i)]
    for j in range(m - warmup):
        i = warmup + j
        ops.append(("F", i))
        if not last:  # the gradient first: the downstream stage sends it before it receives i
            ops += [("RECV_B", j), ("SEND_F", i)]
        ops.append(("B", j))
    for j in range(m - warmup, m):
        ops += [("RECV_B", j), ("B", j)]
    return ops


def run_1f1b(pp: int, stage: int, m: int, forward, send_forward, recv_grad, backward) -> None:
    """Drive stage `stage`'s operations in the 1F1B order: forward(i), send_forward(i),
    recv_grad(i) -> the output's gradient, backward(i, that gradient or None on the last stage).
    Shared by pipeline stages and the parameter-server workers' pipeline."""
    grads: dict[int, paddle.Tensor | None] = {}
    for op, i in one_f_one_b(pp, stage, m):
        if op == "F":
            forward(i)
        elif op == "SEND_F":
            send_forward(i)
        elif op == "RECV_B":
            grads[i] = recv_grad(i)
        else:
            backward(i, grads.pop(i, None))


def run_layers(model, batch: dict[str, np.ndarray], x: paddle.Tensor | None, layers, dtype) -> paddle.Tensor:
    """Decoder layers `layers` of `model` over a batch; x: their input, None = embed the ids here.
    RoPE and the attention mask are built as the full model's forward builds them."""
    core = model.model
    ids = batch_tensor(batch["input_ids"])
    packed = bool((batch["segment_ids"] > 1).any())
    pos = batch_tensor(batch["position_ids"]) if packed else None
    seg = batch_tensor(batch["segment_ids"]) if packed else None
    tt = batch_tensor(batch["token_type_ids"]) if "token_type_ids" in batch else None
    cos, sin, mask = core.rope_and_mask(ids, pos, seg, None, 0, dtype=dtype)
    h = core.embed_tokens(ids) if x is None else x
    for i in layers:
        h = core.layers[i](h, cos, sin, mask, None, tt)
    return h


def activation_dtype(model, layers: range) -> paddle.dtype:
    """The dtype activations cross the stages in: the model's own, as its norms hold it. Not the
    stage's first parameter: a LoRA base held in bfloat16 (lora_base_dtype) is an untied model's
    later stages' first parameter, and the stages then disagreed (measured: the job aborted at its
    first send)."""
    return model.model.layers[layers[0]].input_layernorm.weight.dtype


def router_loss(model) -> paddle.Tensor | None:
    """Sum of the weighted router losses of the model's MoE layers in the last forward (training)."""
    if not (model.training and model.config.is_moe):
        return None
    return router_loss_sum(model.moe_layers())


class PipelineStep:
    def __init__(self, topo: PipelineTopology, model, token_balance: bool = False):
        self.topo, self.model = topo, model
        self.loss_fn = token_balanced_loss_sum if token_balance else causal_lm_loss_sum
        self.batch_loss = None  # (logits, batch) -> loss sum: a stage's own loss on the last stage (None: loss_fn)
        self.dtype = activation_dtype(model, topo.layers)
        self.hidden = model.config.hidden_size

    # ---- data ------------------------------------------------------------------------------
    def local_rows(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        return data_rank_rows(batch, self.topo.per_segment, self.topo.data_rank)

    # ---- one stage's share of the model ----------------------------------------------------
    def _stage_forward(self, batch: dict[str, np.ndarray], x: paddle.Tensor | None) -> paddle.Tensor:
        topo = self.topo
        h = run_layers(self.model, batch, None if topo.first else x, topo.layers, self.dtype)
        if topo.last:
            return self.model.head(self.model.model.norm(h))
        return h.astype(self.dtype)

    def _recv_input(self, batch: dict[str, np.ndarray]) -> paddle.Tensor | None:
        if self.topo.first:
            return None
        b, s = batch["input_ids"].shape
        x = self.topo.recv([b, s, self.hidden], self.dtype, forward=True)
        x.stop_gradient = False
        return x

    # ---- training --------------------------------------------------------------------------
    def run(
        self, micro: list[dict[str, np.ndarray]], n_units: int, loss_scale: float = 1.0, amp=None, on_forward=None
    ) -> tuple[float, float]:
        """Forward and backward of every micro-batch on this stage (gradients accumulate in
        .grad); returns (loss sum, router-loss sum) of the whole step, summed over stages.
        on_forward(batch): called after each forward (routing statistics of this stage's layers)."""
        import contextlib

        topo, m = self.topo, len(micro)
        amp = amp or contextlib.nullcontext
        local = [self.local_rows(b) for b in micro]
        live: dict[int, tuple] = {}
        loss_sum = aux_sum = 0.0

        def forward(i: int) -> None:
            nonlocal loss_sum, aux_sum
            batch, w = local[i]
            x = self._recv_input(batch)
            with amp():
                out = self._stage_forward(batch, x)
            if on_forward is not None:
                on_forward(batch)
            aux = router_loss(self.model)
            # beside dp the router losses are already this rank's share of the whole batch's
            # (MoEBlock.data_sum), also for a batch every data rank computes whole
            aw = 1.0 if topo.dp_group is not None else w
            scaled_aux = aux * (aw / m) if aux is not None else None
            if aux is not None:
                aux_sum += float(aux) * aw / m
            if topo.last:
                if self.batch_loss is not None:
                    ls = self.batch_loss(out, batch)
                else:
                    ls = self.loss_fn(out, batch["labels"], batch["segment_ids"])
                loss_sum += float(ls) * w
                loss = ls * (w / max(n_units, 1))
                out = loss + scaled_aux if scaled_aux is not None else loss
                scaled_aux = None
            live[i] = (x, out, scaled_aux)

        def backward(i: int, grad: paddle.Tensor | None) -> None:
            x, out, aux = live.pop(i)
            tensors = [out * loss_scale if loss_scale != 1.0 and topo.last else out]
            grads = [grad]
            if aux is not None:
                tensors.append(aux * loss_scale if loss_scale != 1.0 else aux)
                grads.append(None)
            paddle.autograd.backward(tensors, grads)
            if not topo.first:
                topo.send(x.grad, forward=False)

        def recv_grad(i: int) -> paddle.Tensor | None:
            if topo.last:
                return None
            b, s = local[i][0]["input_ids"].shape
            return topo.recv([b, s, self.hidden], self.dtype, forward=False)

        run_1f1b(topo.pp, topo.segment, m, forward, lambda i: topo.send(live[i][1], forward=True), recv_grad, backward)
        return self._summed([loss_sum, aux_sum])

    def _summed(self, values: list[float]) -> list[float]:
        """Summed over the stages, then over the stage's data ranks."""
        vals = self.topo.sum_over_pipeline(values)
        if self.topo.dp_group is not None:
            vals = self.topo.data_sum(paddle.to_tensor(vals, dtype="float64")).numpy().tolist()
        return vals

    @paddle.no_grad()
    def clip_grad_norm_(self, named_params: list[tuple[str, paddle.Tensor]], max_norm: float) -> float:
        """Global L2 norm over all stages (a tied embedding counted once), then scale in place."""
        grads = [(n, p.grad) for n, p in named_params if p.grad is not None]
        local = (
            float(paddle.add_n([paddle.sum(g.astype("float32") ** 2) for n, g in grads if self.topo.counted_once(n)]))
            if grads
            else 0.0
        )
        norm = float(np.sqrt(self.topo.sum_over_pipeline([local])[0]))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for _, g in grads:
                g.scale_(coef)
        return norm

    # ---- evaluation ------------------------------------------------------------------------
    @paddle.no_grad()
    def eval_loss(self, rows: list[dict[str, np.ndarray]], batch_size: int, pad_id: int) -> dict[str, float]:
        """Token-averaged held-out loss through the stages (forward only, one batch at a time);
        every data rank evaluates all rows."""
        from erniekit.train.batching import collate

        self.model.eval()
        total, n = 0.0, 0
        for i in range(0, len(rows), batch_size):
            b = collate(rows[i : i + batch_size], pad_id)
            out = self._stage_forward(b, self._recv_input(b))
            if self.topo.last:
                total += float(causal_lm_loss_sum(out, b["labels"], b["segment_ids"]))
            else:
                self.topo.send(out, forward=True)
            n += count_target_tokens(b)
        total = self.topo.sum_over_pipeline([total])[0]
        loss = total / max(n, 1)
        return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
