"""Held-out evaluation of controlled generation: exact match and, per control attribute value with a
check (erniekit/data/control.py FOLLOW_CHECKS), the fraction of greedy replies that follow it; the
lines an SFT run ends with (control following, credibility AUC)."""

from __future__ import annotations

from erniekit.data.control import follows
from erniekit.data.formats import Conversation
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.stops import decodable_vocab, turn_end_ids
from erniekit.train.evaluation import prompt_ids

FOLLOW_PREFIX = "follow:"  # metric keys: follow:style=words


def control_generation_eval(
    model, tokenizer, convs: list[Conversation], batch_size: int, max_new_tokens: int
) -> dict[str, float]:
    """exact_match of greedy replies (as exact_match_eval) and `follow:KEY=VALUE` rates."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=turn_end_ids(tokenizer))
    hits, counts, followed, vocab = 0, {}, {}, decodable_vocab(model, tokenizer)
    for i in range(0, len(convs), batch_size):
        chunk = convs[i : i + batch_size]
        prompts = [prompt_ids(c, tokenizer) for c in chunk]
        outs = generate(model, prompts, params, pad_id=tokenizer.pad_token_id, vocab=vocab)
        for o, c in zip(outs, chunk):
            reply = tokenizer.decode(o).strip()
            hits += reply == c.turns[-1][1].strip()
            for attr, ok in follows(c.control, reply).items():
                counts[attr] = counts.get(attr, 0) + 1
                followed[attr] = followed.get(attr, 0) + ok
    res = {"exact_match": hits / max(len(convs), 1)}
    res.update({f"{FOLLOW_PREFIX}{k}={v}": followed[(k, v)] / counts[(k, v)] for k, v in sorted(counts)})
    return res


def held_out_lines(ev: dict[str, float]) -> list[str]:
    """What the end of an SFT run prints about control and credibility (nothing when neither ran)."""
    lines = []
    rates = [(k.removeprefix(FOLLOW_PREFIX), v) for k, v in ev.items() if k.startswith(FOLLOW_PREFIX)]
    if rates:
        lines.append("held-out control following: " + ", ".join(f"{k} {v:.3f}" for k, v in rates))
    if "credibility_auc" in ev:
        lines.append(
            f"held-out credibility AUC (real vs sampled replies): {ev['credibility_auc']:.3f} "
            f"(mean probability real {ev['credibility_real_mean']:.3f}, sampled {ev['credibility_generated_mean']:.3f})"
        )
    return lines
