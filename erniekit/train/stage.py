"""What a stage supplies to the shared loop: data rows, a loss, an evaluation."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from erniekit.config.checks import fused_head_wanted
from erniekit.train.losses import (
    batch_tensor,
    causal_lm_loss_sum,
    count_examples,
    count_target_tokens,
    head_fusable,
    head_loss_sum,
    token_balanced_loss_sum,
)
from erniekit.train.mtp_loss import add_mtp_loss, wants_mtp
from erniekit.utils.dtensor import scalar


@dataclass(frozen=True)
class Supports:
    """What a stage can run with. Config validation (erniekit/config/checks.py) reads it, so a
    stage states its limits in one place and its error messages name the stages that can."""

    pipeline: bool = False  # pipeline_parallel_degree > 1 (layers split over processes)
    parameter_server: bool = False  # distributed_mode: ps
    packing: bool = False  # packing: true (several examples per row)
    elastic: bool = False  # elastic_depth / elastic_experts / elastic_top_k sub-models
    elastic_sandwich: bool = False  # the sandwich rule with in-place distillation of an LM loss
    token_balance: bool = False  # loss_token_balance
    rollouts: bool = False  # RL: sampled generations scored by rewards (the RL keys apply)
    row_losses: bool = False  # its loss is a sum over batch rows: data-parallel ranks run whole-model replicas
    images: bool = False  # trains on pictures: synthetic picture datasets; plain data parallelism only (this version)
    online_distill: bool = False  # online_distill_students: students trained beside it (docs/online_distillation.md)
    fused_head: bool = False  # fused_head_loss: its LM loss takes the head chunk by chunk (lm_loss)
    min_generations: int = 1  # num_generations below this is refused


LM = Supports(
    pipeline=True,
    parameter_server=True,
    packing=True,
    elastic=True,
    elastic_sandwich=True,
    token_balance=True,
    row_losses=True,
    online_distill=True,
    fused_head=True,
)  # the causal-LM stages (pretrain, SFT)


@dataclass
class LossOutput:
    loss_sum: paddle.Tensor  # summed over the batch's units; the loop divides by the step's `normalizer`
    aux_loss: paddle.Tensor | None = None  # MoE load-balancing loss, weighted by router_aux_loss_coef
    metrics: dict[str, float] = field(default_factory=dict)  # sums over units, averaged like the loss
    logits: paddle.Tensor | None = None  # LM stages: the next-token logits (teacher of elastic sub-models)
    hidden: paddle.Tensor | None = None  # LM stages: the final normed hidden states (online distillation's hints)


def model_inputs(batch: dict[str, np.ndarray]) -> dict[str, paddle.Tensor | None]:
    """Tensors for the model; document isolation only where rows really hold several documents."""
    packed = bool((batch["segment_ids"] > 1).any())
    inputs = {
        "input_ids": batch_tensor(batch["input_ids"]),
        "position_ids": batch_tensor(batch["position_ids"]) if packed else None,
        "segment_ids": batch_tensor(batch["segment_ids"]) if packed else None,
    }
    if "token_type_ids" in batch:  # modality id per token, for modality-isolated MoE routing
        inputs["token_type_ids"] = batch_tensor(batch["token_type_ids"])
    return inputs


def lm_loss(model, batch: dict[str, np.ndarray], token_balance: bool = False, fused_head: bool = False) -> LossOutput:
    """Summed next-token loss over trained targets; a target in another document is never trained
    (segment_ids: 0 padding, 1.. documents), matching `count_target_tokens`. token_balance: each
    example's loss is its mean over its own targets (summed over examples, see `count_examples`).
    fused_head: the head and its loss chunk by chunk, without logits (`LossOutput.logits` is None),
    where the head allows it (`head_fusable`); the caller says nothing needs the logits."""
    mtp = wants_mtp(model)  # multi-token prediction heads: docs/mtp.md (they read the logits)
    fused = not mtp and takes_fused_head(model, fused_head, token_balance)
    out = model(
        **model_inputs(batch), **({"return_mtp": True} if mtp else {}), **({"skip_head": True} if fused else {})
    )
    loss_fn = token_balanced_loss_sum if token_balance else causal_lm_loss_sum
    loss_sum, out.logits = next_token_loss_sum(model, out, batch, loss_fn, fused)
    res = LossOutput(loss_sum, out.aux_loss, logits=out.logits, hidden=out.hidden_states)
    if mtp:
        add_mtp_loss(res, out.mtp_logits, batch, loss_fn, model.config.multi_token_pred_lambda)
    return res


def takes_fused_head(model, fused_head: bool, token_balance: bool) -> bool:
    """Whether a loss takes the head chunk by chunk: asked for, without the token-balanced loss (it
    reads each example's logits), on a head `head_loss_sum` can take (`head_fusable`)."""
    return fused_head and not token_balance and head_fusable(model)


def next_token_loss_sum(model, out, batch: dict[str, np.ndarray], loss_fn, fused: bool):
    """(summed loss, logits or None) of a forward `out` made with skip_head=`fused`: the head chunk
    by chunk (`head_loss_sum`), else `loss_fn` on the logits."""
    if fused:
        return head_loss_sum(model, out.hidden_states, batch["labels"], batch["segment_ids"])
    return loss_fn(out.logits, batch["labels"], batch["segment_ids"]), out.logits


class Stage:
    """Base: causal LM on rows of input_ids/labels/position_ids/segment_ids."""

    name = "base"
    aliases: tuple[str, ...] = ()  # other spellings accepted for `stage:` (pretrain: PT)
    supports = Supports()
    token_balance = False  # loss_token_balance, set in `prepare`: loss averaged per example, then over examples
    fused_head = False  # fused_head_loss, set in `prepare`: lm_loss without the batch's logits
    progress_keys: dict[str, str] = {}  # extra progress-bar fields: short name -> metric key (RL: reward)
    # the control attributes the model was trained on, saved beside it (docs/control.md): the starting
    # model's, unless the stage adds its data's (SFT, GRPO, PPO)
    control_record: dict | None = None
    _starting_record: tuple[str | None, dict | None] | None = None  # (model_name_or_path, its record), read once

    def build_train_rows(self, cfg, tokenizer) -> list[dict[str, np.ndarray]]:
        raise NotImplementedError

    def build_eval_data(self, cfg, tokenizer) -> Any:
        return None

    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        """Called once before training, while `model` still holds the starting weights (before a
        resume loads a checkpoint): where a stage computes what depends on the reference model."""
        self.token_balance = bool(getattr(cfg, "loss_token_balance", False))
        self.fused_head = self.supports.fused_head and fused_head_wanted(cfg)
        if self.control_record is None:  # what the starting model learnt goes on with it (DPO, Distill...)
            self.control_record = self.starting_control_record(cfg)

    def starting_control_record(self, cfg) -> dict | None:
        """The starting model's (model_name_or_path's) control record, read once: a stage that asks for
        it while it reads its data (RL) finds a damaged file before the model loads (docs/control.md)."""
        path = getattr(cfg, "model_name_or_path", None)
        if self._starting_record is None or self._starting_record[0] != path:
            from erniekit.data.control import read_control_record

            self._starting_record = (path, read_control_record(path))
        return self._starting_record[1]

    def check_held_out_controls(self, convs: list, cfg) -> None:
        """Held-out conversations' control attributes against what the model learnt (with do_train: this
        run's record, the starting model's plus the training data's; else the starting model's): a
        misspelled attribute would be scored as a prefix the model never trained on."""
        from erniekit.data.control import CONTROL_RECORD_NAME, check_conversation_controls

        if cfg.do_train:
            record, source = self.control_record, "trained: train_dataset_path and model_name_or_path's record"
        else:
            record = self.starting_control_record(cfg)
            source = f"{cfg.model_name_or_path}/{CONTROL_RECORD_NAME}"
        check_conversation_controls(convs, record, f"eval_dataset_path {cfg.eval_dataset_path}", source)

    def collate(self, rows: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
        from erniekit.train.batching import collate

        return collate(rows, pad_id)

    def normalizer(self, batch: dict[str, np.ndarray]) -> int:
        """Units the loss is averaged over: trained tokens here (examples with loss_token_balance),
        pairs for preference stages."""
        return count_examples(batch) if self.token_balance else count_target_tokens(batch)

    def loss(self, model, batch: dict[str, np.ndarray]) -> LossOutput:
        return lm_loss(model, batch, self.token_balance, self.fused_head)

    def evaluate(self, model, tokenizer, eval_data, cfg) -> dict[str, float]:
        return {}

    def eval_fused_head(self, cfg) -> bool:
        """Whether held-out losses take the head chunk by chunk: fused_head_loss on a stage that
        takes it; what keeps training's logits (the sandwich, students, token balance) reads none here."""
        return self.supports.fused_head and bool(getattr(cfg, "fused_head_loss", False))

    def eval_lm_loss(self, model, rows: list[dict[str, np.ndarray]], cfg, tokenizer) -> dict[str, float]:
        """`eval_loss` of LM rows with the head's loss chunked as in training (`fused_head_loss`): an
        eval batch's whole logits can outgrow the training step's (8 x 4096 tokens of a 103,424-id
        vocabulary: 13.5 GB)."""
        return eval_loss(
            model,
            rows,
            cfg.per_device_eval_batch_size,
            tokenizer.pad_token_id,
            loss=functools.partial(lm_loss, fused_head=self.eval_fused_head(cfg)),
        )

    # ---- hooks the loop calls; RL stages use them (erniekit/train/rl_stage.py) ----------------------
    def step_batches(self, model, micro: list[dict[str, np.ndarray]], step: int) -> list[dict[str, np.ndarray]]:
        """The micro-batches optimizer step `step` trains on, from the collated data rows: RL
        stages turn prompts into scored rollouts here."""
        return micro

    def step_metrics(self) -> dict[str, float]:
        """Scalars of the step just taken, beyond loss and lr (logged with them)."""
        return {}

    def lr_ratios(self, cfg) -> dict[str, float]:
        """Parameter-name prefix -> learning-rate ratio (parts of the model that learn slower or faster)."""
        return {}

    def extra_named_parameters(self) -> list[tuple[str, paddle.Tensor]]:
        """Trainable parameters that live outside the model (a PPO value head)."""
        return []

    def checkpoint_tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        """Files (name -> tensors) the stage adds to every checkpoint."""
        return {}

    def load_checkpoint_tensors(self, path: str) -> None:
        """Restore what `checkpoint_tensors` saved, on resume."""

    # ---- other models trained in the same steps (online-distillation students) ----------------------
    def grad_groups(self) -> dict[str, list[paddle.Tensor]]:
        """Name -> parameters of `extra_named_parameters` that form a model of their own: the loop
        clips each group by its own norm (logged as train/NAME/grad_norm) and the model's gradients
        without them, so one model's gradients never scale another's update."""
        return {}

    def idle_groups(self, step: int) -> set[str]:
        """Names of `grad_groups` that do not learn in optimizer step `step` (0-based): the optimizer
        leaves their parameters as they are."""
        return set()

    def save_final(self, output_dir: str, tokenizer) -> None:
        """At the end of the run, beside the model: what the stage trained besides it."""

    def report_lines(self, results: dict[str, float], start: dict[str, float] | None) -> list[str]:
        """Lines for the end-of-run report from the final held-out `results` (start: the first
        evaluation's, when the run made one)."""
        return []

    def model_tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        """Files (name -> tensors) saved next to the final model in output_dir (a credibility head)."""
        return {}


@paddle.no_grad()
def eval_loss(
    model, rows: list[dict[str, np.ndarray]], batch_size: int, pad_id: int, collate=None, loss=None
) -> dict[str, float]:
    """Token-averaged held-out loss and perplexity. collate / loss: a stage's own (default: the
    LM's)."""
    if collate is None:
        from erniekit.train.batching import collate
    loss = lm_loss if loss is None else loss

    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(rows), batch_size):
        b = collate(rows[i : i + batch_size], pad_id)
        total += scalar(loss(model, b).loss_sum)
        n += count_target_tokens(b)
    loss = total / max(n, 1)
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
