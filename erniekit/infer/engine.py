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
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import paddle

from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5.modeling import KVCache


@dataclass
class Request:
    """One completion. `emit(delta_text, finish_reason)` is called from the engine thread for every
    new piece of text (finish_reason None) and once at the end ("stop", "length" or "error")."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[str, str | None], None]
    stop: list[str] = field(default_factory=list)
    # filled by the engine
    completion: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    error: str | None = None
    cancelled: bool = False  # set by the caller (a client that went away): finishes at the next step


class SlotCache:
    """KV buffers of `rows` requests on one time axis; the model sees the first `n` rows
    (the running ones) and `length` columns through the KVCache interface."""

    def __init__(self, config, rows: int, max_len: int, dtype: str):
        shape = [rows, max_len, config.num_key_value_heads, config.head_dim]
        self.k = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.max_len, self.length, self.n = max_len, 0, 0

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
                buf[:rows, by:T + by] = buf[:rows, :T].clone()
            else:
                buf[:rows, :T + by] = buf[:rows, -by:T].clone()
        self.length = T + by


class Engine:
    def __init__(self, model, tokenizer, max_batch: int = 8, max_model_len: int | None = None,
                 stop_token_ids: list[int] | None = None):
        self.model, self.tokenizer = model, tokenizer
        model.eval()
        c = model.config
        self.max_model_len = int(max_model_len or min(int(c.max_position_embeddings), 4096))
        self.max_batch = max_batch
        self.dtype = model.model.embed_tokens.weight.dtype
        self.cache = SlotCache(c, max_batch, self.max_model_len, self.dtype)
        self.mask = np.zeros((max_batch, self.max_model_len), dtype=np.int64)
        self.rows: list[Request] = []  # running requests, row i = rows[i]
        self.next_ids = np.zeros(max_batch, dtype=np.int64)  # each row's token to feed next
        self.rngs: dict[int, np.random.Generator] = {}
        self.default_stops = sorted(set(stop_token_ids or []))
        self.pending: queue.Queue[Request] = queue.Queue()
        self.steps = 0  # decode forwards run (stats)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="erniekit-engine", daemon=True)
        self._thread.start()

    # ---- the public side (any thread) -------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError when the request cannot fit the context (before it is queued)."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new_tokens}) exceeds the "
                             f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")

    def submit(self, req: Request) -> None:
        self.check(len(req.prompt), req.params.max_new_tokens)
        self.pending.put(req)

    def close(self) -> None:
        self._stop.set()
        self.pending.put(None)  # wake the loop
        self._thread.join(timeout=10)

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit(block=not self.rows)
                if self.rows:
                    self._decode_step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, the engine keeps serving
                for req in self.rows:
                    self._finish(req, "error", f"{type(e).__name__}: {e}")
                self.rows, self.cache.n, self.cache.length = [], 0, 0

    @paddle.no_grad()
    def _admit(self, block: bool) -> None:
        """Prefill waiting requests into free rows (between decode steps), all in one forward."""
        new: list[Request] = []
        while len(self.rows) + len(new) < self.max_batch:
            try:
                req = self.pending.get(block=block and not new, timeout=0.5 if block and not new else None)
            except queue.Empty:
                break
            if req is None:
                break
            if not req.cancelled:
                new.append(req)
        if not new:
            return
        try:
            self._prefill(new)
        except Exception as e:  # noqa: BLE001 - these requests fail, the running ones go on
            for req in new:
                if req not in self.rows:
                    self._finish(req, "error", f"{type(e).__name__}: {e}")

    def _prefill(self, reqs: list[Request]) -> None:
        """The prompts left-padded into one batch (positions count real tokens, so each row's
        keys and values are those of its prompt alone), then copied into free rows."""
        lens = [len(r.prompt) for r in reqs]
        L = max(lens)
        ids = np.zeros((len(reqs), L), dtype=np.int64)
        pad = np.zeros((len(reqs), L), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, L - lens[i]:] = r.prompt
            pad[i, L - lens[i]:] = 1
        batch = KVCache(self.model.config, len(reqs), L, dtype=self.dtype)
        am = paddle.to_tensor(pad) if min(lens) < L else None
        logits = self.model(paddle.to_tensor(ids), attention_mask=am, cache=batch, logits_to_keep=1).logits
        for r in reqs:
            self.rngs[id(r)] = np.random.default_rng(r.params.seed)  # None: fresh entropy
        first = self._sample(logits[:, -1].astype("float32").numpy(), reqs)
        cache = self.cache
        if L > cache.length:  # a prompt longer than the time axis: make room on the left
            n, T = len(self.rows), cache.length
            if T and n:
                cache.shift(n, L - T)
                self.mask[:n, L - T:L] = self.mask[:n, :T].copy()
                self.mask[:n, :L - T] = 0
            cache.length = L
        T = cache.length
        for i, r in enumerate(reqs):
            row, p = len(self.rows), lens[i]
            cache.put(row, batch, i, slice(L - p, L), slice(T - p, T))
            self.mask[row, :] = 0
            self.mask[row, T - p:T] = 1
            self.rows.append(r)
            cache.n = len(self.rows)
            if self._advance(r, int(first[i])):
                self._remove(row)
            else:
                self.next_ids[row] = first[i]

    def _decode_step(self) -> None:
        cache, n = self.cache, len(self.rows)
        if cache.length + 1 > cache.max_len:  # drop the columns no running row uses
            used = self.mask[:n, :cache.length].any(axis=0)
            s = int(np.argmax(used))
            cache.shift(n, -s)
            self.mask[:n, :cache.length] = self.mask[:n, s:s + cache.length].copy()
            self.mask[:n, cache.length:] = 0
        T = cache.length
        self.mask[:n, T] = 1
        x = paddle.to_tensor(self.next_ids[:n, None])
        am = paddle.to_tensor(self.mask[:n, :T + 1])
        with paddle.no_grad():
            logits = self.model(x, attention_mask=am, cache=cache, logits_to_keep=1).logits[:, -1]
        self.steps += 1
        nxt = self._sample(logits.astype("float32").numpy(), self.rows)
        done = [i for i, req in enumerate(self.rows) if self._advance(req, int(nxt[i]))]
        self.next_ids[:n] = nxt
        for i in reversed(done):
            self._remove(i)

    def _sample(self, logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
        """Next id per row: argmax for greedy rows (all at once), each sampling row with its own
        temperature, top-p and random stream."""
        out = logits.argmax(axis=-1).astype(np.int64)
        for i, req in enumerate(reqs):
            t, top_p = req.params.temperature, req.params.top_p
            if t == 0:
                continue
            z = logits[i].astype(np.float64) / t
            prob = np.exp(z - z.max())
            prob /= prob.sum()
            order = np.argsort(-prob, kind="stable")
            sp = prob[order]
            keep = (np.cumsum(sp) - sp) < top_p  # the smallest set reaching top_p
            sp = np.where(keep, sp, 0.0)
            out[i] = order[self.rngs[id(req)].choice(len(sp), p=sp / sp.sum())]
        return out

    def _advance(self, req: Request, tok: int) -> bool:
        """Take token `tok` for `req`; emit the text that is certain; True when it finished."""
        if req.cancelled:
            return self._finish(req, "cancelled")
        stops = req.params.stop_token_ids or self.default_stops
        if tok in stops:
            return self._finish(req, "stop")
        req.completion.append(tok)
        text = self.tokenizer.decode(req.completion)
        for s in req.stop:
            at = text.find(s)
            if at >= 0:
                req.text = text[:at]
                return self._finish(req, "stop")
        req.text = text
        if len(req.completion) >= req.params.max_new_tokens:
            return self._finish(req, "length")
        # hold back an incomplete character and what could still become a stop string
        hold = max((len(s) - 1 for s in req.stop), default=0)
        safe = len(text.rstrip("\ufffd")) - hold
        if safe > req.sent:
            req.emit(text[req.sent:safe], None)
            req.sent = safe
        return False

    def _finish(self, req: Request, reason: str, error: str | None = None) -> bool:
        req.error = error
        rest = req.text[req.sent:] if reason != "error" else ""
        req.sent = len(req.text)
        self.rngs.pop(id(req), None)
        req.emit(rest, reason)
        return True

    def _remove(self, i: int) -> None:
        """Free row i: the last running row moves into it."""
        last = len(self.rows) - 1
        if i != last:
            self.cache.move_row(i, last, self.cache.length)
            self.mask[i] = self.mask[last]
            self.next_ids[i] = self.next_ids[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.n = len(self.rows)
        if not self.rows:
            self.cache.length = 0


def complete(engine: Engine, prompt: list[int], params: SamplingParams, stop: list[str] | None = None,
             timeout: float = 600.0) -> tuple[str, list[int], str]:
    """One request through the engine, waited for: (text, completion ids, finish reason)."""
    done = threading.Event()
    reason: list[str] = []

    def emit(_delta: str, finish: str | None) -> None:
        if finish is not None:
            reason.append(finish)
            done.set()

    req = Request(list(prompt), params, emit, list(stop or []))
    engine.submit(req)
    if not done.wait(timeout):
        raise TimeoutError(f"no answer within {timeout} s")
    if reason[0] == "error":
        raise RuntimeError(req.error)
    return req.text, list(req.completion), reason[0]
