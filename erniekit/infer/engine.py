"""The built-in inference engine of `erniekit server`: continuous batching over one KV cache.

Every running request owns a row of a preallocated cache [rows, max_model_len, KVH, D] per layer;
all rows share one time axis of T columns, and each row's tokens are the last columns it filled,
left-padded by a mask (positions come from the mask's running count, as in `generate`).
Requests join between decode steps: the prompts that arrived are prefilled together in one
left-padded forward (each row's keys and values are those of its prompt alone: padding is masked
and does not count as a position), copied into free rows at columns [T-p, T), and from then on
one forward per step decodes every running row. A finished row is refilled by
moving the last running row into it; when the time axis is full, the columns no running row uses
are dropped (a shift left). The only Python loops per step are over requests (sampling with each
request's own options, stop strings), never over tokens of a sequence.

Faults are confined to the request that caused them: each row is sampled and advanced on its
own (a row whose logits are not finite, or whose sampling / decoding / emit raises, fails alone
with finish reason "error" while the others keep their exact tokens), and a prefill forward that
raises is retried one request at a time so only the request that breaks it fails. Only a shared
decode forward that raises fails every running row: no row can be blamed for it.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import paddle

from erniekit.errors import ErniekitError
from erniekit.infer.detokenize import TextStream
from erniekit.infer.generate import non_finite_error
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.stops import decodable_vocab
from erniekit.nn import small_gemm
from erniekit.nn.attention import KVCache

log = logging.getLogger("erniekit.engine")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its raw distribution: before temperature,
    penalties and logit_bias, as vLLM reports them) and the `top` most likely (id, logprob). The
    distribution is over the ids a reply can hold (`decodable_vocab`): a vocabulary padded past
    the tokenizer loses its padding rows before anything is chosen or scored, so for such a model
    each value is log(1 - p(padding)) above a softmax over every row (nothing, without padding)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _chunk_rows(vocab: int) -> int:
    """Rows of [rows, vocab] logits scored at once: a few tens of MB of temporaries whatever the vocabulary."""
    return max(1, min(256, (1 << 22) // max(1, vocab)))


def token_logprobs(logits: np.ndarray, chosen: np.ndarray, k: int) -> list[TokenLogprob]:
    """Rows of logits [n, V] -> the log-probability of `chosen` [n] in each row and its k most likely
    tokens (ties to the lower id). The chosen value and the top values of a row come from the same
    float32 array, so they compare exactly (lm-eval's greedy check); rows go a chunk at a time, so
    the temporaries stay small for a large vocabulary. A chosen id at or past V (a prompt's VL
    placeholder past the ids a reply can hold) has probability 0 under these rows: -inf."""
    n, V = logits.shape
    k = min(k, V)
    out: list[TokenLogprob] = []
    step = _chunk_rows(V)
    for a in range(0, n, step):
        z = np.asarray(logits[a : a + step], dtype=np.float32)
        m = z.max(axis=-1, keepdims=True)
        lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
        c = chosen[a : a + step]
        chosen_lp = np.where(c < V, z[np.arange(len(z)), np.minimum(c, V - 1)] - lse[:, 0], -np.inf).tolist()
        top = [()] * len(z)
        if k:
            cand = np.argpartition(z, V - k, axis=-1)[:, V - k :]
            vals = np.take_along_axis(z, cand, axis=-1)
            order = np.lexsort((cand, -vals), axis=-1)  # by value, then by id
            ids = np.take_along_axis(cand, order, axis=-1)
            vals = np.take_along_axis(vals, order, axis=-1) - lse
            top = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        out.extend(TokenLogprob(int(t), float(v), tp) for t, v, tp in zip(c.tolist(), chosen_lp, top))
    return out


@dataclass
class Request:
    """One completion. `emit(delta_text, finish_reason)` is called from the engine thread for every
    new piece of text (finish_reason None) and once at the end ("stop", "length" or "error")."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[str, str | None], None]
    stop: list[str] = field(default_factory=list)
    images: tuple | None = None  # (patches, grid_thw) of the images in `prompt` (a vision-language model)
    videos: tuple | None = None  # the same for its videos
    # log-probabilities (OpenAI's logprobs / echo): of each generated token with its `logprobs` most
    # likely alternatives (0: the chosen token's only; None: none); of each prompt token after the
    # first with `prompt_logprobs` alternatives; prompt_only: score the prompt, generate nothing
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    client: str | None = None  # who sent it (the server: the peer's address); free rows go to clients in turn
    # filled by the engine
    completion: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token taken (a stop token too)
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (token 0 has none)
    text: str = ""  # the whole reply, set when it finishes (`stream` holds it while it grows)
    sent: int = 0  # characters of the reply already emitted
    stream: TextStream | None = None
    error: str | None = None
    ended_on_stop_token: bool = False  # the reply ended on a stop token: generated, not in `completion`
    cancelled: bool = False  # set by the caller (a client that went away): finishes at the next step
    finished: bool = False  # set by the engine when it ends the request (once: a second end is ignored)


class SlotCache:
    """KV buffers of `rows` requests on one time axis; the model sees the first `n` rows
    (the running ones) and `length` columns through the KVCache interface."""

    first_rows = True  # `update` writes the first rows of a batch smaller than the buffers (decode_step.py)

    def __init__(self, config, rows: int, max_len: int, dtype: str):
        shape = [rows, max_len, config.num_key_value_heads, config.head_dim]
        self.k = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.max_len, self.length, self.n = max_len, 0, 0

    def reserve(self, end: int) -> None:
        """The buffers hold max_len columns from the start: only a step past them is refused (the
        engine makes room first, `_decode_step`)."""
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len={self.max_len}")

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        n, start, end = k.shape[0], self.length, self.length + k.shape[1]
        self.k[layer][:n, start:end] = k
        self.v[layer][:n, start:end] = v
        return self.k[layer][:n, :end], self.v[layer][:n, :end]

    def put(self, row: int, src: KVCache, src_row: int, src_cols: slice, cols: slice) -> None:
        """Row `row`, columns `cols` <- row `src_row`, columns `src_cols` of a prefill's cache."""
        for layer in range(len(self.k)):
            self.k[layer][row, cols] = src.k[layer][src_row, src_cols]
            self.v[layer][row, cols] = src.v[layer][src_row, src_cols]

    def move_row(self, dst: int, src: int, cols: int) -> None:
        for layer in range(len(self.k)):
            self.k[layer][dst, :cols] = self.k[layer][src, :cols]
            self.v[layer][dst, :cols] = self.v[layer][src, :cols]

    def shift(self, rows: int, by: int) -> None:
        """Move the first `length` columns of the first `rows` rows by `by` (> 0 right, < 0 left)."""
        T = self.length
        for buf in self.k + self.v:
            if by > 0:
                buf[:rows, by : T + by] = buf[:rows, :T].clone()
            else:
                buf[:rows, : T + by] = buf[:rows, -by:T].clone()
        self.length = T + by


def check_cache_fits(config, max_batch: int, max_model_len: int, dtype) -> None:
    """Refuse, in one line, a context longer than the model's positions or a KV cache (allocated
    whole when the engine starts) larger than the host memory available; a GPU's memory is
    Paddle's to report (its allocator raises), the host's MemAvailable says nothing about it."""
    from erniekit.infer.weight_packing import available_memory
    from erniekit.utils.device import cuda_visible

    positions = int(config.max_position_embeddings)
    if max_model_len > positions:
        raise ErniekitError(
            f"--max-model-len {max_model_len} is longer than the model's context "
            f"(max_position_embeddings={positions}); use at most {positions}"
        )
    if cuda_visible():
        return
    itemsize = paddle.zeros([1], dtype=dtype).element_size()
    need = 2 * config.num_hidden_layers * max_batch * max_model_len * config.num_key_value_heads * config.head_dim
    need = need * itemsize + max_batch * max_model_len * 8  # keys, values and the int64 mask
    free = available_memory()
    if free is not None and need > free:
        raise ErniekitError(
            f"the KV cache of {max_batch} requests x {max_model_len} positions needs {need / 2**20:,.0f} MiB, "
            f"{free / 2**20:,.0f} MiB of memory is available; lower --max-batch or --max-model-len"
        )


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int = 8,
        max_model_len: int | None = None,
        stop_token_ids: list[int] | None = None,
        pack_weights: bool = False,
    ):
        """pack_weights: keep packed copies of the projections for the CPU's decode kernels
        (erniekit/nn/small_gemm.py: faster steps at 8-64 rows, for a second copy of those weights)."""
        self.model, self.tokenizer = model, tokenizer
        # ids a reply can hold; every logits row is cut to them before it is sampled or scored
        self.vocab = decodable_vocab(model, tokenizer)
        model.eval()
        self.packed_bytes = small_gemm.pack_weights(model) if pack_weights else 0
        c = model.config
        self.max_model_len = int(max_model_len or min(int(c.max_position_embeddings), 4096))
        self.max_batch = max_batch
        self.dtype = model.model.embed_tokens.weight.dtype
        self._warned_non_finite = False
        check_cache_fits(c, max_batch, self.max_model_len, self.dtype)
        self.cache = SlotCache(c, max_batch, self.max_model_len, self.dtype)
        self.mask = np.zeros((max_batch, self.max_model_len), dtype=np.int64)
        self.rows: list[Request] = []  # running requests, row i = rows[i]
        self.next_ids = np.zeros(max_batch, dtype=np.int64)  # each row's token to feed next
        # a vision-language model's rows: 3-D positions, each row's offset of decode positions past
        # its token count (an image of h x w merged tokens advances positions by max(h, w))
        self.vl = hasattr(model, "visual_features")
        self.deltas = np.zeros(max_batch, dtype=np.int64)
        self.rngs: dict[int, np.random.Generator] = {}
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # logit_bias as (ids, values) per request
        self.default_stops = sorted(set(stop_token_ids or []))
        self.pending: queue.Queue[Request] = queue.Queue()  # submitted, not yet seen by the engine thread
        self.waiting: deque[Request] = deque()  # seen, waiting for a row (the engine thread's alone)
        self._turns = 0  # rows handed out so far, and the turn each client present last had one
        self._last_turn: dict[str | None, int] = {}
        self.steps = 0  # decode forwards run (stats)
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="erniekit-engine", daemon=True)
        self._thread.start()

    # ---- the public side (any thread) -------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError when the request cannot fit the context (before it is queued)."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )

    def check_ids(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError when a prompt id is outside the model's vocabulary (it would index past the
        embedding inside the shared step; a VL prompt's placeholders may lie past the tokenizer)
        or a logit_bias key outside the ids a reply can hold (`self.vocab`)."""
        vocab = int(self.model.config.vocab_size)
        bad = next((t for t in prompt if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias if not 0 <= int(t) < self.vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias key {bad} is outside the vocabulary [0, {self.vocab})")

    def submit(self, req: Request) -> None:
        if (req.images is not None or req.videos is not None) and not self.vl:
            raise ValueError("this model reads no images or videos (it is not a vision-language model)")
        self.check(len(req.prompt), req.params.max_new_tokens)
        self.check_ids(req.prompt, req.params)
        with self._closing:  # close() ends what was put before it: nothing may slip in after
            if self._stop.is_set():
                raise RuntimeError("the engine is closed: start a new one to serve more requests")
            self.pending.put(req)

    def close(self) -> None:
        with self._closing:
            self._stop.set()
        self.pending.put(None)  # wake the loop
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else its step still runs: ending its requests here would race it
            self._end_all("the engine was closed before this request finished")
        if self.packed_bytes:
            small_gemm.unpack_weights(self.model)

    def _end_all(self, why: str) -> None:
        """End every request still running, waiting or submitted, so no caller waits forever on an
        engine that will not step again."""
        self._take_pending(False)
        for req in [*self.rows, *self.waiting]:
            self._finish(req, "error", why)
        self.rows, self.waiting = [], type(self.waiting)()

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit(block=not self.rows)
                if self.rows:
                    self._decode_step()
            except Exception as e:  # noqa: BLE001 - the shared forward failed: no single row to blame
                log.error("decode step failed, failing its %d requests: %s", len(self.rows), _describe(e), exc_info=e)
                for req in self.rows:
                    self._finish(req, "error", _describe(e))
                self.rows, self.cache.n, self.cache.length = [], 0, 0

    def queued(self) -> int:
        """Requests submitted and not yet running (any thread; approximate while they move)."""
        return self.pending.qsize() + len(self.waiting)

    @paddle.no_grad()
    def _admit(self, block: bool) -> None:
        """Prefill waiting requests into free rows (between decode steps), all in one forward.
        Every step first ends the waiting requests whose client went away, so they give their
        place back at once, not when a row frees (a full batch may run for minutes)."""
        self._take_pending(block and not self.waiting)
        if any(r.cancelled for r in self.waiting):
            keep: deque[Request] = deque()
            for r in self.waiting:  # one read of each flag: a client may hang up meanwhile
                if r.cancelled:
                    self._finish(r, "cancelled")
                else:
                    keep.append(r)
            self.waiting = keep
        free = self.max_batch - len(self.rows)
        if self.waiting and free > 0:
            self._prefill_isolated(self._take_in_turn(free))

    def _take_in_turn(self, free: int) -> list[Request]:
        """Up to `free` waiting requests, each the oldest of the client with the fewest rows
        running or taken so far, then the one whose last row is longest ago: one client's backlog
        does not keep another's request waiting behind all of it (with one row, clients alternate).
        One client (or none named) takes them in order of arrival."""
        held = Counter(r.client for r in self.rows)
        by_client: dict[str | None, deque[tuple[int, Request]]] = {}
        for i, r in enumerate(self.waiting):
            by_client.setdefault(r.client, deque()).append((i, r))
        last = self._last_turn
        # a taking changes only its own client's key: a heap of clients, O((waiting + free) log clients)
        turn = [(held[c], last.get(c, -1), q[0][0], c) for c, q in by_client.items()]
        heapq.heapify(turn)
        new, taken = [], set()
        while len(new) < free and turn:
            _, _, _, c = heapq.heappop(turn)
            i, r = by_client[c].popleft()
            held[c] += 1
            self._turns += 1
            last[c] = self._turns
            new.append(r)
            taken.add(i)
            if by_client[c]:
                heapq.heappush(turn, (held[c], last[c], by_client[c][0][0], c))
        self.waiting = deque(r for i, r in enumerate(self.waiting) if i not in taken)
        # only clients still present keep their turn: the table stays as small as the queue
        present = {r.client for r in self.waiting} | {r.client for r in self.rows} | {r.client for r in new}
        self._last_turn = {c: t for c, t in last.items() if c in present}
        return new

    def _take_pending(self, block: bool) -> None:
        """Move every submitted request into `waiting`; with `block`, wait up to 0.5 s for one."""
        while True:
            try:
                req = self.pending.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if req is not None:  # None: close() waking the loop
                self.waiting.append(req)

    def _prefill_isolated(self, reqs: list[Request]) -> None:
        """Prefill `reqs` together; when that forward raises, each request alone, so the one that
        breaks it fails by itself (the forward touches no engine state: it fills its own cache)."""
        try:
            batch, logits, deltas, scored = self._prefill_forward(reqs)
        except Exception as e:  # noqa: BLE001 - isolate the request that caused it
            if len(reqs) == 1:
                log.error("prefill failed, failing its request: %s", _describe(e), exc_info=e)
                self._finish(reqs[0], "error", _describe(e))
                return
            for r in reqs:
                self._prefill_isolated([r])
            return
        for r, lps in zip(reqs, scored):
            r.prompt_token_logprobs = lps
        try:
            self._place(reqs, batch, logits, deltas)
        except Exception as e:
            # the ones not yet given a row are nobody's now: end them (the loop then fails the rows)
            for r in reqs:
                if not r.finished and not any(x is r for x in self.rows):
                    self._finish(r, "error", _describe(e))
            raise

    def _prefill_forward(self, reqs: list[Request]) -> tuple[KVCache, np.ndarray, np.ndarray, list]:
        """The prompts left-padded into one batch (positions count real tokens, so each row's
        keys and values are those of its prompt alone): their cache, last logits [B, V], each
        row's decode-position offset (0 but after images) and each row's prompt log-probabilities
        (empty unless it asked for them)."""
        lens = [len(r.prompt) for r in reqs]
        L = max(lens)
        ids = np.zeros((len(reqs), L), dtype=np.int64)
        pad = np.zeros((len(reqs), L), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, L - lens[i] :] = r.prompt
            pad[i, L - lens[i] :] = 1
        batch = KVCache(self.model.config, len(reqs), L, dtype=self.dtype)
        am = paddle.to_tensor(pad) if min(lens) < L else None
        kw, deltas = {}, np.zeros(len(reqs), dtype=np.int64)
        for kind, pixels, grid in (
            ("images", "pixel_values", "image_grid_thw"),
            ("videos", "pixel_values_videos", "video_grid_thw"),
        ):
            media = [getattr(r, kind) for r in reqs if getattr(r, kind) is not None]
            if media:  # the rows' pictures in row order: the order of their placeholders in the batch
                kw[pixels] = paddle.to_tensor(np.concatenate([p for p, _ in media]))
                kw[grid] = np.concatenate([g for _, g in media])
        if kw:
            from erniekit.models.ernie4_5_vl.modeling import rope_index

            pos, deltas = rope_index(ids, self.model.config, kw.get("image_grid_thw"), kw.get("video_grid_thw"), pad)
            kw["position_ids"] = paddle.to_tensor(pos)
        want = [r.prompt_logprobs is not None for r in reqs]
        hidden: list[paddle.Tensor] = []
        # the final norm's output at every position: the prompt's logits are made from it a chunk
        # at a time, never as one [B, L, vocab] tensor
        hook = (
            self.model.model.norm.register_forward_post_hook(lambda _l, _i, out: hidden.append(out))
            if any(want)
            else None
        )
        try:
            logits = self.model(paddle.to_tensor(ids), attention_mask=am, cache=batch, logits_to_keep=1, **kw).logits
        finally:
            if hook is not None:
                hook.remove()
        scored = [
            self._prompt_logprobs(hidden[0][i, L - lens[i] :], r.prompt, r.prompt_logprobs) if want[i] else []
            for i, r in enumerate(reqs)
        ]
        return batch, logits[:, -1, : self.vocab].astype("float32").numpy(), deltas, scored

    def _prompt_logprobs(self, h: paddle.Tensor, prompt: list[int], k: int) -> list[TokenLogprob]:
        """Prompt tokens 1.. scored from the final hidden states [p, H] of the positions before them."""
        nxt = np.asarray(prompt[1:], dtype=np.int64)
        out: list[TokenLogprob] = []
        step = _chunk_rows(int(self.model.config.vocab_size))  # positions whose vocabulary logits exist at once
        for a in range(0, len(nxt), step):
            b = min(a + step, len(nxt))
            logits = self.model.head(h[a:b].unsqueeze(0))[0, :, : self.vocab].astype("float32").numpy()
            out.extend(token_logprobs(logits, nxt[a:b], k))
        return out

    def _place(self, reqs: list[Request], batch: KVCache, logits: np.ndarray, deltas: np.ndarray) -> None:
        """Sample each prefilled request's first token and copy its keys and values into a free
        row; a request whose sampling or first step fails finishes with an error and takes no row."""
        lens = [len(r.prompt) for r in reqs]
        L = max(lens)
        for r in reqs:
            self.rngs[id(r)] = np.random.default_rng(r.params.seed)  # None: fresh entropy
            if r.params.logit_bias:
                self.biases[id(r)] = (
                    np.fromiter(r.params.logit_bias, dtype=np.int64, count=len(r.params.logit_bias)),
                    np.fromiter(r.params.logit_bias.values(), dtype=np.float64, count=len(r.params.logit_bias)),
                )
        first, failed = self._sample(logits, reqs)
        self._record_logprobs(logits, first, reqs, failed)
        cache = self.cache
        if L > cache.length:  # a prompt longer than the time axis: make room on the left
            n, T = len(self.rows), cache.length
            if T and n:
                cache.shift(n, L - T)
                self.mask[:n, L - T : L] = self.mask[:n, :T].copy()
                self.mask[:n, : L - T] = 0
            cache.length = L
        T = cache.length
        for i, r in enumerate(reqs):
            if i in failed:
                self._finish(r, "error", failed[i])
                continue
            if r.prompt_only:  # scored, nothing to generate: no row
                self._finish(r, "length")
                continue
            row, p = len(self.rows), lens[i]
            cache.put(row, batch, i, slice(L - p, L), slice(T - p, T))
            self.mask[row, :] = 0
            self.mask[row, T - p : T] = 1
            self.deltas[row] = deltas[i]
            self.rows.append(r)
            cache.n = len(self.rows)
            if self._advance_guarded(r, int(first[i])):
                self._remove(row)
            else:
                self.next_ids[row] = first[i]

    def _decode_step(self) -> None:
        cache, n = self.cache, len(self.rows)
        if cache.length + 1 > cache.max_len:  # drop the columns no running row uses
            used = self.mask[:n, : cache.length].any(axis=0)
            s = int(np.argmax(used))
            cache.shift(n, -s)
            self.mask[:n, : cache.length] = self.mask[:n, s : s + cache.length].copy()
            self.mask[:n, cache.length :] = 0
        T = cache.length
        self.mask[:n, T] = 1
        x = paddle.to_tensor(self.next_ids[:n, None])
        am = paddle.to_tensor(self.mask[:n, : T + 1])
        kw = {}
        if self.vl:  # every axis of the 3-D rope at (tokens so far + the row's offset)
            pos = self.mask[:n, : T + 1].sum(axis=1) - 1 + self.deltas[:n]
            kw["position_ids"] = paddle.to_tensor(np.broadcast_to(pos[None, :, None], (3, n, 1)).copy())
        with paddle.no_grad():
            logits = self.model(x, attention_mask=am, cache=cache, logits_to_keep=1, **kw).logits[:, -1]
        self.steps += 1
        logits = logits.astype("float32").numpy()[:, : self.vocab]
        nxt, failed = self._sample(logits, self.rows)
        self._record_logprobs(logits, nxt, self.rows, failed)
        done = []
        for i, req in enumerate(self.rows):
            if i in failed:
                self._finish(req, "error", failed[i])
                done.append(i)
            elif self._advance_guarded(req, int(nxt[i])):
                done.append(i)
        self.next_ids[:n] = nxt
        for i in reversed(done):
            self._remove(i)

    def _sample(self, logits: np.ndarray, reqs: list[Request]) -> tuple[np.ndarray, dict[int, str]]:
        """Next id per row, and {row: error} for the rows that cannot have one: argmax for plain
        greedy rows (all at once), each other row with its own biases, penalties, temperature,
        top-p and random stream. A row with non-finite logits, or whose sampling raises, fails
        alone; the other rows' ids do not depend on it."""
        out = logits.argmax(axis=-1).astype(np.int64)
        finite = np.isfinite(logits).all(axis=-1)
        failed: dict[int, str] = {}
        for i, req in enumerate(reqs):
            if not finite[i]:
                failed[i] = "the model produced non-finite logits (NaN or inf) for this request"
                self._log_non_finite()
                continue
            p = req.params
            if p.temperature == 0 and not p.adjusts_logits:
                continue
            try:
                out[i] = self._choose(req, logits[i])
            except Exception as e:  # noqa: BLE001 - this row fails, the batch goes on
                log.error("sampling failed for one request, failing it: %s", _describe(e), exc_info=e)
                failed[i] = f"sampling failed: {_describe(e)}"
        return out, failed

    def _log_non_finite(self) -> None:
        """Tell the operator (the client only learns its request failed) what to check, with
        generate's hint; once per engine: a broken checkpoint fails every request alike."""
        if not self._warned_non_finite:
            self._warned_non_finite = True
            log.error("%s", non_finite_error("in a request (it failed; others go on)", self.dtype))

    @staticmethod
    def _record_logprobs(logits: np.ndarray, chosen: np.ndarray, reqs: list[Request], failed: dict) -> None:
        """Append each chosen token's log-probability to the rows that asked for them (grouped by
        their number of alternatives, one vectorised pass per group); a group whose scoring raises
        fails its own rows (added to `failed`), never the others."""
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.logprobs is not None and i not in failed and not r.prompt_only:
                groups.setdefault(r.logprobs, []).append(i)
        for k, rows in groups.items():
            try:
                scored = token_logprobs(logits[rows], chosen[rows], k)
            except Exception as e:  # noqa: BLE001 - these rows fail, the batch goes on
                failed.update({i: f"log-probabilities failed: {_describe(e)}" for i in rows})
                continue
            for i, lp in zip(rows, scored):
                reqs[i].token_logprobs.append(lp)

    def _choose(self, req: Request, row: np.ndarray) -> int:
        """One row's next id: logit_bias added, presence / frequency penalties subtracted (as
        OpenAI defines them, over the tokens generated so far), then greedy or top-p sampling."""
        p = req.params
        z = row.astype(np.float64)
        if id(req) in self.biases:
            ids, vals = self.biases[id(req)]
            z[ids] += vals
        if (p.presence_penalty or p.frequency_penalty) and req.completion:
            ids, counts = np.unique(np.asarray(req.completion, dtype=np.int64), return_counts=True)
            z[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if not np.isfinite(z).all():
            raise FloatingPointError("logits are not finite after biases and penalties")
        if p.temperature == 0:
            return int(z.argmax())
        # the shift before the division: z / T overflows to inf at a tiny T (1e-308), and inf - inf is NaN
        prob = np.exp((z - z.max()) / p.temperature)
        prob /= prob.sum()
        order = np.argsort(-prob, kind="stable")
        sp = prob[order]
        keep = (np.cumsum(sp) - sp) < p.top_p  # the smallest set reaching top_p
        sp = np.where(keep, sp, 0.0)
        return int(order[self.rngs[id(req)].choice(len(sp), p=sp / sp.sum())])

    def _advance_guarded(self, req: Request, tok: int) -> bool:
        """`_advance`, but an exception there (decoding, a stop string, the emit callback) fails
        this request alone; True when it finished either way."""
        try:
            return self._advance(req, tok)
        except Exception as e:  # noqa: BLE001 - this request fails, its neighbours go on
            log.error("a request's next token failed, failing it: %s", _describe(e), exc_info=e)
            return self._finish(req, "error", _describe(e))

    def _advance(self, req: Request, tok: int) -> bool:
        """Take token `tok` for `req`; emit the text that is certain; True when it finished."""
        if req.cancelled:
            return self._finish(req, "cancelled")
        stops = req.params.stop_token_ids or self.default_stops
        if tok in stops:
            req.ended_on_stop_token = True
            return self._finish(req, "stop")
        req.completion.append(tok)
        if req.stream is None:
            req.stream = TextStream(self.tokenizer)
        ts, hold = req.stream, max((len(s) - 1 for s in req.stop), default=0)
        before = ts.certain_len
        ts.push(tok)
        if req.stop:  # a new match ends in the new text: look at it and the `hold` characters before
            look = ts.last(ts.certain_len - max(0, before - hold)) + ts.pending
            at = min((i for i in (look.find(s) for s in req.stop) if i >= 0), default=-1)
            if at >= 0:
                return self._finish(req, "stop", text=ts.text()[: ts.certain_len + len(ts.pending) - len(look) + at])
        if len(req.completion) >= req.params.max_new_tokens:
            return self._finish(req, "length")
        # hold back an incomplete character (pending) and what could still become a stop string
        safe = ts.certain_len - hold
        if safe > req.sent:
            req.emit(ts.last(ts.certain_len - req.sent)[: safe - req.sent], None)
            req.sent = safe
        return False

    def _finish(self, req: Request, reason: str, error: str | None = None, text: str | None = None) -> bool:
        """`text`: the reply cut at a stop string; else the whole decode. Once per request: a
        failing step ends every running row, and a row may have ended in that step already."""
        if req.finished:
            return True
        req.finished = True
        req.error = error
        if text is not None or req.stream is not None:
            req.text = text if text is not None else req.stream.text()
        rest = req.text[req.sent :] if reason != "error" else ""
        req.sent = len(req.text)
        self.rngs.pop(id(req), None)
        self.biases.pop(id(req), None)
        try:
            req.emit(rest, reason)
        except Exception as e:  # noqa: BLE001 - its receiver is broken (e.g. gone): nobody to tell but the log
            log.warning("could not deliver the end (%s) of a request: %s", reason, _describe(e))
        return True

    def _remove(self, i: int) -> None:
        """Free row i: the last running row moves into it."""
        last = len(self.rows) - 1
        if i != last:
            self.cache.move_row(i, last, self.cache.length)
            self.mask[i] = self.mask[last]
            self.next_ids[i] = self.next_ids[last]
            self.deltas[i] = self.deltas[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.n = len(self.rows)
        if not self.rows:
            self.cache.length = 0


def complete(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    stop: list[str] | None = None,
    timeout: float = 600.0,
    images: tuple | None = None,
    videos: tuple | None = None,
) -> tuple[str, list[int], str]:
    """One request through the engine, waited for: (text, completion ids, finish reason);
    images / videos: (patches, grid_thw) of the image / video placeholders in `prompt`."""
    done = threading.Event()
    reason: list[str] = []

    def emit(_delta: str, finish: str | None) -> None:
        if finish is not None:
            reason.append(finish)
            done.set()

    req = Request(list(prompt), params, emit, list(stop or []), images=images, videos=videos)
    engine.submit(req)
    if not done.wait(timeout):
        raise TimeoutError(f"no answer within {timeout} s")
    if reason[0] == "error":
        raise RuntimeError(req.error)
    return req.text, list(req.completion), reason[0]
