"""What the server holds at once is bounded: requests queued or running (each keeps its prompt and
its images' patches until it ends; the engine's queue has no bound of its own) beyond
--max-queued-requests, or requests with images beyond MEDIA_IN_FLIGHT, get a 429 that the OpenAI
client retries; every finished, failed or refused request gives its place back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from erniekit.infer import server as srv  # noqa: E402
from erniekit.infer.sampling import SamplingParams  # noqa: E402
from erniekit.models.ernie4_5.tokenizer import default_tokenizer  # noqa: E402


class HoldingEngine:
    """Keeps every request until the test ends it; `refuse` makes the n-th submit raise."""

    def __init__(self, vocab: int, refuse: int | None = None):
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab))
        self.max_model_len, self.vl, self.reqs, self.refuse, self.vocab = 64, False, [], refuse, vocab

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        pass

    def submit(self, req) -> None:
        if self.refuse is not None and len(self.reqs) == self.refuse:
            raise ValueError("refused by the engine")
        self.reqs.append(req)


def _parsed(n: int, image: bool = False) -> srv.Parsed:
    prompts = [([1, 2, 3], ("patches", "grid") if image else None, None, None) for _ in range(n)]
    return srv.Parsed(prompts, SamplingParams(max_new_tokens=4), [], False, False)


def test_requests_beyond_the_bounds_get_a_429_and_finished_ones_free_their_place(monkeypatch):
    tok = default_tokenizer()
    monkeypatch.setattr(srv, "MEDIA_IN_FLIGHT", 1)

    async def scenario():
        engine = HoldingEngine(len(tok))
        server = srv.OpenAIServer(engine, tok, "m", max_queued=3)
        server.start(_parsed(2))
        with pytest.raises(srv.BadRequest) as e:
            server.start(_parsed(2))  # 2 + 2 > 3
        assert (e.value.status, e.value.code, e.value.kind) == (429, "too_many_requests", "rate_limit_error")
        with pytest.raises(srv.BadRequest, match="4 prompts in one request, more than the server holds") as e:
            server.start(_parsed(4))
        assert e.value.status == 400
        engine.reqs[0].emit("", "stop")  # one ends: its place is free
        server.start(_parsed(1, image=True))
        engine.reqs[1].emit("", "length")
        with pytest.raises(srv.BadRequest, match="requests with images or videos") as e:
            server.start(_parsed(1, image=True))  # one image request is the most here
        assert e.value.status == 429
        server.start(_parsed(1))  # a text request still fits
        engine.reqs[2].emit("", "error")  # the image request ends (failed): the next one fits
        server.start(_parsed(1, image=True))
        failing = srv.OpenAIServer(HoldingEngine(len(tok), refuse=1), tok, "m", max_queued=2)
        with pytest.raises(ValueError):
            failing.start(_parsed(2))  # the engine refused the second: neither keeps a place
        failing.engine.reqs[0].emit("", "cancelled")
        assert failing._in_flight == 0
        failing.engine.refuse = None
        failing.start(_parsed(2))
        return server

    server = asyncio.run(scenario())
    assert server._in_flight == 2 and server._media_in_flight == 1  # the text and the last image request


async def _until(cond, seconds: float = 30.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)


def test_a_client_gone_while_queued_gives_its_place_back_with_the_real_engine():
    """The server's count through the built-in engine (not a stand-in that ends requests by hand):
    requests queued behind a full batch whose client went away free their places while the batch
    still runs, so new requests are admitted."""
    import paddle

    from erniekit.infer.engine import Engine
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset

    tok = default_tokenizer()
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe"))
    model.eval()
    engine = Engine(model, tok, max_batch=1, max_model_len=600)

    async def scenario():
        server = srv.OpenAIServer(engine, tok, "m", max_queued=3)
        long = srv.Parsed([([5, 6, 7], None, None, None)], SamplingParams(max_new_tokens=590), [], False, False)
        (running,), _ = server.start(long)
        queued, _ = server.start(_parsed(2))
        with pytest.raises(srv.BadRequest):
            server.start(_parsed(1))  # 3 held
        for r in queued:
            r.cancelled = True  # their clients went away
        await _until(lambda: server._in_flight == 1)
        assert server._in_flight == 1 and not running.text  # the long one still runs
        later, _ = server.start(_parsed(2))  # the places are back
        for r in (running, *later):
            r.cancelled = True
        await _until(lambda: server._in_flight == 0)  # before the loop closes: the engine emits into it
        assert server._in_flight == 0

    try:
        asyncio.run(scenario())
    finally:
        engine.close()


def test_the_server_raises_its_open_files_limit_toward_the_hard_one(monkeypatch):
    """Each connection holds a descriptor: at a soft limit of 1024 a thousand idle connections of
    one client would leave the server unreachable; the server lifts it as far as it may."""
    import resource

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda what: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: limits.update(now=lim))
    assert srv.raise_open_files_limit() == 4096 and limits["now"] == (4096, 4096)
    limits["now"] = (1024, resource.RLIM_INFINITY)
    assert srv.raise_open_files_limit() == srv.OPEN_FILES_TARGET
    limits["now"] = (200000, 300000)  # already above the target: left alone
    assert srv.raise_open_files_limit() == 200000 and limits["now"] == (200000, 300000)

    def refuse(what, lim):
        raise ValueError("not allowed")

    limits["now"] = (1024, 4096)
    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert srv.raise_open_files_limit() == 1024

    def macos(what, lim):  # an unlimited hard limit, but no soft one above OPEN_MAX
        if lim[0] > srv.MACOS_OPEN_MAX:
            raise ValueError("invalid argument")
        limits.update(now=lim)

    limits["now"] = (256, resource.RLIM_INFINITY)
    monkeypatch.setattr(resource, "setrlimit", macos)
    assert srv.raise_open_files_limit() == srv.MACOS_OPEN_MAX == limits["now"][0]


def test_one_client_holds_at_most_its_share_and_the_others_still_get_in():
    """Per client (peer address) at most half of --max-queued-requests unless told: a client that
    floods the server gets the 429 while another still gets in; a finished request gives its
    client's place back, and the count of a client with nothing left is dropped. 0: no limit."""
    tok = default_tokenizer()

    async def scenario():
        engine = HoldingEngine(len(tok))
        server = srv.OpenAIServer(engine, tok, "m", max_queued=4)
        assert server.max_per_client == 2
        server.start(_parsed(2), "10.0.0.1")
        with pytest.raises(srv.BadRequest, match="this client holds 2 requests") as e:
            server.start(_parsed(1), "10.0.0.1")
        assert (e.value.status, e.value.code) == (429, "too_many_requests")
        server.start(_parsed(2), "10.0.0.2")  # another client gets in
        assert [r.client for r in engine.reqs] == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 2  # the engine takes turns by it
        engine.reqs[0].emit("", "stop")
        server.start(_parsed(1), "10.0.0.1")  # its place is back
        with pytest.raises(srv.BadRequest, match="the server holds 4 requests"):
            server.start(_parsed(1))  # the total still bounds everyone
        for r in engine.reqs[1:]:
            r.emit("", "stop")
        assert server._in_flight == 0 and server._client_in_flight == {}
        with pytest.raises(srv.BadRequest, match="more than one client may hold at once") as e:
            server.start(_parsed(3), "10.0.0.3")  # waiting would not help: a 400, not a 429
        assert e.value.status == 400
        unlimited = srv.OpenAIServer(HoldingEngine(len(tok)), tok, "m", max_queued=4, max_per_client=0)
        unlimited.start(_parsed(4), "10.0.0.1")  # e.g. behind a remote proxy: every client has its address
        with pytest.raises(ValueError, match="max_per_client=-1"):
            srv.OpenAIServer(HoldingEngine(len(tok)), tok, "m", max_per_client=-1)

    asyncio.run(scenario())


