"""Distillation losses between a student's and a teacher's next-token distributions.

Divergences, per trained position, between the temperature-softened distributions
p_s = softmax(z_s / T) and p_t = softmax(z_t / T):

- forward KL  KL(p_t || p_s) = sum p_t (log p_t - log p_s): the student covers the teacher's mass
  (Hinton et al. 2015; the usual "KD" loss);
- reverse KL  KL(p_s || p_t): the student seeks the teacher's modes (MiniLLM);
- generalised Jensen-Shannon with beta (GKD, Agarwal et al. 2024, as TRL's GKDTrainer computes
  it): m = (1 - beta) p_s + beta p_t, JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m);
  beta = 0 is forward KL and beta = 1 reverse KL, as in TRL.

Each is multiplied by T^2 (Hinton's scaling: the gradients keep their size as T changes; at T = 1
the values are GKD's exactly). Only positions whose next token is trained count (the SFT mask), and
the loss is a sum over them: the training loop divides by the number of trained tokens.

A teacher may also come as its top-k log-probabilities (cached to disk for a big teacher): both
distributions are then compared over k + 1 buckets, the teacher's k most likely tokens and "the
rest", which is exact in the rest's total mass and equals the full-vocabulary loss when k is the
vocabulary size (then there is no "rest" bucket at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle

from erniekit.train.losses import shifted_valid

KINDS = ("forward_kl", "reverse_kl", "jsd")
_TAIL_FLOOR = 1e-12  # the rest's probability never reaches exactly 0 (its log would be -inf)


@dataclass
class TopK:
    """A teacher's k most likely next tokens per position: ids [N, k] and their log-probabilities
    [N, k] (of the temperature-softened full distribution), for the N trained positions."""

    ids: np.ndarray
    logp: np.ndarray


def trained_positions(labels: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """Flat indices into [B * S] of the positions whose next token is trained (the same positions
    the cross-entropy counts)."""
    B, S = labels.shape
    valid = np.zeros((B, S), dtype=bool)
    valid[:, :-1] = shifted_valid(labels, segment_ids)
    return np.flatnonzero(valid.reshape(-1))


def gather_positions(logits: paddle.Tensor, flat: np.ndarray) -> paddle.Tensor:
    """logits [B, S, V] -> [N, V] at the flat positions, float32."""
    V = logits.shape[-1]
    return paddle.gather(logits.reshape([-1, V]), paddle.to_tensor(flat, dtype="int64")).astype("float32")


def log_probs(logits: paddle.Tensor, temperature: float = 1.0) -> paddle.Tensor:
    x = logits / temperature if temperature != 1.0 else logits
    return x - paddle.logsumexp(x, axis=-1, keepdim=True)


def _kl(logp: paddle.Tensor, logq: paddle.Tensor) -> paddle.Tensor:
    """KL(p || q) over the last axis, from log-probabilities."""
    return (paddle.exp(logp) * (logp - logq)).sum(axis=-1)


def divergence(student_logp: paddle.Tensor, teacher_logp: paddle.Tensor, kind: str, beta: float = 0.5) -> paddle.Tensor:
    """Per-position divergence [N] of `kind` (KINDS) between two [N, V] log-probability tensors."""
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _kl(teacher_logp, student_logp)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _kl(student_logp, teacher_logp)
    if kind != "jsd":
        raise ValueError(f"distill_loss={kind!r}: choose one of {', '.join(KINDS)}")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"distill_beta={beta}: must be in [0, 1]")
    mixture = paddle.logsumexp(
        paddle.stack([student_logp + math.log(1.0 - beta), teacher_logp + math.log(beta)]), axis=0
    )
    return beta * _kl(teacher_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)


def _with_tail(top_logp: paddle.Tensor) -> paddle.Tensor:
    """[N, k] log-probabilities of k tokens -> [N, k + 1] with the rest's log-probability last."""
    rest = paddle.clip(1.0 - paddle.exp(top_logp).sum(axis=-1, keepdim=True), min=_TAIL_FLOOR)
    return paddle.concat([top_logp, paddle.log(rest)], axis=-1)


def top_k(teacher_logits: paddle.Tensor, k: int, temperature: float = 1.0) -> TopK:
    """The top-k form of a teacher's [N, V] logits (what a cache stores)."""
    logp = log_probs(teacher_logits.astype("float32"), temperature)
    vals, ids = paddle.topk(logp, k=min(k, logp.shape[-1]), axis=-1)
    return TopK(ids.numpy().astype(np.int64), vals.numpy().astype(np.float32))


