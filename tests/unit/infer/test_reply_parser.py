"""The reply parser against hostile model output: a reply streamed in any pieces (split at every
position, or at random) parses as it does whole, in every mode; a call nested past what JSON can
decode is answer text, never an exception; a huge call or a flood of newlines streams in linear
time."""

from __future__ import annotations

import random
import time

import pytest

from erniekit.infer.reply_parser import ReplyParser, collect, parse_reply

PIECES = [
    "</think>",
    "<response>",
    "</response>",
    "<tool_call>",
    "</tool_call>",
    "\n",
    "{",
    "}",
    '"name"',
    ":",
    "x",
    " ",
    ",",
    '"',
    '"arguments"',
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "arguments": {"a": "',
]
MODES = [(t, a, c) for t in (True, False) for a in (True, False) for c in (False, True)]


def _parse(pieces: list[str], thinking_open: bool, tools_allowed: bool, cut: bool):
    p = ReplyParser(thinking_open, tools_allowed)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish(cut)
    r = collect(events)
    return r.reasoning, r.content, [c["function"] for c in r.tool_calls]


@pytest.mark.parametrize("thinking_open, tools_allowed, cut", MODES)
def test_streamed_in_any_pieces_equals_whole(thinking_open, tools_allowed, cut):
    rng = random.Random(f"{thinking_open}{tools_allowed}{cut}")
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 16)))
        whole = _parse([text], thinking_open, tools_allowed, cut)
        for k in range(len(text) + 1):  # one split at every position
            assert _parse([text[:k], text[k:]], thinking_open, tools_allowed, cut) == whole, (text, k)
        bounds = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)])]
        assert _parse(pieces, thinking_open, tools_allowed, cut) == whole, (text, bounds)
        assert _parse(list(text), thinking_open, tools_allowed, cut) == whole, text  # a character at a time


def test_a_call_nested_past_the_decoder_is_text_not_an_exception():
    for args in ("[" * 100_000 + "]" * 100_000, '"' + "[" * 100_000 + '"', '{"a": ' + "{" * 100_000):
        text = f'r\n</think>\n\n<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>\n'
        got = parse_reply(text)
        assert got.tool_calls == [] and got.content.startswith("<tool_call>")
        assert _parse([text[i : i + 4096] for i in range(0, len(text), 4096)], True, True, False)[1] == got.content


def test_a_huge_call_and_a_flood_of_newlines_stream_in_linear_time():
    p, start = ReplyParser(), time.perf_counter()
    p.feed('r</think><tool_call>{"name": "f", "arguments": {"a": "')
    for _ in range(100_000):  # 800 KB of arguments: rescanning them per piece took ~15 s
        assert p.feed("xxxxxxxx") == []
    (kind, call), *_ = p.feed('"}}</tool_call>')
    assert kind == "tool_call" and len(call["function"]["arguments"]) > 800_000
    for _ in range(50_000):  # newlines between blocks: re-stripped per piece they took ~5 s
        assert p.feed("\n") == []
    assert time.perf_counter() - start < 5.0
