"""The continuous-batching engine (erniekit/infer/engine.py): requests that join and leave between
decode steps get exactly the tokens a single-request `generate` gives; stop strings, sampling
seeds, the context limit, a full time axis and cancellation."""

from __future__ import annotations

import threading

import numpy as np
import paddle
import pytest

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
    return ([list(map(int, rng.integers(5, vocab, size=int(rng.integers(2, 24))))) for _ in range(n)],
            [int(rng.integers(1, 24)) for _ in range(n)])


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
        cut = text[len(tokenizer.decode(full[:3])):][:2]  # a string that first shows after token 3
        assert cut
        str_stop = complete(engine, prompt, SamplingParams(max_new_tokens=12), stop=[cut])
    finally:
        engine.close()
    first = full.index(full[4])
    assert ids_stop[1] == full[:first] and ids_stop[2] == "stop"
    assert str_stop[2] == "stop" and cut not in str_stop[0] and text.startswith(str_stop[0])
    assert str_stop[0] == text[:text.index(cut)]


def test_seeded_sampling_repeats_and_differs_across_seeds(model, tokenizer):
    prompts, _ = _prompts(3, model.config.vocab_size, seed=5)
    engine = Engine(model, tokenizer, max_batch=3, max_model_len=64)
    try:
        a = _concurrently(engine, prompts, [16] * 3, temperature=1.0, top_p=0.9, seed=7)
        b = [complete(engine, p, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7))
             for p in prompts]  # alone, in another order: the same streams
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
