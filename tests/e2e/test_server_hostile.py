"""`erniekit server` against hostile and careless clients (issue #23), on a live server on
127.0.0.1: a fuzz of poison bodies sent among well-formed greedy requests (each innocent keeps
exactly its solo text, each poison gets an OpenAI-shaped 4xx, the server stays up), a table of
bad requests each naming its parameter, 413 for a 10 MB body without stalling a neighbour and
with bounded memory, the API key (constant-time comparison, from the environment, never printed)
and the FastDeploy command (key and quantization passed, key not shown)."""

from __future__ import annotations

import http.client
import json
import os
import random
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launched_jobs import free_port, serve
from test_server import MODEL, ckpt  # noqa: F401 - the module's checkpoint fixture

ROOT = str(Path(__file__).resolve().parents[2])
KEY = "sk-hostile-test-7f3a9c"  # given through ERNIEKIT_API_KEY only
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 256


@pytest.fixture(scope="module")
def live(ckpt, tmp_path_factory):  # noqa: F811
    """A server whose key comes from the environment; its whole output is kept to check that the
    key never shows in it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    old = os.environ.get("ERNIEKIT_API_KEY")
    os.environ["ERNIEKIT_API_KEY"] = KEY
    try:
        gen = serve(
            [
                "server",
                ckpt,
                "--port",
                str(port),
                "--max-batch",
                "8",
                "--max-model-len",
                str(CTX),
                "--served-model-name",
                MODEL,
                "--log-level",
                "info",
            ],
            base + "/health",
            ROOT,
        )
        proc = next(gen)
    finally:
        if old is None:
            del os.environ["ERNIEKIT_API_KEY"]
        else:
            os.environ["ERNIEKIT_API_KEY"] = old
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # keeps the pipe drained
    reader.start()
    yield {"base": base, "port": port, "proc": proc, "lines": lines}
    gen.close()
    reader.join(timeout=10)


def post(port: int, path: str, body: bytes, headers: dict | None = None, timeout: float = 120):
    """(status, parsed JSON or raw text) for any bytes as the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw.decode("utf-8", "replace")


def assert_openai_error(status: int, got, param: str | None = None, code: str | None = None) -> str:
    assert isinstance(got, dict) and set(got) == {"error"}, (status, got)
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
    assert "Traceback" not in err["message"] and KEY not in err["message"]
    if param is not None:
        assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


def chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def enc(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN / Infinity written as Python does


# ---- the table: one bad request each, its status, the parameter named -------------------------
C, P = "/v1/chat/completions", "/v1/completions"
OKP = {"model": MODEL, "prompt": "1+1=", "max_tokens": 4}
BAD = [
    ("nan temperature", C, chat("hi", temperature=float("nan")), 400, "temperature", None),
    ("infinite top_p", C, chat("hi", top_p=float("inf")), 400, "top_p", None),
    (
        "1e400 temperature",
        C,
        b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
        400,
        "temperature",
        None,
    ),
    ("negative temperature", C, chat("hi", temperature=-0.5), 400, "temperature", None),
    ("temperature above 2", P, {**OKP, "temperature": 2.5}, 400, "temperature", None),
    ("string temperature", P, {**OKP, "temperature": "0.7"}, 400, "temperature", None),
    ("bool temperature", P, {**OKP, "temperature": True}, 400, "temperature", None),
    ("top_p zero", P, {**OKP, "top_p": 0}, 400, "top_p", None),
    ("presence_penalty 3", P, {**OKP, "presence_penalty": 3}, 400, "presence_penalty", None),
    ("frequency_penalty nan", P, {**OKP, "frequency_penalty": float("nan")}, 400, "frequency_penalty", None),
    ("negative seed", P, {**OKP, "seed": -1}, 400, "seed", None),
    ("float seed", P, {**OKP, "seed": 1.5}, 400, "seed", None),
    ("huge seed", P, {**OKP, "seed": 2**70}, 400, "seed", None),
    ("n=2", C, chat("hi", n=2), 400, "n", None),
    ("huge n", C, chat("hi", n=10**9), 400, "n", None),
    ("max_tokens 0", P, {**OKP, "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens float", P, {**OKP, "max_tokens": 2.5}, 400, "max_tokens", None),
    ("max_tokens beyond the context", P, {**OKP, "max_tokens": 10**12}, 400, "max_tokens", None),
    (
        "prompt + max_tokens beyond the context",
        P,
        {**OKP, "max_tokens": CTX - 2},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("max_completion_tokens negative", C, chat("hi", max_completion_tokens=-3), 400, "max_completion_tokens", None),
    ("stream as a string", C, chat("hi", stream="yes"), 400, "stream", None),
    (
        "include_usage as a number",
        C,
        chat("hi", stream=True, stream_options={"include_usage": 1}),
        400,
        "stream_options.include_usage",
        None,
    ),
    ("echo as a string", P, {**OKP, "echo": "no"}, 400, "echo", None),
    ("five stop strings", P, {**OKP, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("empty stop string", P, {**OKP, "stop": [""]}, 400, "stop", None),
    ("stop as a number", P, {**OKP, "stop": 7}, 400, "stop", None),
    ("logit_bias key not an id", P, {**OKP, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("logit_bias key beyond the vocabulary", P, {**OKP, "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    ("logit_bias key with a blank", P, {**OKP, "logit_bias": {" 5": 1}}, 400, "logit_bias", None),
    ("logit_bias key 1_0", P, {**OKP, "logit_bias": {"1_0": 1}}, 400, "logit_bias", None),
    ("logit_bias value 101", P, {**OKP, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("logit_bias value nan", P, {**OKP, "logit_bias": {"5": float("nan")}}, 400, "logit_bias", None),
    ("logit_bias as a list", P, {**OKP, "logit_bias": [5, 1]}, 400, "logit_bias", None),
    ("unknown model", C, chat("hi", model="gpt-4"), 404, "model", "model_not_found"),
    ("model as a number", C, chat("hi", model=5), 400, "model", None),
    ("messages empty", C, {"model": MODEL, "messages": []}, 400, "messages", None),
    (
        "message role robot",
        C,
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        None,
    ),
    (
        "message content a number",
        C,
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        None,
    ),
    (
        "message content an image",
        C,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        },
        400,
        "messages[0].content[0]",  # a text model: "reads no images"
        None,
    ),
    ("message not an object", C, {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]", None),
    (
        "reasoning_content a number",
        C,
        {
            "model": MODEL,
            "messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}, *chat("y")["messages"]],
        },
        400,
        "messages[0].reasoning_content",
        None,
    ),
    (
        "more messages than OpenAI allows",
        C,
        {"model": MODEL, "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 1025},
        400,
        "messages",
        None,
    ),
    # a lone surrogate is valid JSON (an escape) but not text: the tokenizer could not take it
    (
        "unpaired surrogate in a message",
        C,
        b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
        400,
        "messages[0].content",
        None,
    ),
    (
        "unpaired surrogate in a prompt",
        P,
        b'{"model": "tiny-test", "prompt": ["ok", "x\\udfff"]}',
        400,
        "prompt[1]",
        None,
    ),
    (
        "stream_options without stream",
        C,
        chat("hi", stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
    ),
    ("prompt token id out of vocabulary", P, {**OKP, "prompt": [5, 10**9]}, 400, "prompt", None),
    ("prompt negative token id", P, {**OKP, "prompt": [-1]}, 400, "prompt", None),
    ("prompt empty list", P, {**OKP, "prompt": []}, 400, "prompt", None),
    ("prompt far beyond the context", P, {**OKP, "prompt": "x" * 200_000}, 400, "prompt", "context_length_exceeded"),
    ("logprobs as a number in chat", C, chat("hi", logprobs=5), 400, "logprobs", None),
    ("top_logprobs without logprobs", C, chat("hi", top_logprobs=2), 400, "top_logprobs", None),
    ("logprobs beyond 20", P, {**OKP, "logprobs": 21}, 400, "logprobs", None),
    ("prompts of mixed forms", P, {**OKP, "prompt": ["a", [5]]}, 400, "prompt", None),
    ("tools asked for", C, chat("hi", tools=[{"type": "function"}]), 400, "tools", None),
    ("best_of 3", P, {**OKP, "best_of": 3}, 400, "best_of", None),
    ("body a list", C, [1, 2], 400, None, None),
    ("body empty", C, b"", 400, None, None),
    ("body malformed", C, b'{"model": "tiny-test", "messages": [', 400, None, None),
    ("body not UTF-8", C, b'{"model": "tiny-\xff\xfe"}', 400, None, None),
    ("body UTF-16", C, '{"model": "x"}'.encode("utf-16"), 400, None, None),
    (
        "body nested 40 deep",
        C,
        {**chat("hi"), "user": None, "metadata": json.loads("[" * 40 + "]" * 40)},
        400,
        None,
        "json_too_deep",
    ),
    ("body nested 100000 deep", C, b"[" * 100_000 + b"]" * 100_000, 400, None, "json_too_deep"),
    (
        "number of 5000 digits",
        P,
        b'{"model": "tiny-test", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        400,
        None,
        None,
    ),
]


@pytest.mark.parametrize("path, body, status, param, code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_bad_request_gets_one_openai_shaped_line_naming_its_parameter(live, path, body, status, param, code):
    got_status, got = post(live["port"], path, enc(body))
    assert got_status == status, got
    assert_openai_error(got_status, got, param, code)


def test_a_prompt_that_fills_the_context_without_max_tokens_is_told_to_shorten(live):
    """It was told to lower max_tokens, which it never sent."""
    status, got = post(live["port"], P, enc({"model": MODEL, "prompt": [5] * CTX}))
    assert status == 400, got
    assert_openai_error(status, got, "prompt", "context_length_exceeded")
    message = got["error"]["message"]
    assert f"the prompt ({CTX} tokens) leaves no room for a reply" in message and "max_tokens" not in message


def test_a_vanishing_temperature_samples_the_greedy_reply(live):
    """temperature 1e-308 is in range: z / T overflowed to inf and the softmax to NaN (a 500);
    now the distribution is the argmax's, so the reply is the greedy one."""
    replies = []
    for t in (0, 1e-308, 5e-324):
        status, got = post(live["port"], P, enc({**OKP, "max_tokens": 6, "temperature": t, "seed": 1}))
        assert status == 200, got
        replies.append(got["choices"][0]["text"])
    assert replies[1] == replies[2] == replies[0]


def test_routes_methods_and_the_key_answer_in_the_same_shape(live):
    assert_openai_error(*post(live["port"], "/v1/nothing", b"{}"), code="not_found")
    assert_openai_error(*post(live["port"], C + "/", enc(chat("hi"))), code="not_found")  # no 307 to follow
    conn = http.client.HTTPConnection("127.0.0.1", live["port"], timeout=30)
    conn.request("GET", "/v1/chat/completions", headers=AUTH)
    r = conn.getresponse()
    assert r.status == 405
    assert_openai_error(405, json.loads(r.read()), code="method_not_allowed")
    conn.close()
    for headers in (
        {"Authorization": "Bearer wrong"},
        {"Authorization": ""},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer \u00e9t\u00e9".encode().decode("latin-1")},
    ):
        status, got = post(live["port"], C, enc(chat("hi")), headers)
        assert status == 401
        assert_openai_error(status, got, code="invalid_api_key")


# ---- the fuzz -------------------------------------------------------------------------------
INNOCENT = [
    "1+2=",
    "what is seven plus nine",
    "ten",
    "add three and one",
    "= ? =",
    "nine nine nine",
    "one two",
    "plus plus",
]
HOSTILE_VALUES = {  # every value here is invalid for its field
    "temperature": [float("nan"), float("inf"), -1, 2.0001, "1", True, [], {}],
    "top_p": [0, -0.1, 1.5, float("nan"), "x", False],
    "presence_penalty": [3, -2.5, float("-inf"), "0"],
    "frequency_penalty": [2.1, float("nan"), [1]],
    "seed": [-1, 1.5, "7", True, 2**64],
    "n": [0, 2, 10**6, "1", True, 1.5],
    "max_tokens": [0, -5, 10**9, 1.5, "3", True, 10**30],
    "stop": [5, ["a"] * 5, [""], ["x" * 300], [1], {"a": 1}],
    "logit_bias": [[], "x", {"abc": 1}, {"5": 101}, {"5": float("nan")}, {"-1": 1}, {"99999999": 1}, {"5": "1"}],
    "stream": ["yes", 1, [True]],
    "model": [5, None, "gpt-4", ["tiny-test"]],
    "logprobs": [5, "yes", 1.5],
    "top_logprobs": [21, -1, True, "3"],
    "stream_options": ["x", {"include_usage": "yes"}],
    "messages": [
        [],
        "hi",
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [1],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": "x" * 50_000}],
    ],
}
PROMPT_HOSTILE = [[], [-1], [10**9], [1.5], {"a": 1}, "x" * 100_000, [True], None, ""]
RAW = [
    b"",
    b"   ",
    b"\xff\xfe{",
    b"[" * 50_000,
    b'{"a":' * 40 + b"1" + b"}" * 40,
    b"null",
    b"[1,2]",
    b'"str"',
    b"{",
    b'{"model": NaN}',
    b"\x00" * 64,
    b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
]


def _poison(rng: random.Random):
    """(path, body bytes) for one request that must get a 4xx."""
    kind = rng.random()
    if kind < 0.15:
        return rng.choice([C, P]), rng.choice(RAW)
    if kind < 0.3:
        body = {**OKP, "prompt": rng.choice(PROMPT_HOSTILE)}
        return P, enc(body)
    body = chat(rng.choice(INNOCENT))
    for field in rng.sample(sorted(HOSTILE_VALUES), rng.randint(1, 3)):
        body[field] = rng.choice(HOSTILE_VALUES[field])
    return C, json.dumps(body).encode()


def _innocent(port: int, i: int) -> str:
    status, got = post(port, C, enc(chat(INNOCENT[i], max_tokens=12)))
    assert status == 200, got
    return got["choices"][0]["message"]["content"]


def test_fuzz_poison_requests_never_change_an_innocent_reply_and_the_server_stays_up(live):
    """240 poison bodies (random and adversarial, seeded) and 32 well-formed greedy requests, sent
    together from 24 threads: every innocent reply equals what the same request gets alone; every
    poison request gets a 4xx in OpenAI's shape (never a 200 or a 500); /health answers after."""
    port = live["port"]
    solo = [_innocent(port, i) for i in range(len(INNOCENT))]
    rng = random.Random(23)
    jobs = [("poison", _poison(rng)) for _ in range(240)] + [("innocent", i % len(INNOCENT)) for i in range(32)]
    # valid but unusual sampling: these run in the same batches, must succeed and must not disturb the greedy rows
    jobs += [
        (
            "odd",
            {
                **chat("one two", max_tokens=10),
                "temperature": 2,
                "top_p": 0.01,
                "seed": 2**63 - 1,
                "presence_penalty": -2,
                "frequency_penalty": 2,
                "logit_bias": {"5": 100, "6": -100},
            },
        )
    ] * 6
    rng.shuffle(jobs)

    def run(job):
        kind, what = job
        if kind == "innocent":
            return kind, what, _innocent(port, what)
        if kind == "odd":
            return kind, what, post(port, C, enc(what))
        return kind, what, post(port, *what)

    t0 = time.time()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(run, jobs))
    assert time.time() - t0 < 240
    for kind, what, got in results:
        if kind == "innocent":
            assert got == solo[what], (INNOCENT[what], got, solo[what])
        elif kind == "odd":
            assert got[0] == 200, got
        else:
            status, body = got
            assert 400 <= status < 500 and status != 401, (what[1][:120], status, body)
            assert_openai_error(status, body)
    statuses = {r[2][0] for r in results if r[0] == "poison"}
    assert statuses <= {400, 404, 413}
    deadline = time.time() + 10
    while True:  # a reply is sent just before its row is freed: allow a moment
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200
        if json.loads(health.read())["running"] == 0:
            break
        assert time.time() < deadline, "rows still running 10 s after every reply"
        time.sleep(0.1)
    assert [_innocent(port, i) for i in range(len(INNOCENT))] == solo


# ---- bounded bodies ---------------------------------------------------------------------------
def _slow_upload(port: int, total: int, chunked: bool, out: list, pace: float = 0.01, hold=None) -> None:
    """Send a `total`-byte body in 64 KiB pieces (declared by Content-Length, or chunked) and
    record the status line the server answers with, or the error if it hung up first. hold:
    (paused, go) events: after 512 KiB (half the server's limit) set `paused` and wait for `go`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n"
        )
        head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n"
        s.sendall(head.encode())
        piece, sent = b"x" * 65536, 0
        try:
            while sent < total and not select.select([s], [], [], 0)[0]:  # as clients do: stop once answered
                if hold is not None and sent >= 1 << 19 and not hold[0].is_set():
                    hold[0].set()
                    hold[1].wait(300)
                data = piece[: min(65536, total - sent)]
                s.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                sent += len(data)
                time.sleep(pace)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed while we were still sending: read what it said
        reply = b""
        try:
            while b"\r\n\r\n" not in reply:
                got = s.recv(65536)
                if not got:
                    break
                reply += got
        except OSError as e:
            out.append(f"error: {e}")
            return
        out.append((reply.split(b"\r\n", 1)[0].decode(), reply, sent))
    finally:
        s.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_10mb_body_gets_413_while_a_normal_request_completes(live):
    """The chunked upload pauses half-way to the limit until a normal request has its reply. Queued
    behind the upload, that request would get it only after the server gave up on the body (a 408
    after 60 s, not a 413), or not within its own 120 s."""
    port = live["port"]
    solo = _innocent(port, 0)
    outs: list = []
    paused, go = threading.Event(), threading.Event()
    uploads = [
        threading.Thread(target=_slow_upload, args=(port, 10_000_000, False, outs, 0.05)),
        threading.Thread(target=_slow_upload, args=(port, 10_000_000, True, outs, 0.05, (paused, go))),
    ]
    for t in uploads:
        t.start()
    try:
        assert paused.wait(60)  # the chunked upload is under way, its body half read
        assert _innocent(port, 0) == solo
    finally:
        go.set()
    for t in uploads:
        t.join(120)
    assert len(outs) == 2 and all(isinstance(o, tuple) and " 413 " in o[0] for o in outs), outs
    assert all(o[2] < 3_000_000 for o in outs), [o[2] for o in outs]  # answered long before the body was sent
    assert all(b"connection: close" in o[1].lower() for o in outs)


def test_a_flood_of_large_bodies_keeps_memory_bounded(live):
    """12 chunked uploads of 3 MB at once (each refused after 1 MiB) and 12 declared 10 MB ones:
    the server's resident memory grows by less than 64 MiB and every upload gets 413."""
    port, pid = live["port"], live["proc"].pid
    before = _rss_kib(pid)
    outs: list = []
    threads = [threading.Thread(target=_slow_upload, args=(port, 3_000_000, True, outs, 0.0)) for _ in range(12)]
    threads += [threading.Thread(target=_slow_upload, args=(port, 10_000_000, False, outs, 0.0)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outs) == 24 and all(isinstance(o, tuple) and " 413 " in o[0] for o in outs), outs
    assert _rss_kib(pid) - before < 64 * 1024
    status, got = post(port, C, enc(chat("hi")))
    assert status == 200


# ---- work off the event loop; a fault inside generation, over HTTP -------------------------------
@pytest.fixture
def inproc(ckpt):  # noqa: F811
    """An app served by uvicorn in a thread of this process, so the engine and tokenizer can be
    patched: yields (port, server, engine)."""
    import uvicorn

    from erniekit.infer.chat import load_chat_model, stop_ids
    from erniekit.infer.engine import Engine
    from erniekit.infer.server import OpenAIServer, build_app

    model, tok = load_chat_model(ckpt)
    engine = Engine(model, tok, max_batch=4, max_model_len=CTX, stop_token_ids=stop_ids(model, tok))
    srv = OpenAIServer(engine, tok, MODEL, api_key=KEY)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(srv), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield port, srv, engine
    server.should_exit = True
    thread.join(30)
    engine.close()


def _get_health(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


def test_tokenising_runs_off_the_event_loop(inproc, monkeypatch):
    """A prompt whose tokenising is held until the test lets it go does not delay /health or a
    normal request: both answer while it is held (on the event loop, it would hold them too, and
    /health would time out after 30 s)."""
    port, srv, _ = inproc
    real = srv.tokenizer.encode
    held, go = threading.Event(), threading.Event()

    def slow(text, *a, **kw):
        if "SLOW" in text:
            held.set()
            go.wait(300)
        return real(text, *a, **kw)

    monkeypatch.setattr(srv.tokenizer, "encode", slow)
    solo = post(port, P, enc({**OKP, "temperature": 0}))[1]["choices"][0]["text"]
    out = []
    t = threading.Thread(target=lambda: out.append(post(port, P, enc({**OKP, "prompt": "SLOW 1+1="}))))
    t.start()
    try:
        assert held.wait(60)  # the slow one is being tokenised
        _get_health(port)
        assert post(port, P, enc({**OKP, "temperature": 0}), timeout=30)[1]["choices"][0]["text"] == solo
        assert not out  # done while the slow one still tokenises, not queued behind it
    finally:
        go.set()
    t.join(30)
    assert out[0][0] == 200


def test_a_fault_inside_generation_fails_only_its_request_over_http(inproc, monkeypatch, caplog):
    """The engine raises while processing one request's tokens: that request gets a 500 in
    OpenAI's shape (whole) or an error event in the stream, the server's log the traceback; the
    request beside it in the batch gets its solo text."""
    port, srv, engine = inproc
    solo = _innocent(port, 1)
    real = engine._advance

    def advance(req, tok):
        if req.stop == ["POISON"] and len(req.completion) >= 2:
            raise RuntimeError("injected fault")
        return real(req, tok)

    monkeypatch.setattr(engine, "_advance", advance)
    poison = chat("one two", max_tokens=30, stop=["POISON"], logit_bias={"5": -1})
    with ThreadPoolExecutor(4) as pool:
        whole = pool.submit(post, port, C, enc(poison))
        streamed = pool.submit(post, port, C, enc({**poison, "stream": True}))
        innocent = [pool.submit(_innocent, port, 1) for _ in range(2)]
        status, body = whole.result()
        assert status == 500 and "injected fault" in assert_openai_error(status, body)
        assert body["error"]["type"] == "server_error"
        status, text = streamed.result()
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert "injected fault" in assert_openai_error(500, events[-1])
        assert [f.result() for f in innocent] == [solo, solo]
    logged = [r for r in caplog.records if r.name == "erniekit.engine" and r.exc_info]
    assert len(logged) == 2 and all("injected fault" in str(r.exc_info[1]) for r in logged)


def test_a_bug_in_a_handler_is_an_openai_shaped_500_and_the_server_goes_on(inproc, monkeypatch):
    """The client gets one line (uvicorn logs the traceback: Starlette re-raises after the handler)."""
    port, srv, _ = inproc
    real = srv.parse

    def broken(raw, chat):
        if b"BUG" in raw:
            raise TypeError("an unforeseen bug")
        return real(raw, chat)

    monkeypatch.setattr(srv, "parse", broken)
    status, body = post(port, P, enc({**OKP, "prompt": "BUG"}))
    assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
    assert "TypeError" in assert_openai_error(status, body)
    assert post(port, P, enc(OKP))[0] == 200


def test_a_body_that_trickles_in_gets_408(inproc, monkeypatch):
    from erniekit.infer import server as srv_mod

    port, _, _ = inproc
    monkeypatch.setattr(srv_mod, "BODY_TIMEOUT_S", 0.5)
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            'Content-Length: 100\r\n\r\n{"model"'.encode()
        )  # 9 of the 100 bytes, then nothing
        reply = b""
        while b"}}" not in reply:
            got = s.recv(4096)
            if not got:
                break
            reply += got
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert_openai_error(408, json.loads(reply.split(b"\r\n\r\n", 1)[1]), code="request_timeout")


def test_a_client_that_leaves_a_whole_request_frees_its_row(inproc, monkeypatch):
    """The server cancels the request of a client that left: its row ends before its 200 tokens (no
    stop token can end it: they are biased away). Kept on, it would run its 10 s and not be cancelled."""
    port, _, engine = inproc
    real = engine._advance
    reqs = []

    def slow(req, tok):
        reqs.append(req)
        time.sleep(0.05)
        return real(req, tok)

    monkeypatch.setattr(engine, "_advance", slow)
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    no_stop = {str(t): -100 for t in engine.default_stops}
    body = enc({**OKP, "max_tokens": 200, "stop": None, "logit_bias": no_stop})
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.time() + 10
    while not engine.rows:
        assert time.time() < deadline
        time.sleep(0.05)
    s.close()  # gone after a few tokens of 200 (10 s of generation)
    deadline = time.time() + 60
    while engine.rows:
        assert time.time() < deadline, "the row of a client that left is still generating after 60 s"
        time.sleep(0.05)
    assert reqs[-1].cancelled and len(reqs[-1].completion) < 200  # ended because its client left


def test_server_flags_are_checked_in_one_line(ckpt):  # noqa: F811
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    for args, want in [
        (["--max-body-bytes", "10"], "error: server: --max-body-bytes 10 must be >= 1024"),
        (["--quantization", "wint8"], "error: --quantization is for --backend fastdeploy"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "erniekit", "server", ckpt, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and r.stderr.startswith(want) and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- secrets ----------------------------------------------------------------------------------
def test_the_key_is_compared_in_constant_time(ckpt, monkeypatch):  # noqa: F811
    from fastapi.testclient import TestClient

    from erniekit.infer import server as srv
    from erniekit.infer.chat import load_chat_model, stop_ids
    from erniekit.infer.engine import Engine

    calls = []
    real = srv.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(srv.hmac, "compare_digest", spy)
    model, tok = load_chat_model(ckpt)
    engine = Engine(model, tok, max_batch=2, max_model_len=64, stop_token_ids=stop_ids(model, tok))
    try:
        with TestClient(srv.build_app(srv.OpenAIServer(engine, tok, MODEL, api_key="s3cret"))) as c:
            r = c.post("/v1/completions", json=OKP, headers={"Authorization": "Bearer guess"})
            assert r.status_code == 401
            assert_openai_error(401, r.json(), code="invalid_api_key")
            assert "guess" not in r.text and "s3cret" not in r.text
            assert calls == [(b"Bearer guess", b"Bearer s3cret")]
            r = c.post("/v1/completions", json=OKP, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and len(calls) == 2
    finally:
        engine.close()


def test_key_from_the_environment_and_flag_precedence(monkeypatch):
    from erniekit.infer.server import api_key_from

    monkeypatch.setenv("ERNIEKIT_API_KEY", "from-env")
    assert api_key_from(None) == ("from-env", "ERNIEKIT_API_KEY")
    assert api_key_from("from-flag") == ("from-flag", "--api-key")
    monkeypatch.delenv("ERNIEKIT_API_KEY")
    assert api_key_from(None) == (None, "")


def _pretend_fastdeploy_and_gpu(monkeypatch):
    import importlib.util

    import paddle

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "fastdeploy" else real(name, *a)
    )
    monkeypatch.setattr(paddle.device, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 1)


def test_fastdeploy_gets_the_key_and_quantization_but_never_shows_the_key(tmp_path, monkeypatch, capsys):
    import argparse
    import subprocess

    from erniekit.errors import ErniekitError
    from erniekit.infer.server import fastdeploy_command, run_server

    _pretend_fastdeploy_and_gpu(monkeypatch)
    cmd, env = fastdeploy_command(str(tmp_path), "127.0.0.1", 8100, 4096, 16, quantization="wint4", api_key="k-123")
    assert cmd[cmd.index("--quantization") + 1] == "wint4" and cmd[cmd.index("--max-num-seqs") + 1] == "16"
    assert env == {"FD_API_KEY": "k-123"} and not any("k-123" in c for c in cmd)
    with pytest.raises(ErniekitError, match="FD_API_KEY reads as a separator"):
        fastdeploy_command(str(tmp_path), "127.0.0.1", 8100, 4096, 16, api_key="a,b")
    (tmp_path / "export_info.json").write_text(json.dumps({"format": "wint8", "source": "/x"}))
    with pytest.raises(ErniekitError, match="erniekit wint8 export.*--format hf.*--quantization wint8"):
        fastdeploy_command(str(tmp_path), "127.0.0.1", 8100, 4096, 16)
    (tmp_path / "export_info.json").write_text(json.dumps({"format": "hf", "source": "/x"}))

    ran = []
    monkeypatch.setattr(subprocess, "call", lambda c, env=None: ran.append((c, env)) or 0)
    monkeypatch.setenv("ERNIEKIT_API_KEY", "env-secret-9")
    ns = argparse.Namespace(
        backend="fastdeploy",
        model_dir=str(tmp_path),
        host="127.0.0.1",
        port=8100,
        max_model_len=None,
        max_batch=8,
        quantization="wint8",
        api_key=None,
    )
    assert run_server(ns) == 0
    printed = capsys.readouterr()
    assert "env-secret-9" not in printed.out + printed.err and "FD_API_KEY" in printed.out
    ((c, env),) = ran
    assert "--quantization" in c and env["FD_API_KEY"] == "env-secret-9" and "env-secret-9" not in " ".join(c)


def test_the_key_never_appears_in_the_server_output(live):
    """Stops the live server and reads all it wrote (startup banner, info-level access log of
    every request above, 401s included). pytest-xdist may run the module's other tests in another
    worker (with its own server), so this one sends a served and a refused request itself."""
    assert post(live["port"], C, enc(chat("hi")))[0] == 200
    assert post(live["port"], C, enc(chat("hi")), {"Authorization": f"Bearer {KEY}x"})[0] == 401
    proc = live["proc"]
    proc.terminate()
    proc.wait(timeout=30)
    time.sleep(0.5)
    out = "".join(live["lines"])
    assert "API key required, from ERNIEKIT_API_KEY" in out, out[:300]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in out and " 401" in out, out[-2000:]
    leaks = [i for i, line in enumerate(live["lines"]) if KEY in line]
    where = "".join(live["lines"][max(0, leaks[0] - 15) : leaks[0] + 5]) if leaks else ""
    assert not leaks, f"the key is in {len(leaks)} line(s) of the server output; the first, with context:\n{where}"
