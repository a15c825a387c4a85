"""The ERNIE thinking chat format: the Python renderer equals the jinja template (ours, and as
transformers renders it) text for text and id for id on many message shapes; what the template
renders for the assistant parses back unchanged, streamed or whole; malformed replies come back as
answer text without raising."""

from __future__ import annotations

import json
import random

import pytest

from erniekit.infer.reply_parser import ReplyParser, collect, parse_reply
from erniekit.models.ernie4_5.thinking_template import ERNIE_THINKING_CHAT_TEMPLATE, render_thinking
from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer, _compile, default_tokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate 'a op b' — 中文 too",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


SHAPES = [
    ([{"role": "user", "content": "hi"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], None),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r\nr2"}], None),
    (
        [
            {"role": "user", "content": "12*13?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("calculator", expression="12*13")]},
        ],
        [CALC],
    ),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "天气 and 2+2"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "two tools",
                "tool_calls": [_call("get_weather"), _call("calculator", expression="2+2")],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "21 degrees; 4", "reasoning_content": "done"},
            {"role": "user", "content": "thanks"},
        ],
        [WEATHER, CALC],
    ),
    (
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1-1"}'}}
                ],
            },
        ],
        [CALC],
    ),
    ([{"role": "user", "content": "  spaces \n\n and lines  "}, {"role": "assistant", "content": "\nedge\n"}], []),
]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer().with_thinking_template()


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_python_renderer_equals_the_jinja_template(tok, shape, generation, thinking):
    msgs, tools = SHAPES[shape]
    ours = render_thinking(msgs, tools, generation, thinking)
    jinja = _compile(ERNIE_THINKING_CHAT_TEMPLATE).render(
        messages=msgs, tools=tools, add_generation_prompt=generation, enable_thinking=thinking
    )
    assert ours == jinja
    assert tok.encode(ours) == tok.encode(jinja)


def test_transformers_renders_the_saved_template_to_the_same_ids(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save_pretrained(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for msgs, tools in SHAPES:
        for generation in (True, False):
            text = theirs.apply_chat_template(msgs, tools=tools, add_generation_prompt=generation, tokenize=False)
            assert text == tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=generation)
            assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text)


def test_a_checkpoints_own_template_wins(tmp_path):
    base = default_tokenizer().with_thinking_template()
    own = (
        "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    )
    base.chat_template = own
    base.save_pretrained(str(tmp_path))
    loaded = ErnieTokenizer.from_pretrained(str(tmp_path))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<user|hi>>GO"
    assert not loaded.thinking  # its generation prompt opens no thinking block


def _reply_text(msgs, tools):
    """What the assistant writes for the last message: the template's text between the generation
    prompt and <|im_end|>."""
    prompt = render_thinking(msgs[:-1], tools, True)
    full = render_thinking(msgs, tools, False)
    assert full.startswith(prompt)
    return full[len(prompt) :].split("<|im_end|>")[0]


def _expected(message):
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    calls = [(n, json.loads(a) if isinstance(a, str) else a) for n, a in calls]
    return message.get("reasoning_content") or None, message.get("content") or "", calls


@pytest.mark.parametrize("shape", [k for k, (m, _) in enumerate(SHAPES) if m[-1]["role"] == "assistant"])
def test_rendered_replies_parse_back_unchanged_whole_and_streamed(shape):
    msgs, tools = SHAPES[shape]
    text = _reply_text(msgs, tools)
    whole = parse_reply(text)
    got = (
        whole.reasoning,
        whole.content,
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls],
    )
    assert got == _expected(msgs[-1])
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole.tool_calls)
    rng = random.Random(shape)
    for _ in range(20):  # the same events whatever the pieces the text arrives in
        p, events, i = ReplyParser(), [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            events += p.feed(text[i:j])
            i = j
        streamed = collect(events + p.finish())
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
        assert [c["function"] for c in streamed.tool_calls] == [c["function"] for c in whole.tool_calls]


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        ("just text, no tags", "just text, no tags", "", 0),  # cut off while thinking: all reasoning (as ernie-x1)
        ("r\n</think>\n\nplain answer", "r", "plain answer", 0),  # no <response>: the text is the answer
        ("r\n</think>\n\n<response>\nunclosed", "r", "unclosed", 0),
        ('r\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {bad json}\n</tool_call>\n', "r", None, 0),
        ('r\n</think>\n\n<tool_call>\n{"arguments": {}}\n</tool_call>\n', "r", None, 0),  # no name
        ('r\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>\n', "r", None, 0),
        ('r\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}', "r", "", 1),  # cut before </tool_call>
        ('r\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n', "r", "", 1),
        ("</think></think><response></response>", None, "</think><response></response>", 0),
        ("\x00\ufffd<tool_call></response>", "\x00\ufffd<tool_call></response>", "", 0),
    ],
)
def test_malformed_replies_come_back_as_text_without_raising(text, reasoning, content, calls):
    got = parse_reply(text)
    assert got.reasoning == reasoning
    assert len(got.tool_calls) == calls
    if content is None:  # a broken call: the model's text is the answer, nothing is lost
        assert got.content.startswith("<tool_call>") and got.content.strip().endswith("</tool_call>")
    else:
        assert got.content == content


def test_tool_calls_stay_text_when_tools_are_not_allowed():
    text = 'r\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>\n'
    got = parse_reply(text, tools_allowed=False)
    assert got.tool_calls == [] and got.content.startswith("<tool_call>")
