"""`erniekit server` with the official `openai` client against a live server: 64 concurrent
streaming requests each get the single-request greedy text; bad requests get OpenAI-shaped 4xx
errors and the server keeps serving; the API key; the FastDeploy hand-off's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import paddle
import pytest
from launched_jobs import free_port, serve

from erniekit.infer.chat import chat_prompt_ids, stop_ids
from erniekit.infer.generate import generate
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

openai = pytest.importorskip("openai")
ROOT = str(Path(__file__).resolve().parents[2])
MODEL = "tiny-test"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("srv") / "ckpt")
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.5))
    save_pretrained(model, path, tokenizer=default_tokenizer())
    return path


@pytest.fixture(scope="module")
def live(ckpt):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    yield from (
        base
        for _ in serve(
            [
                "server",
                ckpt,
                "--port",
                str(port),
                "--max-batch",
                "16",
                "--max-model-len",
                "256",
                "--served-model-name",
                MODEL,
            ],
            base + "/health",
            ROOT,
        )
    )


def _reference(ckpt, prompts, max_tokens):
    """What each request gives alone: greedy generate on the same checkpoint, decoded."""
    from erniekit.infer.chat import load_chat_model

    model, tok = load_chat_model(ckpt)
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stop_ids(model, tok))
    out = []
    for kind, p in prompts:
        ids = chat_prompt_ids(tok, p) if kind == "chat" else tok.encode(p)
        toks = generate(model, [ids], params)[0]
        out.append(tok.decode(toks))
    return out


def test_64_concurrent_streams_each_get_the_single_request_text(live, ckpt):
    rng = np.random.default_rng(0)
    words = ["one", "two", "add", "three", "plus", "what", "is", "seven", "nine", "ten", "=", "?"]
    prompts = []
    for i in range(64):
        text = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
        prompts.append(("chat", [{"role": "user", "content": text}]) if i % 2 == 0 else ("completion", text))
    want = _reference(ckpt, prompts, 12)
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one(i):
        kind, p = prompts[i]
        if kind == "chat":
            stream = client.chat.completions.create(model=MODEL, messages=p, max_tokens=12, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(one, range(64)))
    assert got == want
    assert len(set(want)) > 10  # the prompts lead to different texts: a mix-up would show


def test_whole_responses_usage_and_models(live, ckpt):
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == _reference(ckpt, [("chat", messages)], 5)[0]
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == [MODEL]


def _post(url, data: bytes, headers=None):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(live):
    chat = live + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    cases = [
        (b'{"model": "tiny-test", "messages": [', 400, None),
        (json.dumps({**ok, "model": "gpt-4"}).encode(), 404, "model_not_found"),
        (json.dumps({**ok, "max_tokens": -5}).encode(), 400, None),
        (
            json.dumps({**ok, "messages": [{"role": "user", "content": "x " * 400}]}).encode(),
            400,
            "context_length_exceeded",
        ),
        (json.dumps({**ok, "n": 2}).encode(), 400, None),
        (json.dumps({**ok, "temperature": 7}).encode(), 400, None),
        (json.dumps({**ok, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, None),
        (json.dumps([1, 2]).encode(), 400, None),
    ]
    for body, status, code in cases:
        got, err = _post(chat, body)
        assert got == status, (body[:60], err)
        assert set(err) == {"error"} and err["error"]["message"] and err["error"]["type"], err
        if code:
            assert err["error"]["code"] == code
    assert _post(live + "/v1/nothing", b"{}")[0] == 404
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=ok["messages"])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    status, good = _post(chat, json.dumps(ok).encode())
    assert status == 200 and good["choices"][0]["message"]["role"] == "assistant"


def test_api_key_is_required_when_set(ckpt):
    from fastapi.testclient import TestClient

    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.engine import Engine
    from erniekit.infer.server import OpenAIServer, build_app

    model, tok = load_chat_model(ckpt)
    engine = Engine(model, tok, max_batch=2, max_model_len=128, stop_token_ids=stop_ids(model, tok))
    try:
        app = build_app(OpenAIServer(engine, tok, MODEL, api_key="s3cret"))
        with TestClient(app) as c:
            body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
            assert c.get("/health").status_code == 200  # health needs no key
    finally:
        engine.close()


def test_server_cli_errors_are_one_line(ckpt):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "server", ckpt, "--port", "99999"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip() == "error: server: --port 99999 must be in 1..65535"
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "server", ckpt, "--backend", "fastdeploy"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--backend fastdeploy needs" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_requests_are_counted_by_their_peer_address(ckpt, monkeypatch):
    """Over HTTP the server names each request's client by the connection's peer address: more
    prompts in one request than one client's share are refused (400: waiting would not help); the
    engine's requests carry the address (what it takes turns by)."""
    from fastapi.testclient import TestClient

    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.engine import Engine
    from erniekit.infer.server import OpenAIServer, build_app

    model, tok = load_chat_model(ckpt)
    engine = Engine(model, tok, max_batch=2, max_model_len=128, stop_token_ids=stop_ids(model, tok))
    clients, submit = [], engine.submit
    monkeypatch.setattr(engine, "submit", lambda req: (clients.append(req.client), submit(req))[1])
    try:
        app = build_app(OpenAIServer(engine, tok, MODEL, max_queued=4))  # 2 per client
        with TestClient(app) as c:
            body = {"model": MODEL, "prompt": ["1+1=", "2+2=", "3+3="], "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400 and "--max-queued-per-client" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={**body, "prompt": ["1+1=", "2+2="]})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        with TestClient(app, client=("2001:db8:7:9:a::5", 41000)) as c:  # an IPv6 peer counts as its /64
            r = c.post("/v1/completions", json={**body, "prompt": "1+1="})
            assert r.status_code == 200
        assert clients == ["testclient", "testclient", "2001:db8:7:9::/64"]  # Starlette's test client, then IPv6
    finally:
        engine.close()
