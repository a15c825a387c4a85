"""Sequence log-probabilities and the DPO-family preference losses.

Every loss is a per-pair function of four sequence log-probabilities (policy and reference,
chosen ``w`` and rejected ``l``). Notation: ``pi_w = log pi(y_w|x)``, ``ref_w = log
pi_ref(y_w|x)``, ``r_w = pi_w - ref_w``, ``r_l = pi_l - ref_l``, ``h = r_w - r_l``. The
formulas follow TRL's ``DPOTrainer.dpo_loss`` / ``CPOTrainer`` / ``ORPOTrainer`` and the
papers cited per loss; docs/dpo.md has the full table.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from erniekit.errors import ConfigError
from erniekit.train.losses import IGNORE_INDEX, shifted_valid, token_logps

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "orpo", "kto_pair", "sppo_hard", "nca_pair", "dpop")
# losses defined on per-token AVERAGE log-probs (TRL and PaddleFormers average for these)
LENGTH_NORMALISED = ("ipo", "simpo", "orpo")
# losses that never look at a reference model
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# losses with a label-smoothing (conservative) form
SMOOTHED = ("sigmoid", "simpo")


def sequence_logps(
    logits: paddle.Tensor, labels, segment_ids: np.ndarray | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Sum of log p(labels[t+1] | ..t) over trained targets per row, and their count.

    logits [B, S, V]; labels [B, S] (numpy or paddle, -100 = not trained, NOT pre-shifted).
    Returns (sum_logp [B] float32 with gradient, n_tokens [B] float32). The targets are
    shifted instead of the logits and the fused cross-entropy kernel is used: Paddle's CPU
    log_softmax and slice backward are each ~10-30x slower (measured).
    """
    labels = labels.numpy() if isinstance(labels, paddle.Tensor) else np.asarray(labels)
    valid = shifted_valid(labels, segment_ids)
    target = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    target[:, :-1] = np.where(valid, labels[:, 1:], IGNORE_INDEX)
    return token_logps(logits, target).sum(axis=1), paddle.to_tensor(valid.sum(axis=1).astype("float32"))


def needs_reference(loss_type: str, reference_free: bool = False) -> bool:
    """Whether the stage must run a reference model for this loss."""
    return not reference_free and loss_type not in REFERENCE_FREE_LOSSES


def _tensor(x) -> paddle.Tensor:
    return x if isinstance(x, paddle.Tensor) else paddle.to_tensor(np.asarray(x, dtype="float32"))


def _log1m_exp(x: paddle.Tensor) -> paddle.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 (x is clipped to -1e-6 to stay finite)."""
    return paddle.log(-paddle.expm1(x.clip(max=-1e-6)))


def _check(loss_type: str, beta: float, label_smoothing: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"unknown loss_type '{loss_type}'; use one of {', '.join(LOSS_TYPES)}")
    if not beta > 0:
        raise ConfigError(f"beta={beta}; the preference loss needs beta > 0 (typical 0.1)")
    if not 0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing={label_smoothing}; use a value in [0, 0.5)")
    if label_smoothing and loss_type not in SMOOTHED:
        raise ConfigError(f"label_smoothing applies to loss_type sigmoid or simpo, not '{loss_type}'; set it to 0")


def preference_loss(
    loss_type: str,
    policy_chosen_logps: paddle.Tensor,
    policy_rejected_logps: paddle.Tensor,
    ref_chosen_logps: paddle.Tensor | None = None,
    ref_rejected_logps: paddle.Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    *,
    chosen_lengths=None,
    rejected_lengths=None,
    length_normalize: bool | None = None,
    simpo_gamma: float = 0.5,
    dpop_lambda: float = 50.0,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Per-pair loss [B] and the detached implicit rewards of chosen and rejected [B].

    Inputs are per-sequence SUMMED log-probs (``sequence_logps``). ``length_normalize``
    (default: True for ipo, simpo, orpo) divides policy and reference log-probs by
    ``chosen_lengths`` / ``rejected_lengths`` (the n_tokens of ``sequence_logps``); pass
    ``length_normalize=False`` when the inputs are already averages. ``reference_free=True``
    treats the reference log-probs as 0 (they may then be None); simpo and orpo never use them.

    Rewards: ``beta * (pi - ref)`` per sequence (after length normalisation), except simpo
    and orpo whose reward is ``beta * pi`` (their implicit reward, as TRL's CPO/ORPO).
    ``kto_pair`` returns the mean of its chosen and rejected halves per pair, so
    ``losses.mean()`` equals TRL's mean over the concatenated 2B halves. ``orpo`` returns only
    the odds-ratio term ``-beta * log sigmoid(log_odds)``: the caller adds the chosen SFT NLL
    (token mean), ``loss = nll + losses.mean()`` (beta plays ORPO's lambda, as in TRL).
    """
    _check(loss_type, beta, label_smoothing)
    pi_w, pi_l, ref_w, ref_l = _log_probs(
        loss_type,
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        reference_free,
        chosen_lengths,
        rejected_lengths,
        length_normalize,
    )
    losses = _pair_losses(loss_type, pi_w, pi_l, ref_w, ref_l, beta, label_smoothing, simpo_gamma, dpop_lambda)
    if loss_type in REFERENCE_FREE_LOSSES:
        return losses, (beta * pi_w).detach(), (beta * pi_l).detach()
    return losses, (beta * (pi_w - ref_w)).detach(), (beta * (pi_l - ref_l)).detach()


