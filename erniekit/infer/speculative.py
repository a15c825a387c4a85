"""Greedy self-speculative decoding with the model's own MTP heads (docs/mtp.md).

Each round: the MTP heads draft D tokens after the newest certain token, one trunk forward over
[certain token, D drafts] verifies them against the trunk's own greedy choices, the longest
matching prefix is kept plus the trunk's next token, and the KV caches are rolled back
(`KVCache.length`) past the rejected positions. Every emitted token is the trunk's argmax given
the tokens before it, so the output equals plain greedy `generate`; only the number of trunk
forwards changes. Batch size 1, temperature 0.

State between rounds, with tokens[0..m] certain and the trunk cache holding positions 0..m-1:
`hidden[j][:, i]` is h_j at position i (hidden[0] = trunk output after the final norm), and depth j's
cache holds the positions whose inputs were all certain (i + j <= m), `valid[j]` of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import paddle

from erniekit.errors import ErniekitError
from erniekit.infer.generate import argmax_or_flag, check_prompt_ids, choice_width, non_finite_error
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
from erniekit.nn.attention import KVCache, additive_mask, build_attention_mask, rope_cos_sin, use_fused_attention
from erniekit.nn.mtp import mtp_block_config


@dataclass
class SpeculativeStats:
    """Counters of one or more generations; acceptance = mean accepted drafts per verify step."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.verify_steps, 1)


def check_speculative(model: Ernie4_5ForCausalLM, params: SamplingParams) -> None:
    """One-line errors for what speculative decoding cannot do."""
    if getattr(model, "mtp", None) is None:
        raise ErniekitError(
            "--speculative needs a model with MTP heads (num_nextn_predict_layers >= 1 in its "
            "config.json); train one with model_overrides.num_nextn_predict_layers=1"
        )
    if params.temperature > 0:
        raise ErniekitError(
            f"--speculative supports greedy decoding only: use --temperature 0 (got {params.temperature})"
        )
    if params.adjusts_logits:  # the drafts are verified against a plain argmax: a bias would be ignored
        raise ErniekitError(
            "--speculative decodes with a plain argmax: drop presence_penalty, frequency_penalty and logit_bias"
        )


class _Speculator:
    """Caches and hidden-state buffers of one sequence."""

    def __init__(self, model: Ernie4_5ForCausalLM, max_len: int, prompt_len: int, vocab: int):
        self.model, self.mtp = model, model.mtp
        self.prompt_len, self.vocab = prompt_len, vocab  # ids chosen: [0, vocab)
        c = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.cache = KVCache(c, 1, max_len, dtype=dtype)
        block = mtp_block_config(c)
        self.mtp_caches = [KVCache(block, 1, max_len, dtype=dtype) for _ in range(self.mtp.depth)]
        self.hidden = [paddle.zeros([1, max_len, c.hidden_size], dtype=dtype) for _ in range(self.mtp.depth)]
        self.valid = [0] * self.mtp.depth
        # RoPE of every position once: a draft step then slices instead of recomputing (~10% of a round)
        self.cos, self.sin = rope_cos_sin(paddle.arange(max_len, dtype="int64").unsqueeze(0), c.head_dim, c.rope_theta)
        self.dtype = dtype

    def _rope_and_mask(self, lo: int, hi: int):
        """What `Ernie4_5Model.rope_and_mask` gives for positions lo..hi-1 after lo cached ones."""
        S = hi - lo
        mask = build_attention_mask(S, hi) if S > 1 else paddle.ones([1, 1, 1, hi], dtype="bool")
        if not use_fused_attention():
            mask = ("bias", additive_mask(mask, S, hi, self.dtype))
        return self.cos[:, lo:hi], self.sin[:, lo:hi], mask

    def trunk(self, ids: list[int], last_only: bool = False) -> np.ndarray:
        """Feed `ids` after the cache, store their hidden states; the greedy next token after each
        (after the last only, for a prefill), -1 where the logits are not finite."""
        start = self.cache.length
        h = self.model.model(paddle.to_tensor([ids], dtype="int64"), cache=self.cache)
        self.hidden[0][:, start : start + len(ids)] = h
        return argmax_or_flag(self.model.head(h[0, -1:] if last_only else h[0])[:, : self.vocab]).numpy()

    def draft(self, tokens: list[int]) -> list[int]:
        """D draft tokens after tokens[-1] (m = len(tokens) - 1; the trunk has seen tokens[:m])."""
        m = len(tokens) - 1
        ext, model = list(tokens), self.model
        for j in range(self.mtp.depth):
            lo = self.valid[j]
            ids = paddle.to_tensor([ext[lo + j + 1 : m + j + 1]], dtype="int64")  # t[i+j+1], 0-based j
            cos, sin, mask = self._rope_and_mask(lo, m)
            cache = self.mtp_caches[j]
            cache.length = lo
            h = self.mtp.step(j, self.hidden[j][:, lo:m], model.model.embed_tokens(ids), cos, sin, mask, cache)
            if j + 1 < self.mtp.depth:
                self.hidden[j + 1][:, lo:m] = h
            ext.append(self._draft_token(h, j, step=len(tokens) - self.prompt_len + j + 1))
            self.valid[j] = max(0, m - j)  # positions i with i + (j+1) <= m used certain tokens only
            cache.length = self.valid[j]
        return ext[m + 1 :]

    def _draft_token(self, h: paddle.Tensor, j: int, step: int) -> int:
        """Depth j's greedy draft from its last hidden state; NonFiniteError when its logits are not finite."""
        tok = int(argmax_or_flag(self.model.head(self.model.model.norm(h[0, -1]))[: self.vocab]))
        if tok < 0:
            where = f"in MTP head {j + 1}'s draft of generation step {step} (decoding without --speculative skips it)"
            raise non_finite_error(where, self.dtype)
        return tok


