"""`erniekit server`: an OpenAI-compatible HTTP API over the built-in engine (erniekit/infer/engine.py).

/v1/chat/completions and /v1/completions (streamed as server-sent events or whole), /v1/models,
/health. The engine runs in its own thread; a handler waits on an asyncio queue the engine thread
fills through the event loop (call_soon_threadsafe), so no handler blocks the loop.

Hostile input stops at the edge (issue #23): the body is read in bounded pieces (413 past
--max-body-bytes, before the rest is read), parsed, validated field by field (finite numbers in
OpenAI's documented ranges, bools that are bools, token ids in the vocabulary; a nesting-depth
limit) and tokenised in a worker thread, never on the event loop; a prompt that cannot fit the
context is refused from its character count before it is tokenised. Every error, 404/405/500
included, is one JSON object in OpenAI's shape naming the parameter. The API key is compared in
constant time and never printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the handlers' annotations here

from erniekit.infer.engine import Engine, Request
from erniekit.infer.sampling import SamplingParams
from erniekit.utils.text import is_text

DEFAULT_MAX_TOKENS = 256  # when a request sets none (capped by what the context leaves)
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a context's worth of text many times over
MAX_JSON_DEPTH = 32  # the deepest well-formed request (content parts) is 4 levels deep
BODY_TIMEOUT_S = 60.0  # a body that trickles in slower than this is refused (408)
MAX_STOP_CHARS = 256  # per stop string: longer ones would hold back that much of the stream
API_KEY_ENV = "ERNIEKIT_API_KEY"
Prompt = tuple  # (token ids, images and videos as (patches, grid_thw) or None)
DEFAULT_MAX_IMAGES = 8  # per request: each image is a vision-encoder pass on the engine thread
MAX_VIDEOS = 2  # per request: a video is up to max_frames frames
# requests holding decoded images / videos at once, process-wide (each is bounded: MAX_REQUEST_PIXELS of
# images, MAX_VIDEOS videos of max_frames resized frames), so concurrent requests cannot add up past a
# fixed amount of memory; the others wait up to MEDIA_WAIT_S for a slot, then get a 503
MEDIA_REQUESTS_AT_ONCE = 2
MEDIA_WAIT_S = 30.0
# requests with images or videos queued or running at once: each holds its patches until it ends
MEDIA_IN_FLIGHT = 16
DEFAULT_MAX_QUEUED = 256  # requests (prompts) queued or running at once; more get a 429 (--max-queued-requests)
# the share of those one client (one peer address) may hold unless told (--max-queued-per-client), so
# one client flooding the server leaves room for the others; the engine also admits in turn by client
PER_CLIENT_SHARE = 2
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_MESSAGES = 2048  # per chat request, as OpenAI's API allows
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a choice each), all decoded side by side
MAX_LOGPROBS = 20  # alternatives per token (OpenAI: 5 for completions, 20 for chat; vLLM: 20)
# log-probabilities one request may ask for: tokens scored x (1 + alternatives), ~130 bytes each while
# the request runs (a million: ~130 MB), so a few requests cannot run the server out of memory
MAX_LOGPROB_ENTRIES = 1 << 20


@dataclass
class Parsed:
    """A checked request: one prompt per choice (chat: one) as (token ids, images, videos, reply
    mode), the sampling options, and what the reply carries: `logprobs` alternatives per token
    (None: no log-probabilities), `echo` (the prompt's text, and its log-probabilities, first)."""

    prompts: list[tuple]
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False
    prompt_only: bool = False  # max_tokens 0 with echo: score the prompt, generate nothing
    texts: list[str | None] | None = None  # each prompt as sent, when it was text (echo repeats it exactly)


@dataclass
class ReplyMode:
    """How a chat reply is read back (thinking-format models): the text the prompt forces the reply
    to start with (tool_choice required / a named function), whether tool calls are parsed, and
    whether only the first call is kept (parallel_tool_calls false)."""

    forced: str = ""
    tools: bool = False
    single_call: bool = False

    def parser(self):
        from erniekit.infer.reply_parser import ReplyParser

        p = ReplyParser(thinking_open=True, tools_allowed=self.tools)
        p.feed(self.forced)  # its events (an empty reasoning) say nothing the client needs
        return p


_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052's well-known prefix: an IPv4 client behind a NAT64 / SIIT


def client_of(host: str) -> str:
    """Who a request counts against (`--max-queued-per-client`, turns in the batch): the peer's
    address as uvicorn reports it (a proxy's, or X-Forwarded-For's from a trusted one, which may
    carry a port or brackets), an IPv6 address by its /64 network (one host or site is handed a
    whole /64 and can pick a fresh address for every connection), an IPv4 address embedded in
    IPv6 (mapped, or translated by a NAT64) by that IPv4 address. Text that is no address
    (Starlette's test client) counts as itself."""
    bare = host.strip()
    if bare.startswith("[") and "]" in bare:  # "[2001:db8::1]:443"
        bare = bare[1 : bare.index("]")]
    elif bare.count(":") == 1:  # "192.0.2.7:5678"
        bare = bare.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(bare.split("%", 1)[0])  # a link-local address may carry a %zone
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6 and ip in _NAT64:
        return str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class BadRequest(Exception):
    """A request refused with an OpenAI-shaped error (status 4xx, or 500 for a generation fault)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def _retry_later(message: str) -> BadRequest:
    """The 429 the OpenAI client retries after a pause: the server holds as much as it may now."""
    return BadRequest(message, code="too_many_requests", status=429, kind="rate_limit_error")


class NoMediaSlot(BadRequest):
    """Every media slot is taken (MEDIA_REQUESTS_AT_ONCE): the request is parsed again once one is
    free, a 503 after MEDIA_WAIT_S."""


def error_body(e: BadRequest) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False, hint: str = "") -> float:
    """body[key] as a finite float in [lo, hi] (or (lo, hi]); NaN / Infinity, which Python's json
    accepts, and bools are refused."""
    v = body.get(key)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or v > hi
        or v < lo
        or (lo_open and v == lo)
    ):
        side = f"({lo}" if lo_open else f"[{lo}"
        raise BadRequest(f"{key}={_short(v)} must be a finite number in {side}, {hi}]{hint}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key}={_short(v)} must be an integer in [{lo}, {hi}]", key)
    return v


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _flag(body: dict, key: str, where: str | None = None) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{where or key}={_short(v)} must be true or false", where or key)
    return v


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise BadRequest(
            f"stop must be a string or a list of up to 4 strings, each 1 to {MAX_STOP_CHARS} characters", "stop"
        )
    return stops


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    """{"token id": bias}: JSON keys are strings of ids in [0, vocab), biases finite in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest(f"logit_bias={_short(bias)} must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit()):  # "5", not " 5", "+5" or "1_0" (which int() takes)
            raise BadRequest(
                f"logit_bias key {_short(k)} is not a token id; keys are token ids in [0, {vocab})", "logit_bias"
            )
        tok = int(k) if len(k) <= 18 else vocab  # int() of 4300+ digits raises
        if tok >= vocab:
            raise BadRequest(f"logit_bias key {_short(k)} is outside the vocabulary [0, {vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias[{k}]={_short(v)} must be a finite number in [-100, 100]", "logit_bias")
        out[tok] = float(v)
    return out


def _depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            todo.extend((c, d + 1) for c in (o.values() if isinstance(o, dict) else o))
    return deepest


def _not_unicode(obj: Any) -> str | None:
    """Where parsed JSON holds a string that is not Unicode text, as `messages[0].content`
    (a key that is not text written with backslash escapes); None when every string is text."""
    todo: list[tuple[Any, str]] = [(obj, "")]
    while todo:
        o, path = todo.pop()
        if isinstance(o, str):
            if not is_text(o):
                return path or "the body"
        elif isinstance(o, dict):
            for k, v in o.items():
                if not is_text(k):
                    name = k.encode("utf-8", "backslashreplace").decode("utf-8")
                    return f"{path}.{name}" if path else name
                todo.append((v, f"{path}.{k}" if path else k))
        elif isinstance(o, list):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
    return None


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying why not (empty, not UTF-8, malformed, too deep)."""
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); json.loads(bytes) would guess UTF-16/32
    except UnicodeDecodeError as e:
        raise BadRequest(
            f"the request body is not UTF-8 text ({e.reason} at byte {e.start}); send UTF-8 JSON"
        ) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise BadRequest(
            f"the request body nests deeper than {MAX_JSON_DEPTH} levels; flatten it", code="json_too_deep"
        ) from None
    except ValueError:  # an integer literal longer than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(
            f"the request body has a number of more than {sys.get_int_max_str_digits()} digits; send ordinary numbers"
        ) from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(
            f"the request body nests deeper than {MAX_JSON_DEPTH} levels; flatten it", code="json_too_deep"
        )
    where = _not_unicode(body)
    if where is not None:
        raise BadRequest(
            f"{where} holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), which is not "
            "Unicode text; send valid text",
            where,
        )
    return body


def _max_chars_per_token(pieces: list[str]) -> int:
    """The most characters one token can stand for (longest piece or special token): a prompt of
    C characters has at least C / this many tokens, whatever the tokenizer does with it."""
    return max(1, max(len(p) for p in pieces))


class OpenAIServer:
    """The request handling, free of the web framework (the FastAPI routes call it)."""

    control_record: dict | None = None  # the model's control_attributes.json (run_server sets it; docs/control.md)

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        model_name: str,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        local_media_root: str | None = None,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_per_client: int | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        # what every request holds until it ends (its prompt, its images' patches) is bounded by
        # how many may be queued or running at once: the engine's queue itself has no bound
        self.max_queued, self._in_flight, self._media_in_flight = max_queued, 0, 0
        # per client (peer address): None -> max_queued / PER_CLIENT_SHARE; 0: no limit per client
        if max_per_client is not None and max_per_client < 0:
            raise ValueError(f"max_per_client={max_per_client} must be >= 0 (0: no limit per client)")
        self.max_per_client = max(1, max_queued // PER_CLIENT_SHARE) if max_per_client is None else max_per_client
        self._client_in_flight: dict[str, int] = {}
        self._flight_lock = threading.Lock()
        # image_url parts may name files under this directory (--allowed-local-media-path); None: data: URIs only
        self.local_media_root = os.path.realpath(local_media_root) if local_media_root else None
        self.max_images = max_images
        self._expected_auth = f"Bearer {api_key}".encode() if api_key else None  # the header bytes to expect
        self.max_body_bytes = max_body_bytes
        self.vocab = engine.vocab  # ids a prompt, a logit_bias key or a reply may hold
        from erniekit.infer.openai_logprobs import TokenTexts

        pieces = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
        self.chars_per_token = _max_chars_per_token(pieces)
        self.token_texts = TokenTexts(pieces)  # the text and bytes of each id, for log-probabilities
        self.created = int(time.time())
        self.thinking = bool(getattr(tokenizer, "thinking", False))  # replies carry reasoning / tool calls
        self._media_slots = threading.BoundedSemaphore(MEDIA_REQUESTS_AT_ONCE)  # see MEDIA_REQUESTS_AT_ONCE
        self._media_held = threading.local()  # .slot: this worker thread's request holds a slot

    # ---- validation ------------------------------------------------------------------------
    def check_key(self, authorization: str | None) -> None:
        """Constant-time comparison (hmac.compare_digest), so response timing tells nothing about
        how much of a guessed key was right."""
        if self._expected_auth is None:
            return
        given = authorization or ""
        try:
            raw = given.encode("latin-1")  # the header's bytes as sent (Starlette decodes headers as latin-1)
        except UnicodeEncodeError:  # a str that did not come from a header
            raw = given.encode("utf-8")
        if not hmac.compare_digest(raw, self._expected_auth):
            raise BadRequest(
                "invalid or missing API key; send the header 'Authorization: Bearer KEY' with the server's key",
                None,
                "invalid_api_key",
                status=401,
                kind="authentication_error",
            )

    def _fits(self, chars: int, param: str) -> None:
        """Refuse before tokenising a prompt whose characters alone need more tokens than the
        context holds (each token stands for at most `chars_per_token` characters)."""
        need = -(-chars // self.chars_per_token)
        if need + 1 > self.engine.max_model_len:
            raise BadRequest(
                f"the prompt has {chars} characters, at least {need} tokens, more than the context of "
                f"{self.engine.max_model_len} tokens; shorten it",
                param,
                "context_length_exceeded",
            )

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
        """(alternatives per token or None, echo). Chat: `logprobs` true/false and `top_logprobs`
        0..20; completions: `logprobs` 0..20 and `echo`."""
        lp = body.get("logprobs")
        if chat:
            if lp is not None and not isinstance(lp, bool):
                raise BadRequest(
                    f"logprobs={_short(lp)} must be true or false (top_logprobs sets how many alternatives)", "logprobs"
                )
            top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
            if top is not None and not lp:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            if body.get("echo") is not None:
                raise BadRequest("echo is an option of /v1/completions, not of chat; leave it out", "echo")
            return ((top or 0) if lp else None), False
        if body.get("top_logprobs") is not None:
            raise BadRequest(
                "top_logprobs is a chat option; /v1/completions takes logprobs=N (0 to 20)", "top_logprobs"
            )
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise BadRequest(
                f"logprobs={_short(lp)} must be an integer in [0, {MAX_LOGPROBS}] (the alternatives per token)",
                "logprobs",
            )
        return lp, _flag(body, "echo")

    def _options(self, body: dict, chat: bool) -> dict:
        """Every field but the prompt, checked before any tokenising."""
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest(f"model={_short(model)} must be a string: this server serves {self.model_name!r}", "model")
        if model != self.model_name:
            raise BadRequest(
                f"the model {_short(model)} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
                status=404,
            )
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
            raise BadRequest(
                f"n={_short(n)}: this server returns one choice per request; send n=1 or leave it out", "n"
            )
        for key in ("functions", "response_format", "suffix"):
            if body.get(key) not in (None, False, 0, [], {"type": "text"}):  # the values that ask for nothing
                raise BadRequest(f"{key} is not supported by this server; leave it out", key)
        if body.get("best_of") not in (None, 1) or isinstance(body.get("best_of"), bool):
            raise BadRequest(
                f"best_of={_short(body.get('best_of'))}: this server returns one choice per request; leave it out",
                "best_of",
            )
        logprobs, echo = self._logprobs(body, chat)
        stream = _flag(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest(f"stream_options={_short(opts)} must be an object", "stream_options")
        if opts is not None and not stream:  # as OpenAI's API answers it
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        include_usage = _flag(opts or {}, "include_usage", "stream_options.include_usage")
        if body.get("user") is not None and not isinstance(body.get("user"), str):
            raise BadRequest(f"user={_short(body.get('user'))} must be a string", "user")
        keys = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
        max_key = keys[0] if keys else "max_tokens"
        # 0 only with echo: the prompt's log-probabilities alone (how OpenAI's legacy API scores text)
        max_tokens = _integer(body, max_key, 0 if echo else 1, self.engine.max_model_len - 1) if keys else None
        return dict(
            logprobs=logprobs,
            echo=echo,
            stream=stream,
            include_usage=include_usage,
            stops=_stops(body),
            max_key=max_key,
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True, hint=" (for greedy, send temperature 0)"),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            seed=_integer(body, "seed", 0, 2**63 - 1),
            logit_bias=_logit_bias(body, self.vocab),
        )

    def _messages(self, body: dict) -> tuple[list[int], tuple | None, tuple | None, ReplyMode | None]:
        from erniekit.data.control import with_control
        from erniekit.data.tool_messages import is_tool_dialog
        from erniekit.errors import DataError
        from erniekit.infer.chat import chat_prompt_ids

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        if len(messages) > MAX_MESSAGES:  # the prompt's chunk-by-chunk encoding renders each turn's prefix
            raise BadRequest(
                f"messages has {len(messages)} entries, more than the {MAX_MESSAGES} a request may carry; "
                "drop or merge old turns",
                "messages",
            )
        msgs, chars, images, videos = [], 0, [], []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}] must be an object {{role, content}}", f"messages[{i}]")
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise BadRequest(
                    f"messages[{i}].role={_short(role)} must be one of {', '.join(ROLES)}", f"messages[{i}].role"
                )
            if isinstance(content, list):  # text parts, and image / video parts for a vision-language model
                content = self._parts(content, i, role, images, videos)
            calls = role == "assistant" and m.get("tool_calls")
            if not isinstance(content, str) and not (calls and content is None):
                raise BadRequest(
                    f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
                )
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise BadRequest(
                    f"messages[{i}].reasoning_content must be a string", f"messages[{i}].reasoning_content"
                )
            chars += len(content or "") + len(json.dumps(m.get("tool_calls") or "")) + len(reasoning or "")
            msgs.append({**m, "role": "system" if role == "developer" else role, "content": content})
        msgs = with_control(msgs, self._control(body))  # extra_body.control: the prefix SFT trained on
        self._fits(chars + len(json.dumps(body.get("tools") or "")), "messages")
        tools, mode = self._tools(body)
        if images or videos:
            if tools is not None or is_tool_dialog(msgs):
                raise BadRequest("tools with images or videos are not supported by this server yet", "tools")
            return (*self._vl_prompt(msgs, images, videos), None)
        try:
            if tools is not None or is_tool_dialog(msgs):
                msgs = self._dialog(msgs, tools)
            else:
                msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
            self._fits(
                len(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools)), "messages"
            )
            ids = chat_prompt_ids(self.tokenizer, msgs, tools)
        except DataError as e:
            raise BadRequest(str(e), "messages") from None
        if mode is not None and mode.forced:
            ids = ids + self.tokenizer.encode(mode.forced)
        return ids, None, None, mode

    def _control(self, body: dict) -> dict[str, str]:
        """`control` (the openai client's extra_body={"control": {...}}): attribute -> value strings,
        rendered as the control prefix (erniekit/data/control.py; docs/control.md); an attribute the
        model was not trained on (`control_record`) is refused."""
        from erniekit.data.control import check_control, check_trained_control
        from erniekit.errors import DataError

        try:
            control = check_control(body.get("control"), "request")
            check_trained_control(control, self.control_record, "control ")
        except DataError as e:
            raise BadRequest(str(e).removeprefix("request: "), "control") from None
        return control

    def _dialog(self, msgs: list[dict], tools: list[dict] | None) -> list[dict]:
        from erniekit.data.tool_messages import normalize_dialog

        if not self.thinking:
            raise BadRequest(
                "this model's chat template has no tool calls or reasoning (not the ERNIE thinking format); "
                "serve a checkpoint trained with chat_template: ernie_thinking",
                "messages",
            )
        return normalize_dialog(msgs, "request", tools or [], end="prompt")

    def _tools(self, body: dict) -> tuple[list[dict] | None, ReplyMode | None]:
        """tools, tool_choice and parallel_tool_calls -> (tools for the template, how to read the reply)."""
        from erniekit.data.tool_messages import check_tools
        from erniekit.errors import DataError

        raw, choice = body.get("tools"), body.get("tool_choice")
        parallel = True if body.get("parallel_tool_calls") is None else _flag(body, "parallel_tool_calls")
        if raw in (None, []):
            if choice not in (None, "none", "auto"):
                raise BadRequest(f"tool_choice={_short(choice)} needs tools", "tool_choice")
            return None, (ReplyMode() if self.thinking else None)
        if not self.thinking:
            raise BadRequest(
                "tools need a model in the ERNIE thinking format (reasoning and tool calls); this checkpoint's chat "
                "template has neither: fine-tune with chat_template: ernie_thinking",
                "tools",
            )
        try:
            tools = check_tools(raw, "request")
        except DataError as e:
            raise BadRequest(str(e).removeprefix("request: "), "tools") from None
        names = [t["function"]["name"] for t in tools]
        if choice in (None, "auto"):
            return tools, ReplyMode(tools=True, single_call=not parallel)
        if choice == "none":
            return None, ReplyMode()
        if choice == "required":
            # the reply starts with a call whose name the model writes
            forced = '\n</think>\n\n<tool_call>\n{"name": "'
            return tools, ReplyMode(forced=forced, tools=True, single_call=not parallel)
        fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise BadRequest(
                f"tool_choice={_short(choice)} must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice"
            )
        forced = '\n</think>\n\n<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return tools, ReplyMode(forced=forced, tools=True, single_call=True)

    def _busy(self, where: str) -> BadRequest:
        return NoMediaSlot(
            f"{where}: the server is decoding the images and videos of {MEDIA_REQUESTS_AT_ONCE} other requests "
            f"and none finished within {MEDIA_WAIT_S:g} s; retry later",
            where,
            "server_busy",
            status=503,
            kind="server_error",
        )

    @contextlib.contextmanager
    def _media_request(self):
        """The parsing of one request on this worker thread: the media slot its first image or
        video takes (`_media_slot`) is given back when it ends, its decoded media dropped."""
        self._media_held.slot = False
        try:
            yield
        finally:
            held = self._media_held.slot
            del self._media_held.slot  # outside a request's parsing, nothing takes a slot
            if held:
                self._media_slots.release()

    def _media_slot(self, where: str) -> None:
        """Before this request decodes its first image or video: it holds a slot, or takes a free
        one, or raises NoMediaSlot, before any decoding (the caller waits on the event loop and
        parses again: a worker thread is never held waiting, text requests need them)."""
        if getattr(self._media_held, "slot", True):  # held already, or not parsing a request (a direct call)
            return
        if not self._media_slots.acquire(blocking=False):
            raise self._busy(where)
        self._media_held.slot = True

    def _parts(self, content: list, i: int, role: str, images: list, videos: list) -> str:
        """Content parts -> the message's text, IMAGE_MARKER / VIDEO_MARKER where an image / a
        video was (decoded, appended to `images` / `videos`)."""
        from erniekit.data.formats import IMAGE_MARKER, VIDEO_MARKER
        from erniekit.models.ernie4_5_vl.processor import MAX_REQUEST_PIXELS

        out = []
        for j, p in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                out.append(p["text"])
                continue
            if kind not in ("image_url", "video_url"):
                raise BadRequest(
                    f"{where} must be {{type: text, text: str}}"
                    + (
                        ", {type: image_url, image_url: {url: str}} or {type: video_url, ...}" if self.engine.vl else ""
                    ),
                    where,
                )
            if not self.engine.vl:
                raise BadRequest(f"{where}: this model reads no images (it is not a vision-language model)", where)
            if role != "user":
                raise BadRequest(f"{where}: images and videos go in user messages, not {role} ones", where)
            self._media_slot(where)
            if kind == "video_url":
                if len(videos) >= MAX_VIDEOS:
                    raise BadRequest(f"{where}: more than {MAX_VIDEOS} videos in one request", where)
                url = p.get("video_url")
                url = url.get("url") if isinstance(url, dict) else url
                videos.append(self._video(url, where + ".video_url.url"))
                out.append(VIDEO_MARKER)
                continue
            if len(images) >= self.max_images:
                raise BadRequest(f"{where}: more than {self.max_images} images in one request", where)
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url  # {"url": ...} or the bare string
            images.append(self._image(url, where + ".image_url.url"))
            total = sum(im.width * im.height for im in images)  # decoded, held until the prompt is built
            if total > MAX_REQUEST_PIXELS:
                raise BadRequest(
                    f"{where}: the request's images total {total} pixels, more than {MAX_REQUEST_PIXELS}; "
                    "send fewer or smaller images",
                    where + ".image_url.url",
                )
            out.append(IMAGE_MARKER)
        return "".join(out)

    def _local_file(self, url: str, where: str, instead: str) -> str:
        """The real path of a file URL (percent-decoded, as a URL is) or path (as it is) under
        --allowed-local-media-path; a URL to fetch, or any other path, is refused (`instead`: what
        the client may send). Every check is on the decoded path."""
        path = url[len("file://") :] if url.startswith("file://") else url
        if "://" in path:
            raise BadRequest(f"{where}: this server fetches nothing from the network; {instead}", where)
        if url.startswith("file://"):
            path = urllib.parse.unquote(path)
        if "\x00" in path:  # no file has one (%00 decodes to it); os.path would raise ValueError (a 500)
            raise BadRequest(f"{where}: a path cannot contain a NUL character", where)
        if self.local_media_root is None:
            raise BadRequest(
                f"{where}: local files are read only when the server runs with --allowed-local-media-path DIR; {instead}",
                where,
            )
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.local_media_root]) != self.local_media_root:
            raise BadRequest(f"{where}: {_short(url)} is outside --allowed-local-media-path", where)
        return real

    def _image(self, url: Any, where: str):
        """A decoded image from a data: URI, or a file under --allowed-local-media-path; nothing
        is ever fetched from the network."""
        from erniekit.models.ernie4_5_vl.processor import ImageError, load_image

        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where} must be a non-empty string (a data: URI)", where)
        if not url.startswith("data:"):
            url = self._local_file(url, where, "send the image as a data:image/...;base64 URI")
        try:
            return load_image(url, where=where)
        except ImageError as e:
            raise BadRequest(str(e), where) from None

    def _video(self, url: Any, where: str):
        """A video file under --allowed-local-media-path, decoded to its sampled frames."""
        from erniekit.models.ernie4_5_vl.processor import ImageError
        from erniekit.models.ernie4_5_vl.video import load_video

        if not isinstance(url, str) or not url or url.startswith("data:"):
            raise BadRequest(f"{where} must name a video file under --allowed-local-media-path", where)
        path = self._local_file(url, where, "videos are read from files under --allowed-local-media-path")
        try:
            return load_video(path, where, self.engine.model.video_settings)
        except ImageError as e:
            raise BadRequest(str(e), where) from None

    def _vl_prompt(self, msgs: list[dict], images: list, videos: list) -> tuple[list[int], tuple, tuple]:
        """The prompt of a conversation with images or videos, rendered as VL-SFT trains (their
        tokens in place), and their (patches, grid_thw)."""
        from erniekit.data.formats import Conversation
        from erniekit.errors import DataError
        from erniekit.infer.vl_generate import prompt_with_videos

        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        body = msgs[1:] if system is not None else msgs
        roles = [m["role"] for m in body]
        if roles != ["user", "assistant"] * (len(body) // 2) + ["user"]:
            raise BadRequest(
                "messages with images or videos must be an optional system message, then user and assistant "
                "messages in turn, ending with a user message",
                "messages",
            )
        turns = [
            (body[k]["content"], body[k + 1]["content"] if k + 1 < len(body) else "") for k in range(0, len(body), 2)
        ]
        conv = Conversation(system, turns, [True] * len(turns), "messages", images, videos)
        model = self.engine.model
        try:
            return prompt_with_videos(conv, self.tokenizer, model.config, model.image_settings, model.video_settings)
        except DataError as e:
            raise BadRequest(str(e), "messages") from None

    def _prompts(self, body: dict) -> tuple[list[list[int]], list[str | None]]:
        """Every OpenAI prompt form: a string, a list of strings, a list of token ids, a list of
        token-id lists (a choice per prompt). Returns the ids and each prompt's text (None for ids)."""
        prompt = body.get("prompt")
        forms = "a non-empty string, list of strings, list of token ids or list of token-id lists"
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
            items = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt))
        ):
            items = prompt
        else:
            raise BadRequest(f"prompt must be {forms}", "prompt")
        if len(items) > MAX_PROMPTS:
            raise BadRequest(
                f"prompt has {len(items)} prompts; send at most {MAX_PROMPTS} per request", "prompt", "too_many_prompts"
            )
        where = (lambda i: "prompt") if len(items) == 1 else (lambda i: f"prompt[{i}]")
        for i, p in enumerate(items):  # every length check before any tokenising
            if isinstance(p, str):
                self._fits(len(p), where(i))
        return [self._prompt_ids(p, where(i), forms) for i, p in enumerate(items)], [
            p if isinstance(p, str) else None for p in items
        ]

    def _prompt_ids(self, p: str | list, where: str, forms: str) -> list[int]:
        if isinstance(p, str):
            ids = self.tokenizer.encode(p)
        elif p and all(_is_id(t) for t in p):
            if not all(0 <= t < self.vocab for t in p):
                raise BadRequest(f"{where}: token ids must be in [0, {self.vocab})", where)
            ids = list(p)
        else:
            raise BadRequest(f"{where} must be a non-empty string or list of token ids (prompt: {forms})", where)
        if not ids:
            raise BadRequest(f"{where} encodes to no tokens; send some text", where)
        return ids

    def parse(self, raw: bytes, chat: bool) -> Parsed:
        """Raw body -> the checked request, or BadRequest. Runs in a worker thread (JSON parsing
        and tokenising are CPU work)."""
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        o = self._options(body, chat)
        if chat:
            with self._media_request():
                prompts, texts = [self._messages(body)], None
        else:
            if body.get("control") is not None:
                raise BadRequest(
                    "control is an option of /v1/chat/completions (it goes into the chat template); leave it out",
                    "control",
                )
            ids, texts = self._prompts(body)
            prompts = [(p, None, None, None) for p in ids]
        longest = max(len(p[0]) for p in prompts)
        room = self.engine.max_model_len - longest
        if o["max_tokens"] is None and room < 1:  # no max_tokens to lower: the prompt alone fills the context
            raise BadRequest(
                f"the prompt ({longest} tokens) leaves no room for a reply in the context of "
                f"{self.engine.max_model_len} tokens; shorten the prompt",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        max_tokens = o["max_tokens"] if o["max_tokens"] is not None else min(DEFAULT_MAX_TOKENS, room)
        try:
            self.engine.check(longest, max(1, max_tokens))
        except ValueError as e:
            raise BadRequest(
                f"{e} ({o['max_key']})", "messages" if chat else "prompt", "context_length_exceeded"
            ) from None
        try:
            params = SamplingParams(
                max_new_tokens=max(1, max_tokens),
                temperature=o["temperature"],
                top_p=o["top_p"],
                seed=o["seed"],
                presence_penalty=o["presence_penalty"],
                frequency_penalty=o["frequency_penalty"],
                logit_bias=o["logit_bias"],
            )
        except ValueError as e:  # the checks above cover these; kept so a gap is a 400, not a 500
            raise BadRequest(str(e)) from None
        if o["logprobs"] is not None:
            scored = (sum(len(p[0]) for p in prompts) if o["echo"] else 0) + len(prompts) * max_tokens
            entries = scored * (1 + o["logprobs"])
            if entries > MAX_LOGPROB_ENTRIES:
                raise BadRequest(
                    f"logprobs={o['logprobs']} over {scored} tokens asks for {entries} log-probabilities, more than "
                    f"the {MAX_LOGPROB_ENTRIES} a request may; ask for fewer alternatives, tokens or prompts",
                    "logprobs",
                    "too_many_logprobs",
                )
        stops = o["stops"]
        mode = prompts[0][3]
        if mode is not None and mode.single_call:
            stops = [*stops, "</tool_call>"]  # parallel_tool_calls false: the reply ends with its first call
        return Parsed(
            prompts,
            params,
            stops,
            o["stream"],
            o["include_usage"],
            logprobs=o["logprobs"],
            echo=o["echo"],
            prompt_only=max_tokens == 0,
            texts=texts,
        )

    # ---- the tokenizer over HTTP (vLLM's endpoints: lm-eval's remote tokenizer reads them) ----
    def _body(self, raw: bytes) -> dict:
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def tokenize(self, raw: bytes) -> dict:
        body = self._body(raw)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt={_short(prompt)} must be a string", "prompt")
        self._fits(len(prompt), "prompt")
        ids = self.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens"))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    def detokenize(self, raw: bytes) -> dict:
        tokens = self._body(raw).get("tokens")
        if isinstance(tokens, list) and len(tokens) > self.engine.max_model_len:  # 1 MiB holds ~500k ids
            raise BadRequest(
                f"tokens holds {len(tokens)} ids, more than the context of {self.engine.max_model_len}; "
                "send at most that many per request",
                "tokens",
                "context_length_exceeded",
            )
        if not isinstance(tokens, list) or not all(_is_id(t) and 0 <= t < self.vocab for t in tokens):
            raise BadRequest(f"tokens must be a list of token ids in [0, {self.vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        special = getattr(self.tokenizer, "special_tokens", {})
        return {
            "tokenizer_class": type(self.tokenizer).__name__,
            "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"),
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "chat_template": getattr(self.tokenizer, "chat_template", None),
            "model_max_length": self.engine.max_model_len,
        }

    # ---- running ---------------------------------------------------------------------------
    def start(self, q: Parsed, client: str | None = None) -> tuple[list[Request], asyncio.Queue]:
        """Queue one engine request per prompt; their text pieces arrive on the returned asyncio
        queue as (prompt index, delta, finish, log-probabilities recorded by then): the count is
        taken on the engine thread as the piece is emitted, so a chunk's log-probabilities are
        those of the tokens decided up to its text, whatever the engine has done since. `client`
        (the peer's address; None: not counted per client) bounds what one client holds and is
        what the engine takes turns by."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        reqs: list[Request] = []
        media = any(images is not None or videos is not None for _, images, videos, _ in q.prompts)
        self._admit(len(q.prompts), media, client)
        ended: set[int] = set()  # requests of this call that gave their place back (once each, even if finished twice)

        def done(i: int) -> None:
            with self._flight_lock:
                if i in ended:
                    return
                ended.add(i)
                self._in_flight -= 1
                self._media_in_flight -= media and len(ended) == len(q.prompts)
                if client is not None:
                    held = self._client_in_flight[client] - 1
                    if held:
                        self._client_in_flight[client] = held
                    else:
                        del self._client_in_flight[client]

        for i, (ids, images, videos, _mode) in enumerate(q.prompts):

            def emit(delta: str, finish: str | None, i: int = i) -> None:
                if finish is not None:
                    done(i)
                loop.call_soon_threadsafe(out.put_nowait, (i, delta, finish, len(reqs[i].token_logprobs)))

            req = Request(
                ids,
                q.params,
                emit,
                q.stops,
                images=images,
                videos=videos,
                logprobs=q.logprobs,
                prompt_logprobs=q.logprobs if q.echo else None,
                prompt_only=q.prompt_only,
                client=client,
            )
            reqs.append(req)
        submitted = 0
        try:
            for req in reqs:
                self.engine.submit(req)
                submitted += 1
        except BaseException:
            for req in reqs:
                req.cancelled = True  # the submitted ones finish (and count down) at the next step
            for i in range(submitted, len(reqs)):
                done(i)
            raise
        return reqs, out

    def _admit(self, n: int, media: bool, client: str | None = None) -> None:
        """Count `n` requests in (one call of /v1/completions may hold 64 prompts), or refuse them
        with a 429 when the server holds max_queued already, or `client` max_per_client, or
        MEDIA_IN_FLIGHT requests with images or videos: the OpenAI client retries a 429 after a
        pause."""
        if n > self.max_queued:
            raise BadRequest(
                f"{n} prompts in one request, more than the server holds at once ({self.max_queued}, "
                "--max-queued-requests); send fewer",
                "prompt",
            )
        if client is not None and self.max_per_client and n > self.max_per_client:
            raise BadRequest(
                f"{n} prompts in one request, more than one client may hold at once ({self.max_per_client}, "
                "--max-queued-per-client); send fewer",
                "prompt",
            )
        with self._flight_lock:
            if self._in_flight + n > self.max_queued:
                raise _retry_later(
                    f"the server holds {self._in_flight} requests (at most {self.max_queued} queued or running, "
                    "--max-queued-requests); retry later",
                )
            held = self._client_in_flight.get(client, 0) if client is not None else 0
            if client is not None and self.max_per_client and held + n > self.max_per_client:
                raise _retry_later(
                    f"this client holds {held} requests (at most {self.max_per_client} queued or running per "
                    "client, --max-queued-per-client); retry later",
                )
            if media and self._media_in_flight >= MEDIA_IN_FLIGHT:
                raise _retry_later(
                    f"the server holds {MEDIA_IN_FLIGHT} requests with images or videos, the most it keeps at once; "
                    "retry later",
                )
            self._in_flight += n
            self._media_in_flight += media
            if client is not None:
                self._client_in_flight[client] = held + n

    @staticmethod
    def usage(reqs: list[Request]) -> dict:
        p = sum(len(r.prompt) for r in reqs)
        # the stop token that ended a reply was generated (and has a log-probability entry), as vLLM counts it
        n = sum(len(r.completion) + r.ended_on_stop_token for r in reqs)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _echo(self, q: Parsed, i: int) -> str:
        """The prompt's text as sent (token ids: decoded with their special tokens)."""
        text = q.texts[i] if q.texts else None
        return text if text is not None else self.tokenizer.decode(q.prompts[i][0], skip_special_tokens=False)

    def _completion_lp(self, q: Parsed, req: Request, entries, with_prompt: bool, offset: int = 0) -> dict | None:
        if q.logprobs is None:
            return None
        from erniekit.infer.openai_logprobs import completion_logprobs

        first = req.prompt[0] if with_prompt else None
        return completion_logprobs(self.token_texts, entries, first, offset)

    def _chat_lp(self, q: Parsed, entries) -> dict | None:
        if q.logprobs is None:
            return None
        from erniekit.infer.openai_logprobs import chat_logprobs

        return chat_logprobs(self.token_texts, entries)

    async def whole(self, chat: bool, q: Parsed, client: str | None = None) -> dict:
        """The whole reply (a choice per prompt); if this coroutine is cancelled (its client went
        away) the requests leave the batch at the next step instead of generating for nobody."""
        reqs, out = self.start(q, client)
        finish: list[str | None] = [None] * len(reqs)
        try:
            while any(f is None for f in finish):
                i, _, f, _ = await out.get()
                if f is not None:
                    finish[i] = f
        finally:
            for i, req in enumerate(reqs):
                if finish[i] is None:
                    req.cancelled = True
        failed = next((r for r, f in zip(reqs, finish) if f == "error"), None)
        if failed is not None:
            raise BadRequest(f"generation failed: {failed.error}", status=500, kind="server_error")
        rid, now = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        if chat:
            choices = [self._chat_choice(q, reqs[0], finish[0])]
        else:
            choices = []
            for i, req in enumerate(reqs):
                entries, prefix = req.token_logprobs, ""
                if q.echo:
                    prefix = self._echo(q, i)
                    entries = [*req.prompt_token_logprobs, *entries]
                lp = self._completion_lp(q, req, entries, with_prompt=q.echo)
                choices.append({"index": i, "text": prefix + req.text, "finish_reason": finish[i], "logprobs": lp})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(reqs),
        }

    def _chat_choice(self, q: Parsed, req: Request, finish: str) -> dict:
        mode = q.prompts[0][3]
        lp = self._chat_lp(q, req.token_logprobs)
        if mode is None:
            return {
                "index": 0,
                "message": {"role": "assistant", "content": req.text},
                "finish_reason": finish,
                "logprobs": lp,
            }
        from erniekit.infer.reply_parser import collect

        parser = mode.parser()
        reply = collect(parser.feed(req.text) + parser.finish(cut=finish == "length"))
        calls = reply.tool_calls[:1] if mode.single_call else reply.tool_calls
        message = {"role": "assistant", "content": reply.content if reply.content or not calls else None}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}

    async def stream(self, chat: bool, q: Parsed, client: str | None = None, started=None):
        """Server-sent events: OpenAI's chunk objects, then `data: [DONE]`. A thinking-format reply
        streams `reasoning_content` and `content` deltas, and each tool call as one `tool_calls`
        delta (index, id, name and its whole arguments) once its block is complete. Several prompts
        stream side by side, each chunk naming its choice's index. A chunk's logprobs cover the
        tokens decided since the previous chunk of its choice (held-back text can trail them).
        `started`: what `start` returned, called by the route before the response's 200, so a
        refusal is a 429 and not a broken stream."""
        reqs, out = started if started is not None else self.start(q, client)
        rid, now = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        mode = q.prompts[0][3] if chat else None
        parser = mode.parser() if mode is not None else None
        calls = 0
        lp_sent = [0] * len(reqs)
        offsets = [0] * len(reqs)

        def new_logprobs(i: int, upto: int, prompt_first: bool = False) -> dict | None:
            if q.logprobs is None:
                return None
            req = reqs[i]
            entries = req.token_logprobs[lp_sent[i] : max(lp_sent[i], upto)]
            lp_sent[i] += len(entries)
            if chat:
                return self._chat_lp(q, entries)
            if prompt_first:
                entries = [*req.prompt_token_logprobs, *entries]
            lp = self._completion_lp(q, req, entries, prompt_first, offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
            return lp

        def chunk(i: int, delta: dict | str | None, finish: str | None, first: bool = False, lp=None) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({} if delta is None else delta)
                choice = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            obj = {"id": rid, "object": kind, "created": now, "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def deltas(events, upto: int) -> list[str]:
            nonlocal calls
            outs = []
            for what, value in events:
                if what == "tool_call":
                    if mode.single_call and calls:
                        continue
                    outs.append(chunk(0, {"tool_calls": [{"index": calls, **value}]}, None, lp=new_logprobs(0, upto)))
                    calls += 1
                else:
                    key = "reasoning_content" if what == "reasoning" else "content"
                    outs.append(chunk(0, {key: value}, None, lp=new_logprobs(0, upto)))
            return outs

        finished = [False] * len(reqs)
        try:
            if chat:
                yield chunk(0, None, None, first=True)
            # an echoed prompt goes out with its choice's first event: its log-probabilities exist
            # once the engine has prefilled it, before that request emits anything
            echoed = [not q.echo or chat] * len(reqs)
            while not all(finished):
                i, delta, finish, upto = await out.get()
                if finish == "error":
                    err = BadRequest(f"generation failed: {reqs[i].error}", status=500, kind="server_error")
                    yield f"data: {json.dumps(error_body(err))}\n\n"
                    break
                if not echoed[i]:
                    echoed[i] = True
                    yield chunk(i, self._echo(q, i), None, lp=new_logprobs(i, 0, prompt_first=True))
                if delta and parser is not None:
                    for c in deltas(parser.feed(delta), upto):
                        yield c
                elif delta:
                    yield chunk(i, {"content": delta} if chat else delta, None, lp=new_logprobs(i, upto))
                if finish is not None:
                    if parser is not None:
                        for c in deltas(parser.finish(cut=finish == "length"), upto):
                            yield c
                        finish = "tool_calls" if calls and finish == "stop" else finish
                    rest = q.logprobs is not None and lp_sent[i] < upto
                    yield chunk(i, None, finish, lp=new_logprobs(i, upto) if rest else None)
                    finished[i] = True
            if q.include_usage:
                obj = {
                    "id": rid,
                    "object": kind,
                    "created": now,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self.usage(reqs),
                }
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for req in reqs:
                req.cancelled = True  # a client that went away stops its generation at the next step


def build_app(server: OpenAIServer):
    """The FastAPI application around `server`: every response that is not a success, whatever
    raised it (a route, the framework, a bug), is one JSON object in OpenAI's error shape."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="erniekit", docs_url=None, redoc_url=None, openapi_url=None)
    # "/v1/completions/" is a 404 naming the routes, not a 307 whose Location echoes the Host header
    app.router.redirect_slashes = False

    class EndingStream(StreamingResponse):
        """A stream that cancels its requests however the response ends. Under uvicorn (ASGI 2.3)
        Starlette's disconnect listener closes the body's generator; under a server whose `send`
        raises for a client that is gone (ASGI 2.4: Hypercorn, Granian) the generator may never
        start, and one that never started runs no `finally`: its requests generated to max_tokens
        for nobody, holding a batch row and the client's place."""

        def __init__(self, reqs: list[Request], body) -> None:
            super().__init__(body, media_type="text/event-stream")
            self.reqs = reqs

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                for req in self.reqs:
                    req.cancelled = True

    def fail(e: BadRequest) -> JSONResponse:
        # after 408 / 413 the rest of the body is not wanted: close, so the client stops sending it
        headers = {"Connection": "close"} if e.status in (408, 413) else None
        return JSONResponse(error_body(e), status_code=e.status, headers=headers)

    async def read_body(request: HTTPRequest) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit: from
        Content-Length before reading anything, else while counting the streamed (chunked) pieces,
        so a huge upload costs at most max_body_bytes of memory and never delays other clients."""
        limit = server.max_body_bytes
        too_big = BadRequest(
            f"the request body exceeds {limit} bytes (the server's --max-body-bytes); send a shorter request",
            None,
            "request_too_large",
            status=413,
        )
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise BadRequest(f"Content-Length {_short(declared)} is not a byte count")
            if int(declared) > limit:
                raise too_big
        chunks, size = [], 0

        async def collect() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(collect(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s", None, "request_timeout", status=408
            ) from None
        return b"".join(chunks)

    async def until_disconnect(request: HTTPRequest, work):
        """Run `work`, cancelled when the client disconnects first (the body is read by now, so
        the next ASGI message is the disconnect)."""
        task = asyncio.ensure_future(work)

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(gone())
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            watch.cancel()
            return task.result()
        task.cancel()
        return fail(BadRequest("the client disconnected before the reply", status=499, code="client_closed"))

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": server.model_name,
            "running": len(server.engine.rows),
            "waiting": server.engine.queued(),
        }

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        try:
            server.check_key(request.headers.get("authorization"))
        except BadRequest as e:
            return fail(e)
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": server.created, "owned_by": "erniekit"}],
        }

    async def parse_waiting_for_media(raw: bytes, chat: bool) -> Parsed:
        """server.parse in a worker thread; while every media slot is taken, wait here, on the
        event loop, and parse again (backing off to 1 s), until MEDIA_WAIT_S has passed."""
        give_up, pause = time.monotonic() + MEDIA_WAIT_S, 0.05
        while True:
            try:
                return await asyncio.to_thread(server.parse, raw, chat)
            except NoMediaSlot:
                if time.monotonic() + pause > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)

    async def handle(request: HTTPRequest, chat: bool):
        try:
            server.check_key(request.headers.get("authorization"))
            raw = await read_body(request)
            q = await parse_waiting_for_media(raw, chat)
            client = client_of(request.client.host) if request.client else None
            if q.stream:  # admitted here: once the response starts, its status is 200
                started = server.start(q, client)
                return EndingStream(started[0], server.stream(chat, q, started=started))
            return await until_disconnect(request, server.whole(chat, q, client))
        except BadRequest as e:
            return fail(e)

    async def tokenizer_call(request: HTTPRequest, what):
        try:
            server.check_key(request.headers.get("authorization"))
            raw = await read_body(request) if what is not None else b""
            return await asyncio.to_thread(what, raw) if what is not None else server.tokenizer_info()
        except BadRequest as e:
            return fail(e)

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        return await tokenizer_call(request, server.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        return await tokenizer_call(request, server.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        return await tokenizer_call(request, None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle(request, chat=False)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException):
        if exc.status_code == 404:
            e = BadRequest(
                f"no route {request.method} {request.url.path}; see /v1/models, /v1/chat/completions, "
                "/v1/completions, /health",
                status=404,
                code="not_found",
            )
        elif exc.status_code == 405:
            e = BadRequest(
                f"{request.method} is not allowed on {request.url.path}", status=405, code="method_not_allowed"
            )
        else:
            e = BadRequest(str(exc.detail), status=exc.status_code)
        return fail(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return fail(BadRequest(f"invalid request: {first.get('msg', 'malformed')}", where, status=422))

    @app.exception_handler(Exception)
    async def internal(request: HTTPRequest, exc: Exception):
        return fail(
            BadRequest(
                f"internal error ({type(exc).__name__}); the server keeps serving, please report it",
                status=500,
                kind="server_error",
                code="internal_error",
            )
        )

    return app


def api_key_from(flag: str | None) -> tuple[str | None, str]:
    """The API key and where it came from: --api-key wins over the ERNIEKIT_API_KEY environment
    variable (which, unlike a flag, other users cannot read in `ps`)."""
    if flag:
        return flag, "--api-key"
    env = os.environ.get(API_KEY_ENV)
    return (env, API_KEY_ENV) if env else (None, "")


def fastdeploy_parser_flags(model_dir: str) -> list[str]:
    """FastDeploy's reasoning and tool-call parser flags for a checkpoint in the ERNIE thinking
    format: `ernie-x1` for text models, `ernie-45-vl-thinking` for vision-language ones (as
    FastDeploy serves ERNIE-4.5-21B-A3B-Thinking and ERNIE-4.5-VL-28B-A3B-Thinking); none for the
    plain chat format."""
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

    if not os.path.isfile(os.path.join(model_dir, "tokenizer.model")):
        return []
    if not ErnieTokenizer.from_pretrained(model_dir).thinking:
        return []
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        model_type = ""
    name = "ernie-45-vl-thinking" if "vl" in str(model_type) else "ernie-x1"
    return ["--reasoning-parser", name, "--tool-call-parser", name]


def fastdeploy_command(
    model_dir: str,
    host: str,
    port: int,
    max_model_len: int,
    max_batch: int,
    quantization: str | None = None,
    api_key: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """FastDeploy's own OpenAI server on an exported directory, as ERNIEKit starts it: (command,
    extra environment). The API key goes in FastDeploy's FD_API_KEY variable, not on the command
    line, where `ps` and FastDeploy's own argument log would show it; `quantization` (wint8 /
    wint4) becomes its `--quantization`, which quantizes the float weights as it loads them. A
    one-line error when FastDeploy or a GPU is missing, or for an erniekit wint8/wint4 directory
    (erniekit's own int8/int4 + scale layout, which FastDeploy does not read)."""
    import importlib.util

    from erniekit.errors import ErniekitError

    if importlib.util.find_spec("fastdeploy") is None:
        raise ErniekitError(
            "--backend fastdeploy needs FastDeploy (pip install fastdeploy-gpu from PaddlePaddle's "
            "index, on a CUDA machine); the built-in engine (--backend builtin) runs anywhere"
        )
    from erniekit.utils.device import cuda_visible

    if not cuda_visible():
        raise ErniekitError("--backend fastdeploy needs a GPU and paddlepaddle-gpu; use --backend builtin here")
    info_path = os.path.join(model_dir, "export_info.json")
    fmt = None
    if os.path.isfile(info_path):
        try:
            with open(info_path, encoding="utf-8") as f:
                fmt = json.load(f).get("format")
        except (OSError, ValueError, AttributeError) as e:
            raise ErniekitError(f"{info_path}: unreadable ({e}); re-export the model") from None
    if fmt in ("wint8", "wint4"):
        raise ErniekitError(
            f"{model_dir} is an erniekit {fmt} export, whose int8/int4 + scale layout FastDeploy "
            f"does not read; export --format hf and serve that with --backend fastdeploy "
            f"--quantization {fmt} (FastDeploy quantizes as it loads)"
        )
    if quantization not in (None, "wint8", "wint4"):
        raise ErniekitError(f"--quantization {quantization}: FastDeploy's weight-only choices here are wint8, wint4")
    cmd = [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_batch),
    ]
    if quantization:
        cmd += ["--quantization", quantization]
    cmd += fastdeploy_parser_flags(model_dir)
    env = {}
    if api_key:
        if "," in api_key:
            raise ErniekitError(
                "the API key contains ',', which FastDeploy's FD_API_KEY reads as a separator "
                "between keys; choose a key without commas"
            )
        env["FD_API_KEY"] = api_key
    return cmd, env


