"""The multi-token prediction (MTP) loss (docs/mtp.md), added to the next-token loss of LM stages.

    L = L_main + lambda * (1/D) * sum_j L_j,    L_j = sum over trained positions i of -log p_j(t[i+j+1] | h_j[i])

Depth j's target at position i is labels[i+j+1]; it is trained only when that label is not -100
and lies in the same packed document as position i. Like the main loss, each L_j is a sum that the
training loop divides by the step's units (the main loss's trained targets, or examples with
loss_token_balance), so lambda weighs the MTP terms on the main loss's scale.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import paddle

from erniekit.train.losses import IGNORE_INDEX


def depth_labels(labels: np.ndarray, segment_ids: np.ndarray | None, depth: int) -> np.ndarray:
    """Labels that make the next-token loss functions (which read labels[t+1] at position t and
    require segment_ids[t+1] == segment_ids[t]) train depth `depth` (1-based): out[t+1] =
    labels[t+1+depth], or -100 when that target is past the row or in another document than t."""
    B, S = labels.shape
    seg = np.ones_like(labels) if segment_ids is None else segment_ids
    out = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    if depth + 1 >= S:
        return out
    same_doc = seg[:, : S - 1 - depth] == seg[:, 1 + depth :]  # position t vs its target t+1+depth
    out[:, 1 : S - depth] = np.where(same_doc, labels[:, 1 + depth :], IGNORE_INDEX)
    return out


def mtp_loss_sums(
    mtp_logits: list[paddle.Tensor], batch: dict[str, np.ndarray], loss_fn: Callable[..., paddle.Tensor]
) -> list[paddle.Tensor]:
    """L_j (summed, not yet normalised) for j = 1..D, with the same loss function as the main loss."""
    seg = batch.get("segment_ids")
    return [loss_fn(lg, depth_labels(batch["labels"], seg, j + 1), seg) for j, lg in enumerate(mtp_logits)]


def wants_mtp(model) -> bool:
    """MTP logits are computed only while training a model that has MTP heads."""
    return bool(model.training and getattr(model.config, "num_nextn_predict_layers", 0) > 0)


def add_mtp_loss(
    out,
    mtp_logits: list[paddle.Tensor],
    batch: dict[str, np.ndarray],
    loss_fn: Callable[..., paddle.Tensor],
    weight: float,
):
    """Add lambda * mean_j L_j to `out.loss_sum` (a LossOutput) and log the mean as metric `mtp_loss`."""
    sums = mtp_loss_sums(mtp_logits, batch, loss_fn)
    mean = paddle.add_n(sums) / len(sums)
    out.loss_sum = out.loss_sum + weight * mean
    out.metrics["mtp_loss"] = out.metrics.get("mtp_loss", 0.0) + float(mean)
    return out
