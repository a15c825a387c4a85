"""The continuous-batching engine (erniekit/infer/engine.py): requests that join and leave between
decode steps get exactly the tokens a single-request `generate` gives; stop strings, sampling
seeds, the context limit, a full time axis and cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import paddle
import pytest

from erniekit.errors import ErniekitError
from erniekit.infer import weight_packing
from erniekit.infer.engine import Engine, Request, complete
from erniekit.infer.generate import generate
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.5: peaked logits, so greedy choices are not decided by rounding
    paddle.seed(0)
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.5))
    m.eval()
    return m


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def _prompts(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        [list(map(int, rng.integers(5, vocab, size=int(rng.integers(2, 24))))) for _ in range(n)],
        [int(rng.integers(1, 24)) for _ in range(n)],
    )


def _concurrently(engine, prompts, lengths, **kw):
    out = [None] * len(prompts)

    def run(i):
        out[i] = complete(engine, prompts[i], SamplingParams(max_new_tokens=lengths[i], **kw))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("max_batch, max_len", [(4, 64), (16, 48)])
def test_joining_and_leaving_requests_get_the_single_request_tokens(model, tokenizer, max_batch, max_len):
    """12 requests of different prompt and output lengths, 4 (or all) decoded at once; with a
    48-token time axis the engine must also drop unused columns while others run."""
    prompts, lengths = _prompts(12, model.config.vocab_size)
    ref = [generate(model, [p], SamplingParams(max_new_tokens=n))[0] for p, n in zip(prompts, lengths)]
    engine = Engine(model, tokenizer, max_batch=max_batch, max_model_len=max_len)
    try:
        got = _concurrently(engine, prompts, lengths)
    finally:
        engine.close()
    assert [g[1] for g in got] == ref
    assert all(g[2] == "length" for g in got)
    assert engine.steps < sum(lengths)  # rows were decoded together, not one request after another


def test_stop_tokens_and_stop_strings_end_a_request_early(model, tokenizer):
    prompt = _prompts(1, model.config.vocab_size, seed=3)[0][0]
    full = generate(model, [prompt], SamplingParams(max_new_tokens=12))[0]
    engine = Engine(model, tokenizer, max_batch=2, max_model_len=64)
    try:
        ids_stop = complete(engine, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=[full[4]]))
        text = tokenizer.decode(full)
        cut = text[len(tokenizer.decode(full[:3])) :][:2]  # a string that first shows after token 3
        assert cut
        str_stop = complete(engine, prompt, SamplingParams(max_new_tokens=12), stop=[cut])
        # stop strings are searched in the new text only: any cut, spanning tokens or not, ends the
        # reply where its first occurrence starts (the earliest of several)
        for start in range(0, len(text) - 1, max(1, len(text) // 7)):
            for width in (1, 3, 8):
                s = text[start : start + width]
                got = complete(engine, prompt, SamplingParams(max_new_tokens=12), stop=["\x00never", s])
                assert got[0] == text[: text.index(s)] and got[2] == "stop", (s, got)
    finally:
        engine.close()
    first = full.index(full[4])
    assert ids_stop[1] == full[:first] and ids_stop[2] == "stop"
    assert str_stop[2] == "stop" and cut not in str_stop[0] and text.startswith(str_stop[0])
    assert str_stop[0] == text[: text.index(cut)]


def test_seeded_sampling_repeats_and_differs_across_seeds(model, tokenizer):
    prompts, _ = _prompts(3, model.config.vocab_size, seed=5)
    engine = Engine(model, tokenizer, max_batch=3, max_model_len=64)
    try:
        a = _concurrently(engine, prompts, [16] * 3, temperature=1.0, top_p=0.9, seed=7)
        b = [
            complete(engine, p, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7)) for p in prompts
        ]  # alone, in another order: the same streams
        c = complete(engine, prompts[0], SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=8))
    finally:
        engine.close()
    assert [x[1] for x in a] == [x[1] for x in b]
    assert c[1] != a[0][1]


def test_a_request_beyond_the_context_is_refused_before_it_runs(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=2, max_model_len=32)
    try:
        with pytest.raises(ValueError, match=r"prompt \(30 tokens\) plus max_tokens \(8\) exceeds the context of 32"):
            engine.submit(Request([5] * 30, SamplingParams(max_new_tokens=8), lambda d, f: None))
        assert complete(engine, [5, 6, 7], SamplingParams(max_new_tokens=4))[2] == "length"  # still serving
    finally:
        engine.close()


def test_a_cancelled_request_leaves_and_frees_its_row(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=256)
    seen, done = [], threading.Event()

    def emit(delta, finish):
        seen.append((delta, finish))
        if finish is not None:
            done.set()

    req = Request([5, 6, 7], SamplingParams(max_new_tokens=200), emit)
    try:
        engine.submit(req)
        while len(req.completion) < 3:
            pass
        req.cancelled = True
        assert done.wait(30) and seen[-1][1] == "cancelled" and len(req.completion) < 200
        assert complete(engine, [8, 9], SamplingParams(max_new_tokens=3))[2] == "length"  # the row is free again
    finally:
        engine.close()


def _endings(n: int):
    """Each request i's finish reason (ends[i]) and an event set when it ends (waits[i]), and
    emit_for(i), the emit that records them."""
    ends: dict[int, str] = {}
    waits = [threading.Event() for _ in range(n)]

    def emit_for(i):
        def emit(delta, finish):
            if finish is not None:
                ends[i] = finish
                waits[i].set()

        return emit

    return ends, waits, emit_for


def test_close_ends_every_running_and_waiting_request_and_refuses_new_ones(model, tokenizer):
    """close() with a request running and two waiting: each ends ("error", saying the engine was
    closed), so no caller waits forever; a request submitted afterwards is refused in one line."""
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=512)
    ends, waits, emit_for = _endings(3)

    reqs = [Request([5 + i, 6, 7], SamplingParams(max_new_tokens=500), emit_for(i)) for i in range(3)]
    engine.submit(reqs[0])
    while len(reqs[0].completion) < 2:
        pass
    engine.submit(reqs[1])
    engine.submit(reqs[2])
    engine.close()
    assert all(w.wait(5) for w in waits), ends
    assert all(ends[i] == "error" and "engine was closed" in reqs[i].error for i in range(3))
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.submit(Request([5, 6], SamplingParams(max_new_tokens=2), emit_for(0)))


def test_a_request_cancelled_while_it_waits_ends_at_once_behind_a_full_batch(model, tokenizer):
    """A client that goes away while its request waits behind a full batch: the request ends
    ("cancelled") at the next step, not when a row frees, so a server's queue place comes back
    while the batch keeps running; the waiting ones that stay run as before."""
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=512)
    ends, waits, emit_for = _endings(4)

    running = Request([5, 6, 7], SamplingParams(max_new_tokens=500), emit_for(0))
    queued = [Request([8 + i, 9], SamplingParams(max_new_tokens=2), emit_for(i)) for i in (1, 2, 3)]
    try:
        engine.submit(running)
        while len(running.completion) < 2:
            pass
        for r in queued:
            engine.submit(r)
        queued[0].cancelled = queued[1].cancelled = True
        assert waits[1].wait(30) and waits[2].wait(30) and ends[1] == ends[2] == "cancelled"
        assert queued[0].completion == queued[1].completion == []  # ended without a row
        assert not waits[0].is_set() and not waits[3].is_set()  # the batch still runs; the third still waits
        assert engine.queued() == 1
        running.cancelled = True
        assert waits[3].wait(60) and ends[3] == "length" and ends[0] == "cancelled"
        assert engine.queued() == 0
    finally:
        engine.close()


def test_free_rows_go_to_clients_in_turn_not_to_one_clients_backlog(model, tokenizer):
    """Client a's long request holds the only row and a has two more queued before b's one: when
    the row frees, b's request runs next (a had the last row), then a's in their order of arrival
    (on the old first-come order b ran last)."""
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=512)
    order: list[str] = []
    all_done = threading.Event()

    def emit_for(name):
        def emit(delta, finish):
            if finish is not None:
                order.append(name)
                if len(order) == 4:
                    all_done.set()

        return emit

    running = Request([5, 6, 7], SamplingParams(max_new_tokens=500), emit_for("a1"), client="a")
    queued = [
        Request([8 + i, 9], SamplingParams(max_new_tokens=2), emit_for(name), client=name[0])
        for i, name in enumerate(["a2", "a3", "b1"])
    ]
    try:
        engine.submit(running)
        deadline = time.monotonic() + 60
        while len(running.completion) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(running.completion) >= 2, running.error
        for r in queued:  # submitted before the row frees: the engine sees all three when it does
            engine.submit(r)
        running.cancelled = True
        assert all_done.wait(60), order
        assert order == ["a1", "b1", "a2", "a3"]
    finally:
        engine.close()


def _naive_turns(rows, waiting, last, turns, free):
    """The rule written plainly: each pick scans every client (fewest rows held, then the
    longest since its last turn, then its oldest request)."""
    from collections import Counter

    held, waiting, picked = Counter(r.client for r in rows), list(waiting), []
    while len(picked) < free and waiting:
        firsts = {}
        for i, r in enumerate(waiting):
            firsts.setdefault(r.client, i)
        c = min(firsts, key=lambda c: (held[c], last.get(c, -1), firsts[c]))
        r = waiting.pop(firsts[c])
        held[c] += 1
        turns += 1
        last[c] = turns
        picked.append(r)
    return picked, waiting, turns


def test_taking_in_turn_matches_the_rule_written_plainly():
    """The engine's heap of clients picks what a scan of every client picks, over refills that
    carry the turn table from one to the next (random clients, unnamed requests included)."""
    from collections import deque
    from types import SimpleNamespace

    rng = np.random.default_rng(3)
    for trial in range(200):
        names = [None, "a", "b", "c", "d", "e"][: 2 + trial % 5]
        fake = SimpleNamespace(rows=[], waiting=deque(), _last_turn={}, _turns=0)
        for _ in range(6):
            for _ in range(int(rng.integers(0, 9))):
                fake.waiting.append(SimpleNamespace(client=names[int(rng.integers(len(names)))]))
            if fake.rows:  # some running rows finish
                keep = rng.random(len(fake.rows)) < 0.5
                fake.rows = [r for r, k in zip(fake.rows, keep) if k]
            free = int(rng.integers(0, 5))
            # from the engine's own table (it prunes clients no longer present)
            want, want_waiting, _ = _naive_turns(fake.rows, fake.waiting, dict(fake._last_turn), fake._turns, free)
            got = Engine._take_in_turn(fake, free)
            assert [id(r) for r in got] == [id(r) for r in want], trial
            assert [id(r) for r in fake.waiting] == [id(r) for r in want_waiting], trial
            fake.rows += got


def test_a_client_hanging_up_while_the_engine_sweeps_the_waiting_requests_is_not_lost(model, tokenizer):
    """B's client goes away in the middle of the engine's sweep of cancelled waiting requests (made
    deterministic: reading A's flag the second time cancels B); B must still end ("cancelled"),
    at that sweep or the next, and not vanish from the queue unended (its server place would leak)."""
    ends: dict[str, str] = {}

    def emit_for(k):
        return lambda d, f: ends.__setitem__(k, f) if f is not None else None

    b = Request([9, 9], SamplingParams(max_new_tokens=2), emit_for("B"))

    class HangsUpB(Request):
        reads = 0

        @property
        def cancelled(self):
            self.reads += 1
            if self.reads == 2:
                b.cancelled = True
            return True

        @cancelled.setter
        def cancelled(self, value):
            pass

    a = HangsUpB([8, 9], SamplingParams(max_new_tokens=2), emit_for("A"))
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=512)
    running = Request([5, 6, 7], SamplingParams(max_new_tokens=500), emit_for("run"))
    try:
        engine.submit(running)
        while len(running.completion) < 2:
            pass
        engine.submit(b)
        engine.submit(a)
        for _ in range(600):
            if "B" in ends:
                break
            threading.Event().wait(0.05)
        assert ends.get("A") == ends.get("B") == "cancelled" and engine.queued() == 0
    finally:
        running.cancelled = True
        engine.close()


# ---- faults stay with the request that caused them (issue #23) --------------------------------


def _run_all(engine, jobs):
    """jobs: [(prompt, SamplingParams)] submitted together; [(text, ids, reason) or the error string]."""
    out = [None] * len(jobs)

    def run(i):
        try:
            out[i] = complete(engine, jobs[i][0], jobs[i][1], timeout=120)
        except RuntimeError as e:
            out[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_fault_in_one_sequence_fails_only_that_request(model, tokenizer, monkeypatch, caplog):
    """Three poison requests share the batch with six greedy ones: one gets NaN logits at its 3rd
    step, one raises while its token is processed, one raises inside its sampling. They fail
    (with the cause in the error); every other request keeps exactly its single-request tokens.
    The operator's log says once what to check about the NaN (the client only learns it failed)."""
    prompts, lengths = _prompts(9, model.config.vocab_size, seed=11)
    lengths = [max(n, 8) for n in lengths]
    ref = [generate(model, [p], SamplingParams(max_new_tokens=n))[0] for p, n in zip(prompts, lengths)]
    nan_p = SamplingParams(max_new_tokens=lengths[6])
    raise_p = SamplingParams(max_new_tokens=lengths[7])
    sample_p = SamplingParams(max_new_tokens=lengths[8], temperature=0.7, seed=1)
    engine = Engine(model, tokenizer, max_batch=16, max_model_len=64)
    real_sample, real_advance, real_choose = engine._sample, engine._advance, engine._choose

    def sample(logits, reqs):
        logits = logits.copy()
        for i, r in enumerate(reqs):
            if r.params is nan_p and len(r.completion) >= 2:
                logits[i, 3] = np.nan
        return real_sample(logits, reqs)

    def advance(req, tok):
        if req.params is raise_p and len(req.completion) >= 2:
            raise KeyError("injected fault")
        return real_advance(req, tok)

    def choose(req, row):
        if req.params is sample_p and len(req.completion) >= 1:
            raise ValueError("injected sampling fault")
        return real_choose(req, row)

    monkeypatch.setattr(engine, "_sample", sample)
    monkeypatch.setattr(engine, "_advance", advance)
    monkeypatch.setattr(engine, "_choose", choose)
    try:
        jobs = [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[:6], lengths[:6])]
        jobs += [(prompts[6], nan_p), (prompts[7], raise_p), (prompts[8], sample_p)]
        got = _run_all(engine, jobs)
        assert [g[1] for g in got[:6]] == ref[:6]
        assert "non-finite logits" in got[6] and "KeyError: 'injected fault'" in got[7]
        assert "sampling failed: ValueError: injected sampling fault" in got[8]
        nan_logs = [r.getMessage() for r in caplog.records if "non-finite logits" in r.getMessage()]
        assert len(nan_logs) == 1 and "check the checkpoint's weights" in nan_logs[0], nan_logs
        assert not engine.rows and complete(engine, prompts[0], SamplingParams(max_new_tokens=lengths[0]))[1] == ref[0]
    finally:
        engine.close()


