"""Held-out tool use, measured as an agent would run: the model's first reply is parsed for tool
calls (tool-call exact match), the calls are executed, their results fed back, and the final
answer compared with the reference (final-answer accuracy)."""

from __future__ import annotations

import json
from typing import Callable

from erniekit.data.formats import Conversation
from erniekit.data.synthetic_tools import calculate
from erniekit.infer.chat import chat_prompt_ids
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.reply_parser import ParsedReply, parse_reply
from erniekit.infer.stops import decodable_vocab, turn_end_ids

# Tools the evaluation can run itself; other tools get the reference result when the call matches it.
BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": lambda expression="": calculate(str(expression))}


def _calls(reply: ParsedReply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def _reference(conv: Conversation) -> tuple[list[dict], list[tuple[str, dict]], list[str], str]:
    """(prompt messages, reference calls of the first reply, reference tool results, final answer)."""
    dialog = conv.dialog or []
    first = next(k for k, m in enumerate(dialog) if m["role"] == "assistant")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in dialog[first].get("tool_calls") or []]
    results = [m["content"] for m in dialog[first + 1 :] if m["role"] == "tool"][: len(calls)]
    return dialog[:first], calls, results, dialog[-1].get("content") or ""


def _run_tool(name: str, args: dict, expected: dict[tuple, str]) -> str:
    if name in BUILTIN_TOOLS:
        try:
            return BUILTIN_TOOLS[name](**args)
        except (TypeError, ValueError) as e:  # a bad call: the tool's error is its result, as an agent sees it
            return f"error: {e}"
    return expected.get((name, json.dumps(args, sort_keys=True)), "error: unknown call")


def tool_eval(model, tokenizer, convs: list[Conversation], batch_size: int, max_new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=turn_end_ids(tokenizer))
    thinking, vocab = tokenizer.thinking, decodable_vocab(model, tokenizer)
    refs = [_reference(c) for c in convs]

    def replies(histories: list[list[dict]], tools: list[list[dict]]) -> list[ParsedReply]:
        out = []
        for i in range(0, len(histories), batch_size):
            prompts = [
                chat_prompt_ids(tokenizer, h, t or None)
                for h, t in zip(histories[i : i + batch_size], tools[i : i + batch_size])
            ]
            for ids in generate(model, prompts, params, pad_id=tokenizer.pad_token_id, vocab=vocab):
                out.append(parse_reply(tokenizer.decode(ids), thinking))
        return out

    tools = [c.tools for c in convs]
    first = replies([r[0] for r in refs], tools)
    call_hits = sum(_calls(rep) == ref[1] for rep, ref in zip(first, refs))
    # round two for the replies that called tools: run the calls, feed the results back
    again = [k for k, rep in enumerate(first) if rep.tool_calls]
    histories = []
    for k in again:
        prompt, ref_calls, results, _ = refs[k]
        expected = {(n, json.dumps(a, sort_keys=True)): r for (n, a), r in zip(ref_calls, results)}
        call_msg = {
            "role": "assistant",
            "content": None,
            "reasoning_content": first[k].reasoning or "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in _calls(first[k])],
        }
        tool_msgs = [{"role": "tool", "content": _run_tool(n, a, expected)} for n, a in _calls(first[k])]
        histories.append(prompt + [call_msg] + tool_msgs)
    finals = {k: rep.content for k, rep in enumerate(first) if not rep.tool_calls}
    finals.update({k: rep.content for k, rep in zip(again, replies(histories, [tools[k] for k in again]))})
    answer_hits = sum(finals[k].strip() == ref[3].strip() for k, ref in enumerate(refs))
    n = max(len(convs), 1)
    return {"tool_call_match": call_hits / n, "final_answer_accuracy": answer_hits / n}
