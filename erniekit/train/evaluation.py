"""Generation-based evaluation shared by stages: exact match of greedy replies."""

from __future__ import annotations

from collections import Counter

from erniekit.data.encode import IGNORE_INDEX, encode_conversation
from erniekit.data.formats import Conversation
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.stops import decodable_vocab, turn_end_ids


def majority_reply(convs: list[Conversation]) -> str:
    """The trivial baseline for exact match: always answer the most common training reply."""
    return Counter(c.turns[-1][1].strip() for c in convs).most_common(1)[0][0]


def baseline_exact_match(convs: list[Conversation], majority: str) -> float:
    """Exact match of always answering `majority`."""
    return sum(c.turns[-1][1].strip() == majority for c in convs) / max(len(convs), 1)


def prompt_ids(conv: Conversation, tokenizer) -> list[int]:
    """Everything before the last assistant reply, tokenized exactly as in training."""
    last = Conversation(
        conv.system, conv.turns, [False] * (len(conv.turns) - 1) + [True], conv.source, control=conv.control
    )
    ids, labels = encode_conversation(last, tokenizer, max_seq_len=10**9)
    first_trained = next(i for i, l in enumerate(labels) if l != IGNORE_INDEX)
    return ids[:first_trained]


def exact_match_eval(model, tokenizer, convs: list[Conversation], batch_size: int, max_new_tokens: int) -> float:
    stops = turn_end_ids(tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops)
    hits, vocab = 0, decodable_vocab(model, tokenizer)
    for i in range(0, len(convs), batch_size):
        chunk = convs[i : i + batch_size]
        prompts = [prompt_ids(c, tokenizer) for c in chunk]
        outs = generate(model, prompts, params, pad_id=tokenizer.pad_token_id, vocab=vocab)
        hits += sum(tokenizer.decode(o).strip() == c.turns[-1][1].strip() for o, c in zip(outs, chunk))
    return hits / max(len(convs), 1)