@paddle.no_grad()
def speculative_stream(
    model: Ernie4_5ForCausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    stats: SpeculativeStats | None = None,
    vocab: int | None = None,
) -> Iterator[np.ndarray]:
    """Drop-in for `generate_stream` (batch of one, greedy): yields [1] arrays, the stop token last;
    `vocab` as there (the trunk and the drafts choose below it)."""
    check_speculative(model, params)
    if len(prompts) != 1:
        raise ErniekitError(f"speculative decoding takes one prompt at a time (got {len(prompts)})")
    if not prompts[0]:  # the prefill needs a token to predict after
        raise ErniekitError("speculative decoding needs a prompt of at least one token (got an empty one)")
    check_prompt_ids(prompts, int(model.config.vocab_size))
    stats = stats if stats is not None else SpeculativeStats()
    was_training = model.training
    model.eval()
    prompt, stops = list(prompts[0]), set(params.stop_token_ids)
    spec = _Speculator(
        model, len(prompt) + params.max_new_tokens + model.mtp.depth + 1, len(prompt), choice_width(model, vocab)
    )
    try:
        tokens, new = list(prompt), [int(spec.trunk(prompt, last_only=True)[-1])]
        n = 0
        while True:
            for tok in new:
                if tok < 0:  # flagged by argmax_or_flag: the trunk's logits were NaN or inf
                    where = f"at generation step {n + 1} of {params.max_new_tokens}"
                    raise non_finite_error(where, spec.dtype)
                n += 1
                stats.emitted += 1
                yield np.array([tok], dtype=np.int64)
                if tok in stops or n == params.max_new_tokens:
                    return
            tokens += new
            new = _verify(spec, tokens, stats)
    finally:
        if was_training:
            model.train()


def _verify(spec: _Speculator, tokens: list[int], stats: SpeculativeStats) -> list[int]:
    """One round: draft, verify with one trunk forward, roll the trunk cache back; the new tokens
    (the last one -1 when the trunk's logits there were not finite)."""
    m = len(tokens) - 1
    drafts = spec.draft(tokens)
    greedy = spec.trunk([tokens[m]] + drafts)  # greedy[k]: the trunk's token after drafts[:k]
    k = 0
    while k < len(drafts) and drafts[k] == int(greedy[k]):  # a flagged -1 never matches a draft
        k += 1
    spec.cache.length = m + k + 1  # keep tokens[m] and the accepted drafts
    stats.verify_steps += 1
    stats.drafted += len(drafts)
    stats.accepted += k
    return drafts[:k] + [int(greedy[k])]


def speculative_generate(
    model: Ernie4_5ForCausalLM,
    prompt: list[int],
    params: SamplingParams,
    stats: SpeculativeStats | None = None,
    vocab: int | None = None,
) -> list[int]:
    """New tokens of one prompt, stop token excluded (as `generate`)."""
    stops, out = set(params.stop_token_ids), []
    for step in speculative_stream(model, [prompt], params, stats=stats, vocab=vocab):
        tok = int(step[0])
        if tok in stops:
            break
        out.append(tok)
    return out
