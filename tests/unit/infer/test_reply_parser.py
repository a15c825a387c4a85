"""The reply parser against hostile model output: a reply streamed in any pieces (split at every
position, or at random) parses as it does whole, in every mode; a call nested past what JSON can
decode is answer text, never an exception; a huge call or a flood of newlines streams in linear
time."""

from __future__ import annotations

import json
import random

import pytest

from erniekit.infer.reply_parser import CALL_END, ReplyParser, collect, parse_reply

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
    """Each piece costs its own length: the open call's text is not re-copied or re-searched per
    piece (800 KB of arguments took ~15 s that way), nor are newlines between blocks re-stripped."""
    p = ReplyParser()
    p.feed('r</think><tool_call>{"name": "f", "arguments": {"a": "')
    for _ in range(100_000):
        assert p.feed("xxxxxxxx") == [] and p.buf == ""  # nothing held that a later piece re-copies
    (kind, call), *_ = p.feed('"}}</tool_call>')
    assert kind == "tool_call" and len(call["function"]["arguments"]) > 800_000
    for _ in range(50_000):
        assert p.feed("\n") == [] and p.buf == "" and p.parts == []


@pytest.mark.parametrize("cut", range(1, len(CALL_END)))
def test_the_end_tag_split_across_pieces_still_closes_the_call(cut):
    p = ReplyParser(thinking_open=False)
    events = p.feed("<tool_call>")
    for piece in ('{"name": "f", "argu', 'ments": {"a": 1}}\n', CALL_END[:cut], CALL_END[cut:], "\ntail"):
        events += p.feed(piece)
    events += p.finish()
    assert [k for k, _ in events] == ["tool_call", "content"] and events[1][1] == "tail"
    assert json.loads(events[0][1]["function"]["arguments"]) == {"a": 1}
