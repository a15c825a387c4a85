"""Rollout engine: sample completions from the policy being trained, with a KV cache.

One call serves a whole micro-batch: every prompt is repeated `num_generations` times, the
copies are left-padded into one batch, and `generate_stream` runs one prefill plus one decode
step per new token for all of them (the only Python loop is over decode steps). The weights
used are the model's current ones: rollouts always come from the current policy.

The result is laid out exactly as the training forward will see it (left-padded prompt, then
the completion, padded on the right), so the MoE routing recorded during sampling lines up
token for token with the training forward (routing replay, erniekit/routing/replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from erniekit.infer.generate import generate, generate_stream
from erniekit.infer.sampling import SamplingParams


@dataclass
class Rollout:
    input_ids: np.ndarray  # [B, L + N] left-padded prompt, then completion (pad after a stop)
    attention_mask: np.ndarray  # [B, L + N] 1 on real prompt and completion tokens
    prompt_len: int  # L: the completion starts at this column
    completion_ids: np.ndarray  # [B, N] sampled tokens (pad after the stop token)
    completion_mask: np.ndarray  # [B, N] 1 up to and including the stop token
    stopped: np.ndarray  # [B] bool: ended with a stop token (False: cut at max_new_tokens)
    routing: list[np.ndarray] | None = None  # per MoE layer [B, L + N, k] experts chosen while sampling
    routing_mask: np.ndarray | None = None  # [B, L + N] tokens that were fed to the model (have a routing)

    def completions(self) -> list[list[int]]:
        """Each completion's tokens, stop token excluded (what rewards and decoding see)."""
        out = []
        for ids, m, s in zip(self.completion_ids, self.completion_mask, self.stopped):
            n = int(m.sum())
            out.append(ids[: n - 1 if s else n].tolist())
        return out


class _RoutingRecorder:
    """Collects each MoE layer's expert choice after every forward of a generation."""

    def __init__(self, model, batch: int):
        self.layers = model.moe_layers() if hasattr(model, "moe_layers") else []
        self.batch = batch
        self.chunks: list[list[np.ndarray]] = [[] for _ in self.layers]

    def __call__(self) -> None:
        for chunks, layer in zip(self.chunks, self.layers):
            idx = layer.last_topk_idx.numpy()  # [B * S_step, k]
            chunks.append(idx.reshape(self.batch, -1, idx.shape[-1]))

    def result(self, total_len: int) -> list[np.ndarray] | None:
        """[B, total_len, k] per layer; columns never fed (the last sampled token) are 0."""
        if not self.layers:
            return None
        out = []
        for chunks in self.chunks:
            r = np.concatenate(chunks, axis=1)
            full = np.zeros((self.batch, total_len, r.shape[-1]), np.int64)
            full[:, : r.shape[1]] = r
            out.append(full)
        return out


def rollout(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int,
    record_routing: bool = False,
    vocab: int | None = None,
) -> Rollout:
    """Sample one completion per prompt (repeat prompts beforehand for several per prompt), of ids
    below `vocab` (`generate_stream`'s: the tokenizer's, so rewards can decode every reply)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    recorder = _RoutingRecorder(model, B) if record_routing else None
    steps = [s for s in generate_stream(model, prompts, params, pad_id, on_forward=recorder, vocab=vocab)]
    N = len(steps)
    raw = np.stack(steps, axis=1)  # [B, N], -1 after a sequence stopped
    completion_mask = (raw >= 0).astype(np.int64)
    completion_ids = np.where(raw >= 0, raw, pad_id)
    stops = np.asarray(sorted(set(params.stop_token_ids)), np.int64)
    n = completion_mask.sum(1)
    last = completion_ids[np.arange(B), np.maximum(n - 1, 0)]
    stopped = np.isin(last, stops) & (n > 0)
    input_ids = np.full((B, L + N), pad_id, np.int64)
    attention_mask = np.zeros((B, L + N), np.int64)
    for i, p in enumerate(prompts):  # one row copy per sequence (not per token)
        input_ids[i, L - len(p) : L] = p
        attention_mask[i, L - len(p) : L] = 1
    input_ids[:, L:] = completion_ids
    attention_mask[:, L:] = completion_mask
    routing = routing_mask = None
    if recorder is not None and recorder.layers:
        routing = recorder.result(L + N)
        # fed tokens: the prompt, then every sampled token but the last one of the batch's decode loop;
        # a token sampled after its sequence stopped is padding and was fed but is not real
        routing_mask = attention_mask.copy()
        routing_mask[:, L + N - 1] = 0
        fed = raw[:, :-1] >= 0
        routing_mask[:, L : L + N - 1] &= fed
    return Rollout(input_ids, attention_mask, L, completion_ids, completion_mask, stopped, routing, routing_mask)


def repeat_prompts(prompts: list[list[int]], num_generations: int) -> list[list[int]]:
    """[p0, p1] -> [p0 x G, p1 x G]: the G samples of a prompt are adjacent (one group)."""
    return [p for p in prompts for _ in range(num_generations)]


def greedy_completions(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: list[int],
    pad_id: int,
    batch_size: int,
    vocab: int | None = None,
) -> list[list[int]]:
    """Greedy completions (stop token excluded, ids below `vocab`), batched: what evaluation scores."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        out += generate(model, prompts[i : i + batch_size], params, pad_id=pad_id, vocab=vocab)
    return out
