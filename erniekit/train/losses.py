"""Token-level causal LM loss, summed so gradient accumulation can divide by the true token count."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from erniekit.nn import cross_entropy, linear_cross_entropy, native

IGNORE_INDEX = -100


def batch_tensor(x: np.ndarray) -> paddle.Tensor:
    """A global-batch array as a tensor, rows split over the data ranks in a multi-process run."""
    from erniekit.distributed.collective.runtime import place_batch

    return place_batch(paddle.to_tensor(x))


def shifted_valid(labels: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """Mask of the positions t whose target labels[t+1] is trained ([B, S-1]); a target in
    another packed document than position t is not predictable and is excluded."""
    valid = labels[:, 1:] != IGNORE_INDEX
    if segment_ids is not None:
        valid &= segment_ids[:, 1:] == segment_ids[:, :-1]
    return valid


def count_target_tokens(batch: dict[str, np.ndarray]) -> int:
    return int(shifted_valid(batch["labels"], batch.get("segment_ids")).sum())


def next_token_targets(labels: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """[B, S] targets aligned with the logits: labels[t+1] where position t trains, else IGNORE_INDEX."""
    valid = shifted_valid(labels, segment_ids)
    target = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    target[:, :-1] = np.where(valid, labels[:, 1:], IGNORE_INDEX)  # shift the targets, not the logits
    return target


def causal_lm_loss_sum(
    logits: paddle.Tensor, labels: np.ndarray, segment_ids: np.ndarray | None = None
) -> paddle.Tensor:
    """Sum over trained positions of -log p(labels[t+1] | ..t); logits [B, S, V]."""
    target = next_token_targets(labels, segment_ids)
    return token_nll(logits.astype("float32").reshape([-1, logits.shape[-1]]), target).sum()


def head_fusable(model) -> bool:
    """Whether `head_loss_sum` can take this model's head: a plain product by a dense float32 CPU
    weight (the hidden states are checked when they come)."""
    hw = getattr(model, "head_weight", lambda: None)()
    return hw is not None and native.dense_cpu_float32(hw[0])


def head_loss_sum(
    model, hidden: paddle.Tensor, labels: np.ndarray, segment_ids: np.ndarray | None = None
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """(`causal_lm_loss_sum` of the model's head on `hidden` [B, S, H], the logits or None): chunk
    by chunk without the [B x S, V] logits (erniekit/nn/linear_cross_entropy.py) when the hidden
    states are dense float32 CPU ones, else through the whole logits, which it then returns."""
    w, vocab_first = model.head_weight()
    flat = hidden.reshape([-1, hidden.shape[-1]])
    if not linear_cross_entropy.usable(flat, w):
        logits = model.head(hidden)
        return causal_lm_loss_sum(logits, labels, segment_ids), logits
    target = next_token_targets(labels, segment_ids).reshape(-1)
    return linear_cross_entropy.linear_cross_entropy(flat, w, target, IGNORE_INDEX, vocab_first).sum(), None


def token_nll(logits: paddle.Tensor, target: np.ndarray) -> paddle.Tensor:
    """-log p(target) per row of logits [N, V] (0 where target is IGNORE_INDEX), by a fused
    softmax-cross-entropy over unsliced logits: Paddle's CPU log_softmax and slice backward are
    each ~10-30x slower than its kernel (measured), and float32 CPU logits take erniekit's, which
    also skips writing the softmax (nn/cross_entropy.py)."""
    if cross_entropy.usable(logits):
        return cross_entropy.softmax_cross_entropy(logits, target, IGNORE_INDEX)
    nll = F.cross_entropy(logits, batch_tensor(target.reshape(-1, 1)), ignore_index=IGNORE_INDEX, reduction="none")
    return nll.reshape([-1])  # [N] as the kernel's


def token_logps(logits: paddle.Tensor, targets: np.ndarray, temperature: float = 1.0) -> paddle.Tensor:
    """log p(targets[b, t] | logits[b, t]) as [B, S] (targets already aligned with the logits); 0
    where targets == -100. Through the fused softmax-cross-entropy kernel: Paddle's CPU
    log_softmax backward is ~30x slower (measured). Shared by DPO scoring and the RL stages."""
    B, S, V = logits.shape
    x = logits.astype("float32")
    if temperature != 1.0:
        x = x / temperature
    return -token_nll(x.reshape([-1, V]), targets).reshape([B, S])


def _example_ids(labels: np.ndarray, segment_ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(example id per shifted position [B, S-1], -1 where not trained; trained positions per
    example). An example is one (row, document) pair: packed rows hold several."""
    valid = shifted_valid(labels, segment_ids)
    seg = np.ones_like(labels) if segment_ids is None else segment_ids
    width = int(seg.max()) + 1 if seg.size else 1
    key = np.arange(labels.shape[0])[:, None] * width + seg[:, :-1]
    ex = np.where(valid, key, -1)
    _, inverse, counts = np.unique(ex[valid], return_inverse=True, return_counts=True)
    out = np.full(ex.shape, -1, np.int64)
    out[valid] = inverse
    return out, counts


def count_examples(batch: dict[str, np.ndarray]) -> int:
    """Examples with at least one trained target: the normaliser of the token-balanced loss."""
    return int(_example_ids(batch["labels"], batch.get("segment_ids"))[1].size)


def position_weights(
    labels: np.ndarray, segment_ids: np.ndarray | None = None, token_balance: bool = False
) -> np.ndarray:
    """Weight of position t's prediction of labels[t+1] ([B, S], float32): 1 where trained, or
    1/N_i with token_balance (N_i = example i's trained targets); 0 elsewhere. Summed weighted
    losses then divide by `count_target_tokens` or `count_examples` like the LM loss."""
    weight = np.zeros(labels.shape, np.float32)
    if token_balance:
        ex, counts = _example_ids(labels, segment_ids)
        weight[:, :-1] = np.where(ex >= 0, 1.0 / counts[np.maximum(ex, 0)], 0.0)
    else:
        weight[:, :-1] = shifted_valid(labels, segment_ids)
    return weight


def token_balanced_loss_sum(
    logits: paddle.Tensor, labels: np.ndarray, segment_ids: np.ndarray | None = None
) -> paddle.Tensor:
    """Multimodal token-balanced loss (ERNIE 4.5), summed over examples: sum_i (1/N_i) sum_{t in i} nll_t,
    where N_i counts example i's trained targets. Divided by the number of examples (`count_examples`)
    it is the mean over examples of each example's own mean NLL, so an example with few text
    targets weighs as much as a long one instead of being drowned out by a global token average."""
    weight = position_weights(labels, segment_ids, token_balance=True)
    target = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    target[:, :-1] = np.where(weight[:, :-1] > 0, labels[:, 1:], IGNORE_INDEX)
    nll = token_nll(logits.astype("float32").reshape([-1, logits.shape[-1]]), target)
    return (nll.reshape([-1]) * batch_tensor(weight.reshape(-1))).sum()


def distill_loss_sum(
    student_logits: paddle.Tensor,
    teacher_logits: paddle.Tensor,
    labels: np.ndarray,
    segment_ids: np.ndarray | None = None,
    token_balance: bool = False,
) -> paddle.Tensor:
    """sum_t w_t KL(p_teacher,t || p_student,t) over the trained positions (weights as the LM loss,
    `position_weights`), temperature 1; no gradient reaches the teacher. In-place distillation of
    elastic sub-models from the full model (docs/elastic.md).

    Computed as the fused soft-label cross-entropy minus the teacher's entropy (a constant for the
    student), so the value is the KL and the gradient is that of the cross-entropy; Paddle's CPU
    log_softmax backward is ~30x slower than the fused kernel (measured)."""
    V = student_logits.shape[-1]
    w = batch_tensor(position_weights(labels, segment_ids, token_balance).reshape(-1))
    with paddle.no_grad():
        t = teacher_logits.astype("float32").reshape([-1, V])
        p = F.softmax(t, axis=-1)
        entropy = -(p * F.log_softmax(t, axis=-1)).sum(axis=-1)
    ce = F.cross_entropy(student_logits.astype("float32").reshape([-1, V]), p, soft_label=True, reduction="none")
    return ((ce.reshape([-1]) - entropy) * w).sum()