def test_a_request_finished_twice_gives_its_place_back_once():
    """Should the engine finish a request twice (a failing step ends every running row, some of
    which a step may have ended already), its place comes back once: the other requests' counts
    and finish events are untouched."""
    tok = default_tokenizer()

    async def scenario():
        engine = HoldingEngine(len(tok))
        server = srv.OpenAIServer(engine, tok, "m", max_queued=8)
        reqs, out = server.start(_parsed(2), "10.0.0.1")
        reqs[0].emit("", "stop")
        reqs[0].emit("", "error")
        assert server._in_flight == 1 and server._client_in_flight == {"10.0.0.1": 1}
        reqs[1].emit("", "stop")
        await asyncio.sleep(0)
        events = [out.get_nowait() for _ in range(out.qsize())]
        assert [(i, f) for i, _, f, _ in events] == [(0, "stop"), (0, "error"), (1, "stop")]
        assert server._in_flight == 0 and server._client_in_flight == {}

    asyncio.run(scenario())


def test_a_streamed_request_beyond_the_limits_gets_a_429_not_a_broken_stream():
    """A stream's status goes out with its first bytes: the server admits a streamed request
    before it starts the response, so a refusal is the same 429 JSON error as without stream."""
    from fastapi.testclient import TestClient

    tok = default_tokenizer()
    server = srv.OpenAIServer(HoldingEngine(len(tok)), tok, "m", max_queued=2)  # 1 per client

    async def hold():
        server.start(_parsed(1), "testclient")  # Starlette's test client's peer address

    asyncio.run(hold())
    with TestClient(srv.build_app(server)) as c:
        for stream in (True, False):
            r = c.post("/v1/completions", json={"model": "m", "prompt": "1+1=", "max_tokens": 2, "stream": stream})
            assert r.status_code == 429, (stream, r.text)
            assert "--max-queued-per-client" in r.json()["error"]["message"]


