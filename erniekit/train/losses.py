"""Token-level causal LM loss, summed so gradient accumulation can divide by the true token count."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

IGNORE_INDEX = -100


def shifted_valid(labels: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """Mask of the positions t whose target labels[t+1] is trained ([B, S-1]); a target in
    another packed document than position t is not predictable and is excluded."""
    valid = labels[:, 1:] != IGNORE_INDEX
    if segment_ids is not None:
        valid &= segment_ids[:, 1:] == segment_ids[:, :-1]
    return valid


def count_target_tokens(batch: dict[str, np.ndarray]) -> int:
    return int(shifted_valid(batch["labels"], batch.get("segment_ids")).sum())


def causal_lm_loss_sum(logits: paddle.Tensor, labels: np.ndarray, segment_ids: np.ndarray | None = None) -> paddle.Tensor:
    """Sum over trained positions of -log p(labels[t+1] | ..t); logits [B, S, V]."""
    valid = shifted_valid(labels, segment_ids)
    target = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    target[:, :-1] = np.where(valid, labels[:, 1:], IGNORE_INDEX)  # shift the targets, not the logits
    V = logits.shape[-1]
    # fused softmax-cross-entropy over unsliced logits: Paddle's CPU log_softmax and slice
    # backward are each ~10-30x slower than this kernel (measured)
    nll = F.cross_entropy(logits.astype("float32").reshape([-1, V]), paddle.to_tensor(target.reshape(-1, 1)),
                          ignore_index=IGNORE_INDEX, reduction="none")
    return nll.sum()