def test_a_prefill_that_raises_fails_only_the_request_that_broke_it(model, tokenizer, monkeypatch):
    prompts, lengths = _prompts(5, model.config.vocab_size, seed=12)
    ref = [generate(model, [p], SamplingParams(max_new_tokens=n))[0] for p, n in zip(prompts, lengths)]
    poison = [7, 7, 7, 7]
    engine = Engine(model, tokenizer, max_batch=8, max_model_len=64)
    real = engine._prefill_forward

    def forward(reqs):
        if any(r.prompt == poison for r in reqs):
            raise RuntimeError("injected prefill fault")
        return real(reqs)

    monkeypatch.setattr(engine, "_prefill_forward", forward)
    try:
        got = _run_all(
            engine,
            [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
            + [(poison, SamplingParams(max_new_tokens=4))],
        )
    finally:
        engine.close()
    assert [g[1] for g in got[:5]] == ref and "injected prefill fault" in got[5]


def test_bad_sampling_values_are_refused_before_they_reach_the_batch(model, tokenizer):
    for kw, match in [
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\]"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    engine = Engine(model, tokenizer, max_batch=2, max_model_len=32)
    try:
        with pytest.raises(ValueError, match="logit_bias key 99999 is outside the vocabulary"):
            engine.submit(Request([5, 6], SamplingParams(max_new_tokens=4, logit_bias={99999: 1.0}), lambda d, f: None))
        with pytest.raises(ValueError, match="prompt token id -3 is outside the vocabulary"):
            engine.submit(Request([5, -3], SamplingParams(max_new_tokens=4), lambda d, f: None))
    finally:
        engine.close()


def test_logit_bias_and_penalties_steer_only_their_own_row(model, tokenizer):
    prompts, _ = _prompts(2, model.config.vocab_size, seed=13)
    plain = generate(model, [prompts[0]], SamplingParams(max_new_tokens=6))[0]
    engine = Engine(model, tokenizer, max_batch=4, max_model_len=64)
    try:
        got = _run_all(
            engine,
            [
                (prompts[0], SamplingParams(max_new_tokens=6, logit_bias={42: 100.0})),
                (prompts[0], SamplingParams(max_new_tokens=6, logit_bias={plain[0]: -100.0})),
                (prompts[0], SamplingParams(max_new_tokens=6, frequency_penalty=2.0, presence_penalty=2.0)),
                (prompts[0], SamplingParams(max_new_tokens=6)),
            ],
        )
    finally:
        engine.close()
    assert got[0][1] == [42] * 6  # +100 wins every step
    assert got[1][1][0] != plain[0]  # -100 removes the greedy choice
    assert len(set(got[2][1])) >= len(set(plain))  # penalties never repeat more than plain greedy
    assert got[3][1] == plain  # the neighbours' biases did not leak into this row


def test_a_context_beyond_the_model_or_a_cache_beyond_the_memory_is_refused_at_start(model, tokenizer, monkeypatch):
    positions = model.config.max_position_embeddings
    with pytest.raises(
        ErniekitError, match=rf"--max-model-len {positions + 1} is longer than .*use at most {positions}"
    ):
        Engine(model, tokenizer, max_batch=1, max_model_len=positions + 1)
    # 4 layers x (k + v) x 64 rows x 2048 x 2 heads x 32 x 4 bytes + the int64 mask = 257 MiB
    monkeypatch.setattr(weight_packing, "available_memory", lambda: 2**27)
    with pytest.raises(
        ErniekitError,
        match=r"KV cache of 64 requests x 2048 positions needs 257 MiB, 128 MiB of memory is available; lower",
    ):
        Engine(model, tokenizer, max_batch=64, max_model_len=2048)
    engine = Engine(model, tokenizer, max_batch=2, max_model_len=64)  # 4 MiB: fits
    engine.close()


def test_a_reply_ended_by_a_stop_token_counts_it_among_the_tokens_taken(model, tokenizer):
    """The stop token was generated and scored (its log-probability entry), so the usage the server
    reports counts it; `completion` (the text's ids) leaves it out."""
    engine = Engine(model, tokenizer, max_batch=2, max_model_len=64)
    try:
        free = complete(engine, [5, 6, 7], SamplingParams(max_new_tokens=6))[1]
        stop = next(t for i, t in enumerate(free) if i and t not in free[:i])
        ended = threading.Event()
        req = Request(
            [5, 6, 7],
            SamplingParams(max_new_tokens=6, stop_token_ids=[stop]),
            lambda d, f: ended.set() if f else None,
            logprobs=0,
        )
        engine.submit(req)
        assert ended.wait(60)
    finally:
        engine.close()
    assert req.completion == free[: free.index(stop)] and req.ended_on_stop_token
    assert len(req.token_logprobs) == len(req.completion) + 1


def test_a_failure_while_placing_prefilled_requests_ends_the_ones_it_had_not_placed(model, tokenizer, monkeypatch):
    """Three prompts prefilled together; copying the second into its row raises. The first has a
    row (the engine's loop then fails the running rows, as for any failed step); the second and
    third end with the error at once instead of being dropped, their callers waiting forever.
    Run on the test's thread, with the engine's own thread stopped."""
    engine = Engine(model, tokenizer, max_batch=4, max_model_len=64)
    engine.close()
    ends, waits, emit_for = _endings(3)
    reqs = [Request([5 + i, 6, 7], SamplingParams(max_new_tokens=4), emit_for(i)) for i in range(3)]
    put, calls = engine.cache.put, []

    def put_failing_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("copying the keys failed")
        return put(*args)

    monkeypatch.setattr(engine.cache, "put", put_failing_second)
    with pytest.raises(RuntimeError, match="copying the keys failed"):
        engine._prefill_isolated(reqs)
    assert engine.rows == [reqs[0]] and not reqs[0].finished
    assert ends == {1: "error", 2: "error"} and all("copying the keys failed" in reqs[i].error for i in (1, 2))


def test_a_request_ends_once_even_if_ended_twice(model, tokenizer):
    """A failing step ends every running row, some of which the step may have ended already: the
    second end is ignored (its caller saw one finish, with the first reason)."""
    engine = Engine(model, tokenizer, max_batch=1, max_model_len=64)
    engine.close()
    seen = []
    req = Request([5, 6], SamplingParams(max_new_tokens=2), lambda delta, finish: seen.append(finish))
    engine._finish(req, "stop")
    engine._finish(req, "error", "the step failed")
    assert seen == ["stop"] and req.error is None and req.finished
