"""Batched generation with a KV cache: greedy, temperature and top-p sampling, stop tokens.

Prompts of different lengths are left-padded so one prefill and one decode step per token
serve the whole batch; the only Python loop is over decode steps.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import paddle
import paddle.nn.functional as F

from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
from erniekit.nn.attention import KVCache

__all__ = ["SamplingParams", "generate", "generate_stream", "sample_next"]


def sample_next(logits: paddle.Tensor, temperature: float, top_p: float) -> paddle.Tensor:
    """logits [B, V] float32 -> next ids [B] (int64)."""
    if temperature == 0:
        return paddle.argmax(logits, axis=-1)
    # shifted before the division: logits / T overflows to inf at a tiny T (1e-308), and softmax
    # then takes inf - inf = NaN. A T that rounds to 0 in the logits' dtype makes the argmax's 0 / 0
    # NaN: it stays 0 (its probability 1), the rest go to -inf, as the limit T -> 0 has it
    shift = logits - logits.max(axis=-1, keepdim=True)
    probs = F.softmax(paddle.where(shift == 0, shift, shift / temperature), axis=-1)
    if top_p < 1.0:
        sorted_idx = paddle.argsort(probs, axis=-1, descending=True)
        sorted_p = paddle.take_along_axis(probs, sorted_idx, axis=-1)
        keep = (paddle.cumsum(sorted_p, axis=-1) - sorted_p) < top_p  # smallest set reaching top_p
        sorted_p = paddle.where(keep, sorted_p, paddle.zeros_like(sorted_p))
        choice = paddle.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1)
        return paddle.take_along_axis(sorted_idx, choice, axis=-1).squeeze(-1)
    return paddle.multinomial(probs, 1).squeeze(-1)


@paddle.no_grad()
def generate_stream(
    model: Ernie4_5ForCausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    on_forward: Callable[[], None] | None = None,
) -> Iterator[np.ndarray]:
    """Yield the new token of every sequence at each step ([B] array; -1 once a sequence stopped).
    on_forward: called after every model forward (the prefill, then one per decode step), e.g. to
    record the MoE routing of the tokens just fed (erniekit/rl/rollout.py)."""
    if params.seed is not None:
        paddle.seed(params.seed)
    was_training = model.training
    model.eval()
    B = len(prompts)
    L = max(len(p) for p in prompts)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    mask = np.zeros((B, L + params.max_new_tokens), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = p
        mask[i, L - len(p) : L] = 1
    padded = bool((mask[:, :L] == 0).any())
    cache = KVCache(model.config, B, L + params.max_new_tokens, dtype=model.model.embed_tokens.weight.dtype)
    stops = np.array(sorted(set(params.stop_token_ids)), dtype=np.int64)
    done = np.zeros(B, dtype=bool)
    x = paddle.to_tensor(ids)
    try:
        for step in range(params.max_new_tokens):
            cur = L + step
            am = paddle.to_tensor(mask[:, :cur]) if padded else None
            logits = model(x, attention_mask=am, cache=cache, logits_to_keep=1).logits[:, -1].astype("float32")
            if on_forward is not None:
                on_forward()
            nxt = sample_next(logits, params.temperature, params.top_p).numpy().astype(np.int64)
            nxt = np.where(done, pad_id, nxt)
            out = np.where(done, -1, nxt)
            done |= np.isin(nxt, stops)
            mask[:, cur] = 1
            yield out
            if done.all():
                break
            x = paddle.to_tensor(nxt[:, None])
    finally:
        if was_training:
            model.train()


def generate(
    model: Ernie4_5ForCausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> list[list[int]]:
    """New tokens per prompt, stop token excluded."""
    outs: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stops = set(params.stop_token_ids)
    for step_ids in generate_stream(model, prompts, params, pad_id):
        if on_token is not None:
            on_token(step_ids)
        for i, t in enumerate(step_ids.tolist()):
            if t < 0 or finished[i]:
                continue
            if t in stops:
                finished[i] = True
            else:
                outs[i].append(t)
    return outs