def topk_loss_sum(
    student_logp: paddle.Tensor,
    teacher_logp: paddle.Tensor,
    vocab: int,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weight: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """T^2 x the divergence over the teacher's k tokens and the rest (k < vocab), summed over
    positions. student_logp / teacher_logp [..., k]: log-probabilities (at temperature T) of the
    teacher's top-k tokens; weight [...]: each position's weight (None: 1). Shared by every layout:
    a plain process, DistTensor batches and the parameter-server head."""
    s, t = student_logp, teacher_logp
    if t.shape[-1] < vocab:  # the tokens outside the k: one bucket, their total mass
        s, t = _with_tail(s), _with_tail(t)
    # at k = V there is no rest: its float32 round-off (1 - sum ~ 1e-7) would weigh
    # log(1e-7 / 1e-12) per position, ~1e-4 of a typical loss
    d = divergence(s, t, kind, beta)
    if weight is not None:
        d = d * weight
    return d.sum() * (temperature * temperature)


def aligned_topk(top: TopK, labels: np.ndarray, segment_ids: np.ndarray | None = None) -> TopK:
    """A TopK at the trained positions -> the same per position of the batch ([B, S, k]); the
    positions that are not trained hold the first k ids at probability 1/k (finite, weighed 0)."""
    B, S = labels.shape
    k = top.ids.shape[1]
    ids = np.broadcast_to(np.arange(k, dtype=np.int64), (B * S, k)).copy()
    logp = np.full((B * S, k), -math.log(k), np.float32)
    flat = trained_positions(labels, segment_ids)
    if top.ids.shape[0] != len(flat):
        raise ValueError(
            f"the teacher's top-k cache has {top.ids.shape[0]} positions for a batch with {len(flat)} "
            "trained positions; rebuild the cache for this data and max_seq_len"
        )
    ids[flat], logp[flat] = top.ids, top.logp
    return TopK(ids.reshape(B, S, k), logp.reshape(B, S, k))


def aligned_distill_loss_sum(
    student_logits: paddle.Tensor,
    teacher_ids: paddle.Tensor,
    teacher_logp: paddle.Tensor,
    weight: paddle.Tensor,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
) -> paddle.Tensor:
    """`distill_loss_sum` against a top-k teacher given per position ([B, S, k], `aligned_topk`)
    and the positions' weights [B, S] (1: trained): no gather of positions, only ops along the
    vocabulary, so it runs on DistTensors split by rows (data ranks) and vocabulary (tp) alike."""
    s = log_probs(_whole_last_axis(student_logits).astype("float32"), temperature)
    s = paddle.take_along_axis(s, teacher_ids, axis=-1)
    return topk_loss_sum(s, teacher_logp, student_logits.shape[-1], kind, beta, temperature, weight)


def _whole_last_axis(t: paddle.Tensor) -> paddle.Tensor:
    """A DistTensor split along its last axis (tensor parallelism's vocabulary-parallel logits), or
    held as partial sums, made whole along it: Paddle 3.3's log-sum-exp and take_along_axis over a
    split axis compute each rank's slice alone (measured: wrong values, no error)."""

    def split(p) -> bool:
        return p.is_shard(t.ndim - 1) or p.is_partial()

    if not t.is_dist() or not any(split(p) for p in t.placements):
        return t
    import paddle.distributed as dist

    whole = [dist.Replicate() if split(p) else p for p in t.placements]
    return dist.reshard(t, t.process_mesh, whole)


def distill_loss_sum(
    student_logits: paddle.Tensor,
    labels: np.ndarray,
    teacher: paddle.Tensor | TopK,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    segment_ids: np.ndarray | None = None,
) -> paddle.Tensor:
    """T^2 x the divergence, summed over the trained positions of `labels`.
    teacher: its logits [B, S, V] (the same positions as the student's; no gradient flows into
    them) or its TopK at the trained positions, in order."""
    flat = trained_positions(labels, segment_ids)
    if len(flat) == 0:
        return student_logits.sum() * 0.0
    s = log_probs(gather_positions(student_logits, flat), temperature)
    if isinstance(teacher, TopK):
        if teacher.ids.shape[0] != len(flat):
            raise ValueError(
                f"the teacher's top-k cache has {teacher.ids.shape[0]} positions for a batch with {len(flat)} "
                "trained positions; rebuild the cache for this data and max_seq_len"
            )
        V = s.shape[-1]
        s = paddle.take_along_axis(s, paddle.to_tensor(teacher.ids), axis=-1)
        return topk_loss_sum(s, paddle.to_tensor(teacher.logp), V, kind, beta, temperature)
    t = log_probs(gather_positions(teacher.detach(), flat), temperature)
    return divergence(s, t, kind, beta).sum() * (temperature * temperature)