def run_server(ns) -> int:
    """`erniekit server`: load the model, start the engine and serve until interrupted. The API
    key is said to be required, never printed."""
    api_key, key_source = api_key_from(ns.api_key)
    if ns.backend == "fastdeploy":
        import subprocess

        cmd, env = fastdeploy_command(
            ns.model_dir,
            ns.host,
            ns.port,
            ns.max_model_len or 32768,
            ns.max_batch,
            quantization=ns.quantization,
            api_key=api_key,
        )
        note = f" (API key from {key_source}, passed in FD_API_KEY)" if api_key else ""
        print("erniekit: starting FastDeploy: " + " ".join(cmd) + note, flush=True)
        return subprocess.call(cmd, env={**os.environ, **env})
    if ns.quantization:
        from erniekit.errors import ErniekitError

        raise ErniekitError(
            "--quantization is for --backend fastdeploy; the built-in engine serves a wint8/wint4 "
            "export directory (erniekit export --format wint8) as it is"
        )
    import uvicorn

    from erniekit.data.control import read_control_record
    from erniekit.infer.chat import load_chat_model, stop_ids
    from erniekit.infer.weight_packing import packing_choice

    control_record = read_control_record(ns.model_dir)  # a damaged file stops here, before the weights load
    model, tokenizer = load_chat_model(ns.model_dir)
    pack, packing = packing_choice(model, getattr(ns, "packed_weights", None) or "auto")
    engine = Engine(
        model,
        tokenizer,
        max_batch=ns.max_batch,
        max_model_len=ns.max_model_len,
        stop_token_ids=stop_ids(model, tokenizer),
        pack_weights=pack,
    )
    name = ns.served_model_name or os.path.basename(os.path.normpath(ns.model_dir))
    media = getattr(ns, "allowed_local_media_path", None)
    if media and not os.path.isdir(media):
        from erniekit.errors import ErniekitError

        raise ErniekitError(f"server: --allowed-local-media-path {media} is not a directory")
    server = OpenAIServer(
        engine,
        tokenizer,
        name,
        api_key,
        max_body_bytes=ns.max_body_bytes,
        local_media_root=media,
        max_queued=ns.max_queued_requests,
        max_per_client=getattr(ns, "max_queued_per_client", None),
    )
    server.control_record = control_record
    app = build_app(server)
    print(
        f"erniekit: serving {name} ({ns.model_dir}) at http://{ns.host}:{ns.port}/v1 (up to {ns.max_batch} "
        f"requests at once, context {engine.max_model_len} tokens, bodies up to {ns.max_body_bytes} bytes, "
        + (f"API key required, from {key_source})" if api_key else "no API key)")
        + f"; {packing}",
        flush=True,
    )
    raise_open_files_limit()
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        engine.close()
    return 0


OPEN_FILES_TARGET = 65536
MACOS_OPEN_MAX = 10240  # the most a soft limit may be on macOS, whatever the hard one


def raise_open_files_limit() -> int:
    """The soft limit on open files raised toward the hard one (at most OPEN_FILES_TARGET), as vLLM
    does: each client connection holds a descriptor, and at a common soft limit of 1024 about a
    thousand slow or idle connections (one misbehaving client) leave the server unreachable for
    everyone. Returns the soft limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_TARGET if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_TARGET)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    error = None
    for target in dict.fromkeys((want, min(want, MACOS_OPEN_MAX))):  # macOS refuses more than OPEN_MAX
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as e:  # a container may forbid it: serve with what there is
            error = e
    print(f"erniekit: could not raise the open-files limit from {soft} toward {want} ({error})", flush=True)
    return soft
