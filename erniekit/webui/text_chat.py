"""The Chat tab's text replies, streamed as they are generated. A checkpoint in the thinking
format (tokenizer.thinking) writes its reasoning before `</think>`: the page shows it as a
collapsible "Thinking" message apart from the answer (not as raw tags), and the next turn's prompt
gives it back as the assistant's `reasoning_content`, so the history renders as it was trained."""

from __future__ import annotations

from typing import Iterator

from erniekit.infer.chat import chat_prompt_ids
from erniekit.infer.generate import generate_stream
from erniekit.infer.reply_parser import ReplyParser, collect, parse_reply
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.stops import decodable_vocab

THOUGHT = "Thinking"  # the title of a gradio Chatbot "thought" message


def message_text(content) -> str:
    """A chatbot message's content as text (gradio may hand back a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def _is_thought(m: dict) -> bool:
    return m.get("role") == "assistant" and (m.get("metadata") or {}).get("title") == THOUGHT


def prompt_messages(history: list[dict]) -> list[dict]:
    """The Chatbot's messages as chat messages: a thought becomes the `reasoning_content` of the
    assistant message after it."""
    msgs, reasoning = [], None
    for m in history:
        if _is_thought(m):
            reasoning = message_text(m["content"])
            continue
        msg = {"role": m["role"], "content": message_text(m["content"])}
        if m["role"] == "assistant" and reasoning is not None:
            msg["reasoning_content"] = reasoning
        reasoning = None
        msgs.append(msg)
    return msgs


def shown_reply(text: str, thinking: bool, final: bool) -> list[dict]:
    """The assistant's Chatbot messages for the reply text so far (a tag cut in half at the end
    of a streamed piece is held back until it is whole)."""
    if not thinking:
        return [{"role": "assistant", "content": text}]
    reply = parse_reply(text, tools_allowed=False) if final else collect(ReplyParser(tools_allowed=False).feed(text))
    out = []
    if reply.reasoning is not None:
        out.append({"role": "assistant", "content": reply.reasoning, "metadata": {"title": THOUGHT}})
    out.append({"role": "assistant", "content": reply.content})
    return out


def text_reply(model, tokenizer, history: list[dict], text: str, params: SamplingParams) -> Iterator[list[dict]]:
    """The Chatbot history after each generated token, then once more when the reply ends."""
    ids = chat_prompt_ids(tokenizer, prompt_messages(history) + [{"role": "user", "content": text}])
    base = list(history) + [{"role": "user", "content": text}]
    thinking = bool(getattr(tokenizer, "thinking", False))
    stops, new = set(params.stop_token_ids or []), []
    vocab = decodable_vocab(model, tokenizer)
    for step in generate_stream(model, [ids], params, pad_id=tokenizer.pad_token_id or 0, vocab=vocab):
        t = int(step[0])
        if t < 0 or t in stops:
            break
        new.append(t)
        yield base + shown_reply(tokenizer.decode(new).rstrip("\ufffd"), thinking, final=False)
    yield base + shown_reply(tokenizer.decode(new), thinking, final=True)
