"""Pipeline-parallel ranks of a collective job: this rank runs its segment of the layers in the
1F1B order (erniekit/train/pipeline_schedule.py); norms, sums and checkpoints span the segments."""

from __future__ import annotations

from erniekit.train.pipeline_schedule import PipelineStep
from erniekit.train.runners.base import StepSums
from erniekit.train.runners.local import LocalRunner, amp_context


class PipelineRunner(LocalRunner):
    name = "pipeline"
    partial = True

    def __init__(self, ctx, model, token_balance: bool, precision=None):
        super().__init__(ctx, precision)
        self.pipe = PipelineStep(ctx.pipeline, model, token_balance)

    def bind(self, trainer) -> None:
        """A stage whose loss is not the LM loss gives it from the last stage's logits (`logits_loss`)."""
        super().bind(trainer)
        self.pipe.batch_loss = getattr(trainer.stage, "logits_loss", None)

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        loss_sum, aux_sum = self.pipe.run(
            micro,
            n_units,
            trainer.loss_scale if self.fp16 else 1.0,
            amp=lambda: amp_context(self.precision),
            on_forward=lambda b: trainer.routing.after_forward(b["segment_ids"] > 0),
        )
        self.pipe.topo.reduce_grads(self.named_params)
        return StepSums(loss_sum=loss_sum, aux_sum=aux_sum)

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        return self.pipe.clip_grad_norm_(self.named_params, max_norm), None

    def eval_loss(self, trainer) -> dict[str, float]:
        """Held-out loss through the segments (config checks refuse generation here)."""
        data = trainer.eval_data
        rows = data["rows"] if isinstance(data, dict) else data
        return self.pipe.eval_loss(rows, trainer.eval_batch_size, trainer.tokenizer.pad_token_id)

    def model_state(self, model):
        from erniekit.models.registry import model_state

        return self.full_tensors(model_state(model))

    def full_tensors(self, tensors):
        return self.pipe.topo.gather_to_main(tensors)