def test_the_per_client_limit_is_checked_before_the_model_loads():
    from erniekit import cli
    from erniekit.errors import ErniekitError

    with pytest.raises(ErniekitError, match="--max-queued-per-client -1 must be >= 0"):
        cli.server(["/nonexistent", "--max-queued-per-client", "-1"])


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_stream_whose_client_left_before_its_first_byte_stops_generating(spec):
    """The client is gone when the response starts and the server's send raises (ASGI servers
    that do so: Hypercorn, Granian; uvicorn's returns and Starlette's disconnect listener ends the
    stream): the body's generator never starts, so only the response itself can cancel the
    requests; before, they generated to max_tokens for nobody, holding a row and the client's place."""
    import json

    from starlette.requests import ClientDisconnect

    tok = default_tokenizer()
    engine = HoldingEngine(len(tok))
    server = srv.OpenAIServer(engine, tok, "m", max_queued=4)
    app = srv.build_app(server)
    body = json.dumps({"model": "m", "prompt": ["1+1=", "2+2="], "max_tokens": 2, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the peer closed the connection")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("10.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }

    async def scenario():
        with pytest.raises((OSError, ClientDisconnect)):  # Starlette's, by spec version
            await app(scope, receive, send)

    asyncio.run(scenario())
    assert len(engine.reqs) == 2 and all(r.cancelled for r in engine.reqs)


def test_an_ipv6_client_is_its_64_network_and_a_mapped_ipv4_client_its_ipv4_address():
    """One host is handed a whole /64 and may pick a fresh address per connection: every address
    of it counts against one share; other forms of the same peer count as that peer."""
    assert srv.client_of("2001:db8:1:2:aaaa::1") == srv.client_of("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert srv.client_of("2001:db8:1:3::1") != srv.client_of("2001:db8:1:2::1")
    assert srv.client_of("fe80::1%eth0") == "fe80::/64"
    assert srv.client_of("::ffff:192.0.2.7") == srv.client_of("192.0.2.7") == "192.0.2.7"
    assert srv.client_of("192.0.2.8") != srv.client_of("192.0.2.7")  # IPv4: each address its own
    assert srv.client_of("testclient") == "testclient"
    # a trusted proxy's X-Forwarded-For entry may carry a port or brackets; a NAT64 embeds IPv4
    assert srv.client_of("192.0.2.7:5678") == srv.client_of("[::ffff:192.0.2.7]:443") == "192.0.2.7"
    assert srv.client_of("[2001:db8:1:2::9]:443") == "2001:db8:1:2::/64"
    assert srv.client_of("64:ff9b::c000:207") == "192.0.2.7"  # not every NAT64 client one /64
    assert srv.client_of("64:ff9b::c000:208") != srv.client_of("64:ff9b::c000:207")
