"""Batched generation with a KV cache: greedy, temperature and top-p sampling, stop tokens.

Prompts of different lengths are left-padded so one prefill and one decode step per token
serve the whole batch; the only Python loop is over decode steps.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import paddle
import paddle.nn.functional as F

from erniekit.errors import NonFiniteError, RequestError
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
from erniekit.nn.attention import KVCache

__all__ = [
    "SamplingParams",
    "argmax_or_flag",
    "check_prompt_ids",
    "generate",
    "generate_stream",
    "non_finite_error",
    "sample_next",
]


def check_prompt_ids(prompts: list[list[int]], vocab_size: int, pad_id: int | None = None) -> None:
    """RequestError naming the first id outside [0, vocab_size), its prompt and position (the
    embedding lookup would fail inside the forward with a multi-line framework error).
    pad_id: checked too when given (it is fed for left padding and finished rows)."""
    for i, p in enumerate(prompts):
        ids = np.asarray(p, dtype=np.int64).reshape(-1)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            which = f" of prompt {i}" if len(prompts) > 1 else ""
            raise RequestError(
                f"prompt token id {ids[bad[0]]} at position {bad[0]}{which} is outside the vocabulary "
                f"[0, {vocab_size}); check that the prompt was encoded with this model's tokenizer"
            )
    if pad_id is not None and not 0 <= pad_id < vocab_size:
        raise RequestError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab_size}); pass the tokenizer's pad id")


def non_finite_error(where: str, dtype: object) -> NonFiniteError:
    """The one-line error for NaN / inf logits `where` (e.g. "at generation step 3"), with what to check."""
    hint = "check the checkpoint's weights for NaN or inf (a diverged or damaged training run)"
    if str(dtype).split(".")[-1] == "float16":
        hint += "; in float16 an activation may have overflowed: load the model in bfloat16 or float32"
    return NonFiniteError(f"the model produced non-finite logits (NaN or inf) {where}; {hint}")


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


def argmax_or_flag(logits: paddle.Tensor) -> paddle.Tensor:
    """Greedy ids over the last axis, -1 where a row's logits are not all finite: the flag rides in
    the ids' own device-to-host copy, so the check costs no extra sync per token."""
    ids = paddle.argmax(logits, axis=-1)
    return paddle.where(paddle.isfinite(logits).all(axis=-1), ids, paddle.full_like(ids, -1))


def sample_or_flag(logits: paddle.Tensor, temperature: float, top_p: float) -> paddle.Tensor:
    """sample_next's ids, -1 for a row whose logits are not all finite (as argmax_or_flag). Such a
    row is sampled from zeros instead: multinomial raises on NaN probabilities, a GPU kernel may assert."""
    if temperature == 0:
        return argmax_or_flag(logits)
    finite = paddle.isfinite(logits).all(axis=-1)
    nxt = sample_next(paddle.where(finite.unsqueeze(-1), logits, paddle.zeros_like(logits)), temperature, top_p)
    return paddle.where(finite, nxt, paddle.full_like(nxt, -1))


def choice_width(model, vocab: int | None) -> int:
    """How many leading ids of the model's vocabulary a decoder may choose from (`vocab` ids, at
    most the model's); ValueError for a `vocab` below 1."""
    width = int(model.config.vocab_size)
    if vocab is None:
        return width
    if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab < 1:
        raise ValueError(f"vocab={vocab!r} must be a positive number of token ids")
    return min(int(vocab), width)


@paddle.no_grad()
def generate_stream(
    model: Ernie4_5ForCausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    on_forward: Callable[[], None] | None = None,
    vocab: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield the new token of every sequence at each step ([B] array; -1 once a sequence stopped).
    on_forward: called after every model forward (the prefill, then one per decode step), e.g. to
    record the MoE routing of the tokens just fed (erniekit/rl/rollout.py).
    vocab: only ids below it are chosen; pass `decodable_vocab(model, tokenizer)` when the ids
    will be decoded (a vocabulary padded past the tokenizer has ids no text stands for).
    RequestError for a prompt id outside the vocabulary; NonFiniteError when a running sequence's
    logits turn NaN or inf."""
    check_prompt_ids(prompts, int(model.config.vocab_size), pad_id if len(prompts) > 1 else None)
    keep = choice_width(model, vocab)
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
    dtype = model.model.embed_tokens.weight.dtype
    cache = KVCache(model.config, B, L + params.max_new_tokens, dtype=dtype)
    stops = np.array(sorted(set(params.stop_token_ids)), dtype=np.int64)
    done = np.zeros(B, dtype=bool)
    x = paddle.to_tensor(ids)
    try:
        for step in range(params.max_new_tokens):
            cur = L + step
            am = paddle.to_tensor(mask[:, :cur]) if padded else None
            logits = model(x, attention_mask=am, cache=cache, logits_to_keep=1).logits[:, -1]
            if keep < logits.shape[-1]:
                logits = logits[:, :keep]
            if on_forward is not None:
                on_forward()
            nxt = _next_ids(logits, params.temperature, params.top_p)
            _check_finite(nxt, done, step, params.max_new_tokens, dtype)
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


def _next_ids(logits: paddle.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """sample_or_flag's ids as int64. Greedy on the CPU takes numpy's argmax over a host copy: the
    same ids (the first maximum, -1 for a non-finite row) in ~20 us where Paddle's ops take ~120 at
    a 32k vocabulary; a GPU keeps the argmax on the device (one row of ids crosses, not the logits)."""
    if temperature == 0 and logits.place.is_cpu_place():
        lg = logits.astype("float32").numpy() if logits.dtype != paddle.float32 else logits.numpy()
        return np.where(np.isfinite(lg).all(axis=-1), lg.argmax(axis=-1), -1).astype(np.int64)
    return sample_or_flag(logits.astype("float32"), temperature, top_p).numpy().astype(np.int64)


def _check_finite(nxt: np.ndarray, done: np.ndarray, step: int, max_new_tokens: int, dtype: object) -> None:
    """NonFiniteError when a running row was flagged -1 by sample_or_flag (finished rows only feed padding)."""
    bad = np.flatnonzero((nxt < 0) & ~done)
    if bad.size:
        which = f" of prompt {bad[0]}" if len(nxt) > 1 else ""
        raise non_finite_error(f"at generation step {step + 1} of {max_new_tokens}{which}", dtype)


def generate(
    model: Ernie4_5ForCausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_id: int = 0,
    on_token: Callable[[np.ndarray], None] | None = None,
    vocab: int | None = None,
) -> list[list[int]]:
    """New tokens per prompt, stop token excluded (vocab: as `generate_stream`)."""
    outs: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stops = set(params.stop_token_ids)
    for step_ids in generate_stream(model, prompts, params, pad_id, vocab=vocab):
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
