"""Split what an ERNIE-4.5 Thinking model writes into reasoning, answer and tool calls.

The model writes `REASONING\\n</think>\\n\\n` and then `<response>\\nANSWER\\n</response>\\n` or
one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n` blocks (the text
FastDeploy's `ernie-x1` reasoning and tool-call parsers read; our own code). One state machine
serves streaming (`ReplyParser.feed` per decoded piece) and whole replies (`parse_reply`), so a
streamed reply and the same reply returned whole always agree.

Where we differ from FastDeploy, on purpose: the newlines the template puts next to the tags
(before `</think>`, after `<response>`, before `</response>`) are dropped, so a rendered message
parses back to the same reasoning and answer; text after `</think>` that is neither a response nor
a tool call comes back as the answer (FastDeploy drops it); a tool call that is not valid JSON
with a name and an object of arguments comes back as answer text, never as a broken call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_END = "</think>"
RESPONSE_START, RESPONSE_END = "<response>", "</response>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_call(text: str) -> dict | None:
    """`{"name": ..., "arguments": {...}}` -> an OpenAI tool call (arguments as a JSON string);
    None when it is not one."""
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # arguments written as a JSON string
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        arguments = json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested past what the decoder can hold
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', re.S)
_CUT_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*', re.S)


def cut_tool_call(text: str) -> dict | None:
    """A call the length limit cut off (`{"name": "f", "arguments": {"city": "Pa`) -> a tool call
    with the arguments as far as they were written (OpenAI's answer with finish_reason length);
    None when not even the name was complete."""
    m = _CUT_NAME.match(text)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not name:
        return None
    rest = text[m.end() :]
    args = _CUT_ARGS.match(rest)
    partial = rest[args.end() :] if args else ""
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": partial}}


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `tag` (kept back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReplyParser:
    """Feed decoded text as it comes; get ("reasoning" | "content", text) and ("tool_call", call)
    events. `thinking_open`: the prompt ended inside a thinking block (the generation prompt
    `<think>\\n`), so the reply starts with reasoning."""

    thinking_open: bool = True
    tools_allowed: bool = True  # False (tool_choice none): a <tool_call> the model writes stays answer text
    state: str = field(init=False)
    buf: str = field(init=False, default="")  # text not consumed yet; in a call, only what came since the last feed
    parts: list[str] = field(init=False, default_factory=list)  # an open call's text searched already, joined once

    def __post_init__(self) -> None:
        self.state = "think" if self.thinking_open else "after"

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text  # short: an open call's text moves to `parts`, so nothing long is re-copied per piece
        events: list[tuple[str, object]] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self, cut: bool = False) -> list[tuple[str, object]]:
        """The events still held back. `cut`: the reply ended at the length limit, so a tool call
        still open is a call cut short (arguments as written), not answer text."""
        events: list[tuple[str, object]] = []
        if cut and self.state == "call" and CALL_END not in self._call_tail() + self.buf:
            call = cut_tool_call("".join(self.parts) + self.buf)
            if call is not None:
                self.buf, self.parts, self.state = "", [], "after"
                return [("tool_call", call)]
        while self._step(events, final=True):
            pass
        return events

    def _call_tail(self) -> str:
        """The last characters of the open call's searched text that could start </tool_call>."""
        tail, need = "", len(CALL_END) - 1
        for part in reversed(self.parts):
            tail = part[-(need - len(tail)) :] + tail
            if len(tail) >= need:
                break
        return tail

    def _emit(self, events: list, kind: str, text: str) -> None:
        if text:
            if events and events[-1][0] == kind and kind != "tool_call":
                events[-1] = (kind, events[-1][1] + text)
            else:
                events.append((kind, text))

    def _until(self, events: list, kind: str, end_tag: str, final: bool) -> bool:
        """Reasoning up to </think>, an answer up to </response>: emit the text before the tag
        (without the newline the template puts before it) and go on after it; without the tag,
        emit what cannot be the start of it (all of it at the end)."""
        buf = self.buf
        end = buf.find(end_tag)
        if end >= 0:
            self._emit(events, kind, buf[:end].removesuffix("\n"))
            self.buf, self.state = buf[end + len(end_tag) :], "after"
            return True
        keep = 0 if final else max(_held(buf, "\n" + end_tag), _held(buf, end_tag))
        body = buf[: len(buf) - keep]
        self._emit(events, kind, body.removesuffix("\n") if final else body)
        self.buf = buf[len(buf) - keep :] if keep else ""
        return False

    def _step(self, events: list, final: bool) -> bool:
        """Consume what can be decided from the buffer; True when the state changed (go again)."""
        buf, state = self.buf, self.state
        if state == "think":
            return self._until(events, "reasoning", THINK_END, final)
        if state == "after":
            rest = buf.lstrip("\n")
            tags = (
                ((RESPONSE_START, "response"), (CALL_START, "call"))
                if self.tools_allowed
                else ((RESPONSE_START, "response"),)
            )
            for tag, nxt in tags:
                if rest.startswith(tag):
                    rest = rest[len(tag) :]
                    self.buf, self.state = rest.removeprefix("\n") if nxt == "response" else rest, nxt
                    self.parts = []
                    if nxt == "response" and rest == "" and not final:
                        self.state = "response_nl"  # the newline after <response> may still come
                    return True
            undecided = rest == "" or any(tag.startswith(rest) for tag, _ in tags)
            if undecided and not final:
                self.buf = rest  # newlines between blocks are dropped now, not rescanned with every piece
                return False
            self.buf, self.state = rest, "raw"
            return bool(rest)
        if state == "response_nl":
            if buf == "" and not final:
                return False
            self.buf, self.state = buf.removeprefix("\n"), "response"
            return True
        if state == "response":
            return self._until(events, "content", RESPONSE_END, final)
        if state == "call":
            tail = self._call_tail()  # </tool_call> may straddle what was searched and the new text
            end = (tail + buf).find(CALL_END)
            if end < 0 and not final:
                if buf:
                    self.parts.append(buf)
                self.buf = ""
                return False
            text = "".join(self.parts) + buf
            end = -1 if end < 0 else len(text) - len(tail) - len(buf) + end
            self.parts = []
            body = text if end < 0 else text[:end]
            call = parse_tool_call(body.strip())
            if call is None:  # not a tool call: what the model wrote is the answer
                self._emit(events, "content", CALL_START + text)
                self.buf, self.state = "", "raw"
                return False
            events.append(("tool_call", call))
            self.buf, self.state = ("" if end < 0 else text[end + len(CALL_END) :]), "after"
            return end >= 0
        # raw: plain answer text
        self._emit(events, "content", buf)
        self.buf = ""
        return False


@dataclass
class ParsedReply:
    reasoning: str | None
    content: str
    tool_calls: list[dict]


def collect(events: list[tuple[str, object]]) -> ParsedReply:
    reasoning = "".join(str(t) for k, t in events if k == "reasoning")
    content = "".join(str(t) for k, t in events if k == "content")
    calls = [c for k, c in events if k == "tool_call"]
    return ParsedReply(reasoning if any(k == "reasoning" for k, _ in events) else None, content, calls)  # type: ignore[arg-type]


def parse_reply(text: str, thinking_open: bool = True, tools_allowed: bool = True) -> ParsedReply:
    """A whole reply -> reasoning, answer and tool calls (what streaming it would give)."""
    p = ReplyParser(thinking_open, tools_allowed)
    return collect(p.feed(text) + p.finish())
