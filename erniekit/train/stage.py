"""What a stage supplies to the shared loop: data rows, a loss, an evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from erniekit.train.losses import causal_lm_loss_sum, count_target_tokens


@dataclass
class LossOutput:
    loss_sum: paddle.Tensor  # summed over trained tokens; the loop divides by the step's token count
    aux_loss: paddle.Tensor | None = None  # MoE load-balancing loss, weighted by router_aux_loss_coef


def model_inputs(batch: dict[str, np.ndarray]) -> dict[str, paddle.Tensor | None]:
    """Tensors for the model; document isolation only where rows really hold several documents."""
    packed = bool((batch["segment_ids"] > 1).any())
    return {
        "input_ids": paddle.to_tensor(batch["input_ids"]),
        "position_ids": paddle.to_tensor(batch["position_ids"]) if packed else None,
        "segment_ids": paddle.to_tensor(batch["segment_ids"]) if packed else None,
    }


class Stage:
    """Base: causal LM on rows of input_ids/labels/position_ids/segment_ids."""

    name = "base"

    def build_train_rows(self, cfg, tokenizer) -> list[dict[str, np.ndarray]]:
        raise NotImplementedError

    def build_eval_data(self, cfg, tokenizer) -> Any:
        return None

    def loss(self, model, batch: dict[str, np.ndarray]) -> LossOutput:
        out = model(**model_inputs(batch))
        seg = batch["segment_ids"] if (batch["segment_ids"] > 1).any() else None
        return LossOutput(causal_lm_loss_sum(out.logits, batch["labels"], seg), out.aux_loss)

    def evaluate(self, model, tokenizer, eval_data, cfg) -> dict[str, float]:
        return {}


@paddle.no_grad()
def eval_loss(model, rows: list[dict[str, np.ndarray]], batch_size: int, pad_id: int) -> dict[str, float]:
    """Token-averaged held-out loss and perplexity."""
    from erniekit.train.batching import collate

    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(rows), batch_size):
        b = collate(rows[i:i + batch_size], pad_id)
        out = model(**model_inputs(b))
        seg = b["segment_ids"] if (b["segment_ids"] > 1).any() else None
        total += float(causal_lm_loss_sum(out.logits, b["labels"], seg))
        n += count_target_tokens(b)
    loss = total / max(n, 1)
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
