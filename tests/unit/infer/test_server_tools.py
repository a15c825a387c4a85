"""The server's tools API through the official `openai` client, on a scripted engine (what a
model writes is fixed, so every assertion is about the server): tool_calls with ids and JSON
arguments, reasoning_content, finish_reason tool_calls, the same reply streamed as deltas the
client accumulates, tool_choice none / required / named, parallel_tool_calls, and one-line 400s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from erniekit.models.ernie4_5.tokenizer import default_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from erniekit.infer.server import OpenAIServer, build_app  # noqa: E402

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TWO_CALLS = (
    "Use it twice.\n</think>\n\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*86"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
)
ANSWER = "Answer with the result.\n</think>\n\n<response>\n4042\n</response>\n"


class ScriptedEngine:
    """Stands in for Engine: every request gets `reply` (cut at the request's stop strings), in
    3-character pieces; the prompts it was given are kept."""

    def __init__(self, tokenizer, reply: str, finish: str = "stop"):
        self.tokenizer, self.reply, self.prompts, self.finish = tokenizer, reply, [], finish
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=len(tokenizer)))
        self.max_model_len, self.vl, self.vocab = 4096, False, len(tokenizer)

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        pass

    def submit(self, req) -> None:
        self.prompts.append(self.tokenizer.decode(req.prompt, skip_special_tokens=False))
        text = self.reply
        for s in req.stop:
            text = text.split(s)[0]
        req.text = text
        for i in range(0, len(text), 3):
            req.emit(text[i : i + 3], None)
        req.emit("", self.finish)


@pytest.fixture
def serve():
    def make(reply: str, tokenizer=None, finish: str = "stop"):
        tok = tokenizer or default_tokenizer().with_thinking_template()
        engine = ScriptedEngine(tok, reply, finish)
        client = openai.OpenAI(
            base_url="http://testserver/v1",
            api_key="x",
            http_client=TestClient(build_app(OpenAIServer(engine, tok, "m"))),
        )
        return client, engine

    return make


def _ask(client, stream=False, **kw):
    kw = {"model": "m", "messages": [{"role": "user", "content": "What is 47*86?"}], "tools": [CALC], **kw}
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.finish_reason, c.message.content, (c.message.model_extra or {}).get("reasoning_content"), calls
    finish, content, reasoning, calls = None, "", "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        content += c.delta.content or ""
        reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
        for t in c.delta.tool_calls or []:
            i, n, a = calls.get(t.index, ("", "", ""))
            calls[t.index] = (t.id or i, n + (t.function.name or ""), a + (t.function.arguments or ""))
        finish = c.finish_reason or finish
    return finish, content or None, reasoning, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_reasoning_whole_and_streamed(serve, stream):
    client, engine = serve(TWO_CALLS)
    finish, content, reasoning, calls = _ask(client, stream)
    assert finish == "tool_calls" and content is None and reasoning == "Use it twice."
    assert [(n, json.loads(a)) for _, n, a in calls] == [
        ("calculator", {"expression": "47*86"}),
        ("calculator", {"expression": "1+2"}),
    ]
    assert all(i.startswith("call_") for i, _, _ in calls) and calls[0][0] != calls[1][0]
    assert "<tool_list>" in engine.prompts[0] and engine.prompts[0].endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_result_goes_back_and_the_answer_comes_out(serve, stream):
    client, engine = serve(ANSWER)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "47*86"}'},
    }
    msgs = [
        {"role": "user", "content": "What is 47*86?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4042"},
    ]
    finish, content, reasoning, calls = _ask(client, stream, messages=msgs)
    assert (finish, content, reasoning, calls) == ("stop", "4042", "Answer with the result.", [])
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*86"}}\n</tool_call>' in engine.prompts[0]
    )
    assert "<|im_start|>tool\n4042<|im_end|>" in engine.prompts[0]


def test_tool_choice_and_parallel_tool_calls(serve):
    client, engine = serve(TWO_CALLS)
    assert len(_ask(client, parallel_tool_calls=False)[3]) == 1  # the reply ends with its first call
    finish, content, _, calls = _ask(client, tool_choice="none")
    assert finish == "stop" and not calls and content.startswith("<tool_call>")  # no tools: a call stays text
    assert "<tool_list>" not in engine.prompts[-1]
    client, engine = serve('calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n')
    finish, _, _, calls = _ask(client, tool_choice="required")
    assert finish == "tool_calls" and calls[0][1:] == ("calculator", '{"expression": "2*3"}')
    assert engine.prompts[-1].endswith('<think>\n\n</think>\n\n<tool_call>\n{"name": "')  # the call is started for it
    client, engine = serve('{"expression": "2*3"}}\n</tool_call>\n')
    named = {"type": "function", "function": {"name": "calculator"}}
    assert _ask(client, tool_choice=named)[3][0][1:] == ("calculator", '{"expression": "2*3"}')
    assert engine.prompts[-1].endswith('<tool_call>\n{"name": "calculator", "arguments": ')


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_the_length_limit_is_a_call_with_the_arguments_written(serve, stream):
    client, _ = serve('calculator", "arguments": {"expression": "47*', finish="length")
    finish, content, _, calls = _ask(client, stream, tool_choice="required", max_tokens=9)
    assert (finish, content) == ("length", None)  # the forced '<tool_call>' is not answer text
    assert calls[0][1:] == ("calculator", '{"expression": "47*')  # as OpenAI: arguments as far as written
    client, _ = serve("calcu", finish="length")  # not even the name: nothing to call
    assert _ask(client, stream, tool_choice="required", max_tokens=2)[3] == []
    client, _ = serve('calculator", "arguments": {"expression": "47*')  # a stop, not a cut: not a call
    finish, content, _, calls = _ask(client, stream, tool_choice="required")
    assert finish == "stop" and calls == [] and content.startswith("<tool_call>")


def test_plain_replies_of_a_thinking_model_carry_reasoning(serve):
    client, _ = serve("hmm\n</think>\n\n<response>\nhello\n</response>\n")
    assert _ask(client, tools=[])[:3] == ("stop", "hello", "hmm")
    assert _ask(client, True, tools=[])[:3] == ("stop", "hello", "hmm")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "sometimes"}, "must be none, auto, required"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function name"),
        ({"tools": [CALC, CALC]}, "unique"),
        ({"tools": [], "tool_choice": "required"}, "needs tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": "{bad"}}],
                    },
                    {"role": "tool", "content": "1"},
                ]
            },
            "arguments is not JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
            "must follow an assistant message with tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_400s_that_say_why(serve, extra, message):
    client, engine = serve(ANSWER)
    with pytest.raises(openai.BadRequestError, match=message):
        _ask(client, **extra)
    assert engine.prompts == []


def test_a_model_without_the_thinking_format_refuses_tools_in_one_line(serve):
    client, engine = serve("plain", tokenizer=default_tokenizer())
    with pytest.raises(openai.BadRequestError, match="ERNIE thinking format"):
        _ask(client)
    assert (
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        .choices[0]
        .message.content
        == "plain"
    )
