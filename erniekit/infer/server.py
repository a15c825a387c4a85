"""`erniekit server`: an OpenAI-compatible HTTP API over the built-in engine (erniekit/infer/engine.py).

/v1/chat/completions and /v1/completions (streamed as server-sent events or whole), /v1/models,
/health. Bad requests get a 4xx JSON body in OpenAI's error shape and the server keeps serving.
The engine runs in its own thread; a handler waits on an asyncio queue the engine thread fills
through the event loop (call_soon_threadsafe), so no handler blocks the loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the handlers' annotations here

from erniekit.infer.engine import Engine, Request
from erniekit.infer.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256  # when a request sets none (capped by what the context leaves)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def error_body(e: BadRequest) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v > hi or v < lo or (lo_open and v == lo):
        side = f"({lo}" if lo_open else f"[{lo}"
        raise BadRequest(f"{key}={v!r} must be a number in {side}, {hi}]", key)
    return float(v)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


class OpenAIServer:
    """The request handling, free of the web framework (the FastAPI routes call it)."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, api_key: str | None = None):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.created = int(time.time())

    # ---- validation ------------------------------------------------------------------------
    def check_key(self, authorization: str | None) -> None:
        if self.api_key and authorization != f"Bearer {self.api_key}":
            raise BadRequest("invalid or missing API key (send Authorization: Bearer KEY)", None, "invalid_api_key",
                             status=401)

    def _common(self, body: dict, prompt: list[int]) -> tuple[SamplingParams, list[str], bool]:
        if body.get("model") != self.model_name:
            raise BadRequest(f"the model {body.get('model')!r} does not exist; this server serves "
                             f"{self.model_name!r} (GET /v1/models)", "model", "model_not_found", status=404)
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest(f"n={n!r}: this server returns one choice per request (n=1)", "n")
        for key in ("logprobs", "top_logprobs", "tools", "functions", "response_format"):
            if body.get(key) not in (None, False, [], {"type": "text"}):
                raise BadRequest(f"{key} is not supported by this server", key)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream={stream!r} must be true or false", "stream")
        room = self.engine.max_model_len - len(prompt)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"{key}={max_tokens!r} must be an integer >= 1", key)
        try:
            self.engine.check(len(prompt), max_tokens)
        except ValueError as e:
            raise BadRequest(f"{e} ({key})", "messages" if "messages" in body else "prompt",
                             "context_length_exceeded") from None
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"seed={seed!r} must be an integer", "seed")
        params = SamplingParams(max_new_tokens=max_tokens,
                                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=seed)
        return params, _stops(body), stream

    def chat_request(self, body: Any) -> tuple[list[int], SamplingParams, list[str], bool]:
        from erniekit.errors import DataError
        from erniekit.infer.chat import chat_prompt_ids

        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        msgs = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}] parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                content = "".join(p.get("text", "") for p in content)
            role = m.get("role") if isinstance(m, dict) else None
            role = "system" if role == "developer" else role
            msgs.append({"role": role, "content": content})
        try:
            prompt = chat_prompt_ids(self.tokenizer, msgs)
        except DataError as e:
            raise BadRequest(str(e), "messages") from None
        params, stops, stream = self._common(body, prompt)
        return prompt, params, stops, stream

    def completion_request(self, body: Any) -> tuple[list[int], SamplingParams, list[str], bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < len(self.tokenizer) for t in prompt):
                raise BadRequest("prompt token ids must be in [0, vocab size)", "prompt")
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be a non-empty string, a list with one string, or a list of token ids",
                             "prompt")
        if not ids:
            raise BadRequest("the prompt encodes to no tokens", "prompt")
        if body.get("echo"):
            raise BadRequest("echo is not supported by this server", "echo")
        params, stops, stream = self._common(body, ids)
        return ids, params, stops, stream

    # ---- running ---------------------------------------------------------------------------
    def start(self, prompt: list[int], params: SamplingParams, stops: list[str]) -> tuple[Request, asyncio.Queue]:
        """Queue the request; its text pieces arrive on the returned asyncio queue as (delta, finish)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def emit(delta: str, finish: str | None) -> None:
            loop.call_soon_threadsafe(out.put_nowait, (delta, finish))

        req = Request(prompt, params, emit, stops)
        self.engine.submit(req)
        return req, out

    def usage(self, req: Request) -> dict:
        n = len(req.completion)
        return {"prompt_tokens": len(req.prompt), "completion_tokens": n, "total_tokens": len(req.prompt) + n}

    async def whole(self, chat: bool, prompt, params, stops) -> dict:
        req, out = self.start(prompt, params, stops)
        while True:
            _, finish = await out.get()
            if finish is not None:
                break
        if finish == "error":
            raise BadRequest(f"generation failed: {req.error}", status=500, kind="server_error")
        rid, now = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": req.text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": req.text, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                "model": self.model_name, "choices": [choice], "usage": self.usage(req)}

    async def stream(self, chat: bool, prompt, params, stops, include_usage: bool):
        """Server-sent events: OpenAI's chunk objects, then `data: [DONE]`."""
        req, out = self.start(prompt, params, stops)
        rid, now = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            obj = {"id": rid, "object": kind, "created": now, "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                delta, finish = await out.get()
                if finish == "error":
                    err = BadRequest(f"generation failed: {req.error}", status=500, kind="server_error")
                    yield f"data: {json.dumps(error_body(err))}\n\n"
                    break
                if delta:
                    yield chunk(delta, None)
                if finish is not None:
                    yield chunk(None, finish)
                    break
            if include_usage:
                obj = {"id": rid, "object": kind, "created": now, "model": self.model_name, "choices": [],
                       "usage": self.usage(req)}
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            req.cancelled = True  # a client that went away stops its generation at the next step


def build_app(server: OpenAIServer):
    """The FastAPI application around `server`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="erniekit", docs_url=None, redoc_url=None)

    def fail(e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(e), status_code=e.status)

    async def body_of(request: HTTPRequest) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name, "running": len(server.engine.rows),
                "waiting": server.engine.pending.qsize()}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        try:
            server.check_key(request.headers.get("authorization"))
        except BadRequest as e:
            return fail(e)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "erniekit"}]}

    async def handle(request: HTTPRequest, chat: bool):
        try:
            server.check_key(request.headers.get("authorization"))
            body = await body_of(request)
            parse = server.chat_request if chat else server.completion_request
            prompt, params, stops, stream = parse(body)
            if stream:
                opts = body.get("stream_options") or {}
                gen = server.stream(chat, prompt, params, stops, bool(isinstance(opts, dict) and
                                                                      opts.get("include_usage")))
                return StreamingResponse(gen, media_type="text/event-stream")
            return await server.whole(chat, prompt, params, stops)
        except BadRequest as e:
            return fail(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle(request, chat=False)

    @app.exception_handler(404)
    async def not_found(request: HTTPRequest, exc):
        return fail(BadRequest(f"no route {request.method} {request.url.path}; see /v1/models, /v1/chat/completions, "
                               "/v1/completions, /health", status=404, code="not_found"))

    @app.exception_handler(405)
    async def bad_method(request: HTTPRequest, exc):
        return fail(BadRequest(f"{request.method} is not allowed on {request.url.path}", status=405))

    return app


def fastdeploy_command(model_dir: str, host: str, port: int, max_model_len: int, max_batch: int,
                       quantization: str | None = None) -> list[str]:
    """FastDeploy's own OpenAI server on an exported directory, as ERNIEKit starts it; a one-line
    error when FastDeploy or a GPU is missing."""
    import importlib.util
    import sys

    from erniekit.errors import ErniekitError

    if importlib.util.find_spec("fastdeploy") is None:
        raise ErniekitError("--backend fastdeploy needs FastDeploy (pip install fastdeploy-gpu from PaddlePaddle's "
                            "index, on a CUDA machine); the built-in engine (--backend builtin) runs anywhere")
    import paddle

    if not paddle.device.is_compiled_with_cuda() or paddle.device.cuda.device_count() < 1:
        raise ErniekitError("--backend fastdeploy needs a GPU and paddlepaddle-gpu; use --backend builtin here")
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--model", model_dir, "--host", host,
           "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_batch)]
    return cmd + (["--quantization", quantization] if quantization else [])


def run_server(ns) -> int:
    """`erniekit server`: load the model, start the engine and serve until interrupted."""
    import os

    if ns.backend == "fastdeploy":
        import subprocess

        cmd = fastdeploy_command(ns.model_dir, ns.host, ns.port, ns.max_model_len or 32768, ns.max_batch)
        print("erniekit: starting FastDeploy: " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    import uvicorn

    from erniekit.infer.chat import load_chat_model, stop_ids

    model, tokenizer = load_chat_model(ns.model_dir)
    engine = Engine(model, tokenizer, max_batch=ns.max_batch, max_model_len=ns.max_model_len,
                    stop_token_ids=stop_ids(model, tokenizer))
    name = ns.served_model_name or os.path.basename(os.path.normpath(ns.model_dir))
    app = build_app(OpenAIServer(engine, tokenizer, name, ns.api_key or os.environ.get("ERNIEKIT_API_KEY")))
    print(f"erniekit: serving {name} ({ns.model_dir}) at http://{ns.host}:{ns.port}/v1 (up to {ns.max_batch} "
          f"requests at once, context {engine.max_model_len} tokens)", flush=True)
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        engine.close()
    return 0
