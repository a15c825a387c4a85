"""Credibility scores at inference: real replies vs replies the model samples, the ROC AUC between
them (`erniekit eval --credibility`, the end of an SFT run with credibility_loss_weight > 0), and
re-ranking sampled answers by their score (`erniekit chat --rerank N`).

A reply is scored as training scores it (erniekit/nn/credibility.py): its conversation is encoded
exactly as SFT encodes it, the reply being the text of the real or the sampled answer, and the head
reads the hidden state of the reply's last token (the template's end-of-turn token).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle

from erniekit.data.encode import IGNORE_INDEX, encode_conversation
from erniekit.data.formats import Conversation
from erniekit.errors import DataError
from erniekit.nn.credibility import CredibilityHead, sequence_logits

DEFAULT_TEMPERATURE = 1.0  # sampled replies of the report: the model's own distribution


def reply_sequence(conv: Conversation, reply: str, tokenizer) -> list[int]:
    """Ids of `conv` with its last reply replaced by `reply`, up to the reply's end-of-turn token."""
    user = conv.turns[-1][0]
    turns = [*conv.turns[:-1], (user, reply)]
    flags = [False] * (len(turns) - 1) + [True]
    ids, labels = encode_conversation(dataclasses.replace(conv, turns=turns, train_on=flags), tokenizer, 10**9)
    trained = np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)
    return ids[: int(trained[-1]) + 1]


def prompt_sequence(conv: Conversation, tokenizer) -> list[int]:
    """Ids of everything before the last reply (the generation prompt included)."""
    flags = [False] * (len(conv.turns) - 1) + [True]
    ids, labels = encode_conversation(dataclasses.replace(conv, train_on=flags), tokenizer, 10**9)
    return ids[: int(np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)[0])]


def sample_replies(
    model,
    tokenizer,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int | None = None,
    top_p: float = 1.0,
) -> list[str]:
    """One sampled reply text per prompt. seed: reseeds paddle first (None: the current RNG state,
    as training's per-step seed leaves it)."""
    from erniekit.infer.generate import SamplingParams, generate
    from erniekit.infer.stops import decodable_vocab, stop_ids

    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=stop_ids(model, tokenizer),
        seed=seed,
    )
    out: list[str] = []
    vocab = decodable_vocab(model, tokenizer)
    for i in range(0, len(prompts), batch_size):
        ids = generate(model, prompts[i : i + batch_size], params, pad_id=tokenizer.pad_token_id or 0, vocab=vocab)
        params = dataclasses.replace(params, seed=None)  # one seed for the whole report, not per batch
        out += [tokenizer.decode(o).strip() for o in ids]
    return out


@paddle.no_grad()
def score_sequences(
    model, head: CredibilityHead, sequences: list[list[int]], pad_id: int, batch_size: int
) -> np.ndarray:
    """Credibility logits of whole sequences (see reply_sequence), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        parts = [
            sequence_logits(model, head, sequences[i : i + batch_size], pad_id).numpy()
            for i in range(0, len(sequences), batch_size)
        ]
    finally:
        if was_training:
            model.train()
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def roc_auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2: the
    Mann-Whitney U statistic from average ranks, O(n log n)."""
    pos, neg = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if not len(pos) or not len(neg):
        raise ValueError(f"roc_auc needs both classes, got {len(pos)} positive and {len(neg)} negative scores")
    scores = np.concatenate([pos, neg])
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # average rank (1-based) of each run of tied scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


def _summary(x: np.ndarray) -> dict[str, float]:
    if not len(x):
        return {"n": 0}
    q = np.quantile(x, [0.1, 0.5, 0.9])
    return {
        "n": int(len(x)),
        "mean": float(x.mean()),
        "std": float(x.std()),
        "p10": float(q[0]),
        "median": float(q[1]),
        "p90": float(q[2]),
    }


def credibility_report(
    model,
    head: CredibilityHead,
    tokenizer,
    convs: list[Conversation],
    batch_size: int,
    max_new_tokens: int,
    temperature: float = DEFAULT_TEMPERATURE,
    seed: int = 0,
) -> dict:
    """Scores of each conversation's real last reply and of one reply the model samples for the same
    prompt. A sampled reply equal to the real one is not a generation the head can tell apart: it is
    counted (`identical`) and left out of the AUC."""
    convs = [c for c in convs if c.dialog is None]
    if not convs:
        raise DataError("credibility_report: no plain conversations to score (tool dialogs are not scored)")
    prompts = [prompt_sequence(c, tokenizer) for c in convs]
    sampled = sample_replies(model, tokenizer, prompts, temperature, max_new_tokens, batch_size, seed)
    real_text = [c.turns[-1][1].strip() for c in convs]
    pad = tokenizer.pad_token_id or 0
    real = score_sequences(
        model, head, [reply_sequence(c, r, tokenizer) for c, r in zip(convs, real_text)], pad, batch_size
    )
    differ = [i for i, (s, r) in enumerate(zip(sampled, real_text)) if s != r]
    gen = score_sequences(
        model, head, [reply_sequence(convs[i], sampled[i], tokenizer) for i in differ], pad, batch_size
    )
    auc = roc_auc(real, gen) if len(gen) else float("nan")
    return {
        "auc": auc,
        "examples": len(convs),
        "identical": len(convs) - len(differ),
        "real": _summary(1 / (1 + np.exp(-real))),
        "generated": _summary(1 / (1 + np.exp(-gen))),
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }


def rerank(
    model, head: CredibilityHead, tokenizer, messages: list[dict], candidates: list[str], batch_size: int = 16
) -> tuple[int, np.ndarray]:
    """Index of the most credible of `candidates` (replies to `messages`, which end with a user turn)
    and every candidate's probability. A candidate with no visible text (empty or whitespace) is
    chosen only when every candidate is one: the head can score a blank highest, and a blank
    answers nothing."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    body = messages[1:] if system is not None else messages
    turns = [(body[k]["content"], body[k + 1]["content"]) for k in range(0, len(body) - 1, 2)]
    conv = Conversation(system, [*turns, (body[-1]["content"], "")], [True] * (len(turns) + 1), "chat")
    seqs = [reply_sequence(conv, c, tokenizer) for c in candidates]
    logits = score_sequences(model, head, seqs, tokenizer.pad_token_id or 0, batch_size)
    visible = np.array([bool(c.strip()) for c in candidates])
    choose = np.where(visible, logits, -np.inf) if visible.any() else logits
    return int(np.argmax(choose)), 1 / (1 + np.exp(-logits))
