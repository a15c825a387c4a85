"""One process, or data / tensor / expert-parallel ranks over a mesh: the whole model runs here
each micro-batch (placements make the collectives), elastic sub-models and AMP included."""

from __future__ import annotations

import contextlib

import paddle

from erniekit.elastic.submodels import ElasticSpec, apply_elastic
from erniekit.train.losses import distill_loss_sum
from erniekit.train.optim import clip_grad_norm_, reduced_grads
from erniekit.train.runners.base import StepRunner, StepSums
from erniekit.utils.dtensor import scalar


def amp_context(precision):
    """bf16/fp16 autocast on GPU; float32 elsewhere (config validation rejects AMP on CPU).
    precision: the run config's `precision` section."""
    if precision is None or not (precision.bf16 or precision.fp16):
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, dtype="bfloat16" if precision.bf16 else "float16", level="O1")


class LocalRunner(StepRunner):
    name = "local"

    def __init__(self, ctx=None, precision=None, distill_weight: float = 0.0):
        """ctx: erniekit/distributed/collective/runtime.py's context in a launched job, else None; precision:
        the run config's `precision` section (None: float32); distill_weight: elastic_distill_weight."""
        self.ctx = ctx
        self.data_ranks = ctx.data_ranks if ctx is not None else 1
        if ctx is not None:
            self.optimizer_state_placements = ctx.optimizer_state_placements
        self.precision = precision
        self.fp16 = bool(precision is not None and precision.fp16)
        self.distill_weight = distill_weight

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        """Every micro-batch through each sub-model of the step: with a sandwich [full, smaller],
        the smaller one also learns from the full one's logits (in-place distillation)."""
        sums = StepSums(elastic={"train/elastic_loss": 0.0, "train/elastic_kl": 0.0})
        for b in micro:
            b, weight = self.rows(b)
            teacher = None
            for j, spec in enumerate(specs):
                if len(specs) > 1:
                    apply_elastic(trainer.model, spec)
                teacher = self._pass(trainer, b, micro, n_units, j, teacher, sums, len(specs) > 1, weight)
            if len(specs) > 1:  # the full model again: the bias update and evaluation see it
                apply_elastic(trainer.model, ElasticSpec())
        return sums

    def rows(self, batch: dict) -> tuple[dict, float]:
        """The rows of a global micro-batch this process computes and the weight of their loss
        (every row, weight 1: placements split DistTensor batches by themselves)."""
        return batch, 1.0

    def _pass(
        self,
        trainer,
        b: dict,
        micro: list[dict],
        n_units: int,
        j: int,
        teacher,
        sums: StepSums,
        distil: bool,
        weight: float = 1.0,
    ):
        """One forward and backward; returns the teacher logits for the next sub-model of a sandwich.
        weight: of this process's loss sums (router losses are already its share of the batch's)."""
        stage, units = trainer.stage, max(n_units, 1) / weight
        with amp_context(self.precision):
            out = stage.loss(trainer.model, b)
        trainer.routing.after_forward(b["segment_ids"] > 0)
        lm = out.loss_sum
        if teacher is not None:
            kd = distill_loss_sum(out.logits, teacher, b["labels"], b.get("segment_ids"), stage.token_balance)
            w = self.distill_weight
            lm = (1.0 - w) * lm + w * kd if w > 0 else lm
            sums.elastic["train/elastic_kl"] += scalar(kd) / units
        loss = lm / units
        if out.aux_loss is not None:  # router losses, already weighted by their coefficients
            loss = loss + out.aux_loss / len(micro)
            sums.aux_sum += scalar(out.aux_loss) / len(micro)
        (loss * trainer.loss_scale if self.fp16 else loss).backward()
        if j > 0:
            sums.elastic["train/elastic_loss"] += scalar(out.loss_sum) / units
            return teacher
        sums.loss_sum += scalar(out.loss_sum) * weight
        for k, v in out.metrics.items():
            sums.metrics[k] = sums.metrics.get(k, 0.0) + v / units
        return out.logits.detach() if distil else None

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        grads = reduced_grads(trainer.params)  # multi-process: each gradient reduced once, for both
        return clip_grad_norm_(trainer.clip_params, max_norm, grads), grads

    def agree_stop(self, local: int) -> int:
        """An all-reduce MAX of each rank's request: every rank stops after the same step."""
        if self.ctx is None:
            return local
        import paddle.distributed as dist

        flag = paddle.to_tensor([local], dtype="int64")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.numpy()[0])