def _log_probs(
    loss_type,
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    reference_free,
    chosen_lengths,
    rejected_lengths,
    length_normalize,
):
    """Policy and reference log-probs as tensors, zeros for an unused reference, length-averaged
    where the loss type (or length_normalize) asks for it."""
    pi_w, pi_l = _tensor(policy_chosen_logps), _tensor(policy_rejected_logps)
    if needs_reference(loss_type, reference_free):
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type '{loss_type}' needs reference log-probs; pass them or set reference_free=True")
        ref_w, ref_l = _tensor(ref_chosen_logps), _tensor(ref_rejected_logps)
    else:
        ref_w, ref_l = paddle.zeros_like(pi_w), paddle.zeros_like(pi_l)
    normalize = loss_type in LENGTH_NORMALISED if length_normalize is None else length_normalize
    if normalize:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                f"loss_type '{loss_type}' uses length-averaged log-probs: pass chosen_lengths/rejected_lengths "
                "(n_tokens from sequence_logps), or length_normalize=False if the inputs are already averages"
            )
        n_w = _tensor(chosen_lengths).astype("float32").clip(min=1)
        n_l = _tensor(rejected_lengths).astype("float32").clip(min=1)
        pi_w, ref_w, pi_l, ref_l = pi_w / n_w, ref_w / n_w, pi_l / n_l, ref_l / n_l
    return pi_w, pi_l, ref_w, ref_l


def _pair_losses(loss_type, pi_w, pi_l, ref_w, ref_l, beta, ls, simpo_gamma, dpop_lambda):
    """The per-pair loss of each loss type (formulas: docs/dpo.md)."""
    r_w, r_l = pi_w - ref_w, pi_l - ref_l
    h = r_w - r_l
    if loss_type == "sigmoid":
        losses = -F.log_sigmoid(beta * h) * (1 - ls) - F.log_sigmoid(-beta * h) * ls
    elif loss_type == "hinge":
        losses = F.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "simpo":
        z = beta * (pi_w - pi_l) - simpo_gamma
        losses = -F.log_sigmoid(z) * (1 - ls) - F.log_sigmoid(-z) * ls
    elif loss_type == "orpo":
        log_odds = (pi_w - pi_l) - (_log1m_exp(pi_w) - _log1m_exp(pi_l))
        losses = -beta * F.log_sigmoid(log_odds)
    elif loss_type == "kto_pair":
        kl_w, kl_l = r_w.mean().clip(min=0), r_l.mean().clip(min=0)
        losses = ((1 - F.sigmoid(beta * (r_w - kl_l))) + (1 - F.sigmoid(beta * (kl_w - r_l)))) / 2
    elif loss_type == "sppo_hard":
        losses = (r_w - 0.5 / beta) ** 2 + (r_l + 0.5 / beta) ** 2
    elif loss_type == "nca_pair":
        losses = -F.log_sigmoid(beta * r_w) - 0.5 * F.log_sigmoid(-beta * r_w) - 0.5 * F.log_sigmoid(-beta * r_l)
    else:  # dpop
        losses = -F.log_sigmoid(beta * (h - dpop_lambda * F.relu(ref_w - pi_w)))
    return losses
