"""Log-probabilities, echo and every OpenAI prompt form on the real engine (issue #28): the values
equal a direct forward of the model (log-softmax of the full sequence's logits), whatever the
batch around a request; the legacy and chat shapes as the `openai` client reads them; the
tokenizer endpoints lm-eval's remote tokenizer uses; one-line 400s for malformed asks."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from engine_requests import submit_and_wait

from erniekit.infer.engine import Engine, Request, token_logprobs
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from erniekit.infer.server import OpenAIServer, build_app  # noqa: E402

MODEL = "m"


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.5))
    m.eval()
    return m


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def engine(model, tok):
    e = Engine(model, tok, max_batch=4, max_model_len=128)
    yield e
    e.close()


@pytest.fixture(scope="module")
def http(engine, tok):
    with TestClient(build_app(OpenAIServer(engine, tok, MODEL))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def _direct(model, ids: list[int]) -> np.ndarray:
    """log-softmax of the logits of `ids` alone [len(ids), V], float64."""
    with paddle.no_grad():
        z = model(paddle.to_tensor([ids])).logits[0].astype("float32").numpy().astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_token_logprobs_is_the_log_softmax_with_its_top_k_in_order():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32) * 4
    logits[2, [7, 9]] = 30.0  # a tie: the lower id first
    chosen = rng.integers(0, 50, size=5)
    got = token_logprobs(logits, chosen, 3)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for i, e in enumerate(got):
        assert e.id == chosen[i] and e.logprob == pytest.approx(ref[i, chosen[i]], rel=1e-6, abs=1e-5)
        assert [t for t, _ in e.top] == list(np.argsort(-ref[i], kind="stable")[:3])
        assert [v for _, v in e.top] == pytest.approx(sorted(ref[i], reverse=True)[:3], rel=1e-6, abs=1e-5)
        if e.id == e.top[0][0]:  # the chosen value and the top values come from one computation
            assert e.logprob == e.top[0][1]
    assert [t for t, _ in got[2].top][:2] == [7, 9]
    assert all(e.top == () for e in token_logprobs(logits, chosen, 0))


def test_one_left_padded_prefill_scores_each_prompt_as_a_forward_over_it_alone(model, tok):
    """The prefill's own batch (not left to the engine thread's timing): three prompts of different
    lengths, left-padded into one forward, each scored from its own positions."""
    e = Engine(model, tok, max_batch=4, max_model_len=64)
    try:
        rng = np.random.default_rng(2)
        prompts = [list(map(int, rng.integers(5, 1000, size=n))) for n in (4, 19, 11)]
        reqs = [Request(p, SamplingParams(max_new_tokens=2), None, prompt_logprobs=1) for p in prompts]
        _, _, _, scored = e._prefill_forward(reqs)
    finally:
        e.close()
    for p, lps in zip(prompts, scored):
        ref = _direct(model, p)
        # float32 GEMMs of another batch shape (left-padded rows): ~1e-5 of a log-probability's size
        # (measured 1.15e-4 at -14.26 under a 3-process load, AVX-512 kernels)
        np.testing.assert_allclose([x.logprob for x in lps], ref[np.arange(len(p) - 1), p[1:]], rtol=2e-5, atol=1e-4)
        assert [x.top[0][0] for x in lps] == list(ref[:-1].argmax(-1))


def test_prompt_and_generated_logprobs_equal_a_direct_forward_in_a_mixed_batch(engine, model):
    """Three prompts of different lengths prefilled together (left padding), one of them scored
    only (max_tokens 0): each prompt token's log-probability, and each generated one's, equals the
    log-softmax of a forward over that request's own tokens."""
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(5, 1000, size=n))) for n in (3, 17, 9)]
    reqs = [
        Request(p, SamplingParams(max_new_tokens=6), None, logprobs=2, prompt_logprobs=2, prompt_only=(i == 1))
        for i, p in enumerate(prompts)
    ]
    submit_and_wait(engine, reqs)
    for r in reqs:
        full = r.prompt + r.completion
        ref = _direct(model, full)
        assert [e.id for e in r.prompt_token_logprobs] == r.prompt[1:]
        got = np.array([e.logprob for e in r.prompt_token_logprobs])
        np.testing.assert_allclose(got, ref[np.arange(len(r.prompt) - 1), r.prompt[1:]], atol=1e-4)
        if r.prompt_only:
            assert r.completion == [] and r.token_logprobs == []
            continue
        assert [e.id for e in r.token_logprobs] == r.completion
        at = np.arange(len(r.prompt) - 1, len(full) - 1)
        np.testing.assert_allclose([e.logprob for e in r.token_logprobs], ref[at, r.completion], atol=1e-4)
        assert all(e.top[0][0] == e.id for e in r.token_logprobs)  # greedy: the chosen token is the likeliest


def test_completions_take_every_prompt_form_with_a_choice_each(http, client, tok):
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in ("1+2=", "Hi")]
    texts = [c.choices[0].text for c in single]
    both = client.completions.create(model=MODEL, prompt=["1+2=", "Hi"], max_tokens=5, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == texts
    assert both.usage.prompt_tokens == sum(c.usage.prompt_tokens for c in single)
    ids = [tok.encode("1+2="), tok.encode("Hi")]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    assert one.choices[0].text == texts[0]
    lists = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in lists.choices] == texts
    echoed = client.completions.create(model=MODEL, prompt=["1+2=", "Hi"], max_tokens=5, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == ["1+2=" + texts[0], "Hi" + texts[1]]
    echoed = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == tok.decode(ids[1], skip_special_tokens=False) + texts[1]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, model, tok):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, token-id lists; and the
    legacy scoring form max_tokens 0."""
    ctx, cont = tok.encode("What is 7 plus 5?"), tok.encode(" Twelve.")
    seq = ctx + cont
    r = client.completions.create(model=MODEL, prompt=[seq, ctx], max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(seq) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _direct(model, seq)
    want = ref[np.arange(len(ctx) - 1, len(seq) - 1), cont].sum()
    assert sum(lp.token_logprobs[len(ctx) : -1]) == pytest.approx(want, abs=1e-4)
    greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert greedy == bool((ref[:-1].argmax(-1) == np.array(seq[1:])).all())
    assert lp.tokens[: len(seq)] == [t.replace("\u2581", " ") for t in tok.convert_ids_to_tokens(seq)]
    assert lp.text_offset[1] == len(lp.tokens[0])
    zero = client.completions.create(model=MODEL, prompt=seq, max_tokens=0, logprobs=0, echo=True)
    z = zero.choices[0]
    assert z.text == tok.decode(seq, skip_special_tokens=False) and z.finish_reason == "length"
    assert z.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(seq)], rel=1e-5, abs=1e-4)
    assert z.logprobs.top_logprobs[1:] == [{}] * (len(seq) - 1)  # logprobs 0: no alternatives


def test_streamed_prompts_and_logprobs_add_up_to_the_whole_reply(http, tok):
    """Each choice's chunks add up to its whole reply; the echoed prompt's chunk carries the prompt's
    tokens only, and each piece of generated text the tokens decided up to it (never none)."""
    body = {"model": MODEL, "prompt": ["1+2=", "Hello"], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"]
    text, lps, chunks = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])["choices"][0]
            text[c["index"]] += c["text"]
            chunks[c["index"]].append(c)
            if c["logprobs"]:
                lps[c["index"]] += c["logprobs"]["token_logprobs"]
    for c in whole:
        i = c["index"]
        first = chunks[i][0]
        assert first["text"] == ["1+2=", "Hello"][i]
        assert len(first["logprobs"]["tokens"]) == len(tok.encode(first["text"]))
        assert all(len(x["logprobs"]["tokens"]) >= 1 for x in chunks[i][1:] if x["text"])
        assert text[i] == c["text"]
        assert lps[c["index"]] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5)  # batching may differ


def test_chat_logprobs_through_the_openai_client(client, model, tok):
    from erniekit.infer.chat import chat_prompt_ids

    msgs = [{"role": "user", "content": "1+2="}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 3 for c in content)
    prompt = chat_prompt_ids(tok, msgs)
    first = _direct(model, prompt)[-1]
    assert content[0].logprob == pytest.approx(first.max(), abs=1e-4)
    assert content[0].top_logprobs[0].logprob == content[0].logprob
    assert bytes(content[0].bytes).decode() == content[0].token
    assert r.usage.completion_tokens == len(content)  # a stop token that ended the reply: in both
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_usage_counts_the_stop_token_its_logprobs_show(model, tok):
    """A reply that ends on a stop token: that token has a log-probability entry, so
    completion_tokens counts it too (vLLM's convention), whole and streamed."""
    from erniekit.infer.stops import stop_ids

    stops = stop_ids(model, tok)
    engine = Engine(model, tok, max_batch=2, max_model_len=64, stop_token_ids=stops)
    try:
        with TestClient(build_app(OpenAIServer(engine, tok, MODEL))) as http:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "1+2="}],
                "max_tokens": 5,
                "logprobs": True,
                "logit_bias": {str(stops[0]): 100},  # the first token taken ends the reply
            }
            r = http.post("/v1/chat/completions", json=body).json()
            choice = r["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
            assert len(choice["logprobs"]["content"]) == r["usage"]["completion_tokens"] == 1
            lines = http.post(
                "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            ).text.splitlines()
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert chunks[-1]["usage"]["completion_tokens"] == 1
    finally:
        engine.close()


def test_byte_pieces_report_their_own_byte_in_chat_logprobs(tok):
    """A character split over byte tokens: each token's `bytes` is its byte, so a client rebuilds
    the character by joining them (its text is OpenAI's "bytes:\\xNN")."""
    from erniekit.infer.engine import TokenLogprob
    from erniekit.infer.openai_logprobs import TokenTexts, chat_logprobs

    texts = TokenTexts(tok.convert_ids_to_tokens(range(len(tok))))
    ids = tok.encode("中")
    assert len(ids) == 3 and all(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    content = chat_logprobs(texts, [TokenLogprob(i, -1.0, ((i, -1.0),)) for i in ids])["content"]
    assert bytes(sum((c["bytes"] for c in content), [])).decode("utf-8") == "中"
    assert content[0]["token"] == "bytes:\\xe4" and content[0]["top_logprobs"][0]["bytes"] == [0xE4]


def test_a_request_for_more_log_probabilities_than_a_budget_is_refused(http, monkeypatch):
    import erniekit.infer.server as srv

    monkeypatch.setattr(srv, "MAX_LOGPROB_ENTRIES", 100_000)  # this test's context holds 127 tokens a prompt
    prompt = [[5] * 100] * 64  # 6400 prompt tokens x 21 > 100k
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 0},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logprobs" and err["code"] == "too_many_logprobs"
    ok = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [5] * 100, "echo": True, "logprobs": 20, "max_tokens": 0}
    )
    assert ok.status_code == 200


def test_tokenizer_endpoints_round_trip(http, tok):
    got = http.post("/tokenize", json={"prompt": "What is 7 plus 5?", "add_special_tokens": False}).json()
    assert got["tokens"] == tok.encode("What is 7 plus 5?") and got["count"] == len(got["tokens"])
    back = http.post("/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == "What is 7 plus 5?"
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.special_tokens["eos_token"] and "{%" in info["chat_template"]
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    # more ids than the context (128 here): refused before the tokenizer's shared worker decodes them
    r = http.post("/detokenize", json={"tokens": got["tokens"] * 40})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "context of 128" in r.text
    assert http.post("/detokenize", json={"tokens": [got["tokens"][0]] * 128}).status_code == 200


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/v1/completions", {"prompt": ["a", [5]]}, "prompt"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]"),
        ("/v1/completions", {"prompt": [[5], [10**9]]}, "prompt[1]"),
        ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
        ("/v1/chat/completions", {"logprobs": 5}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
def test_malformed_logprob_and_prompt_asks_are_one_line_400s(http, path, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    r = http.post(path, json={**base, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"]
