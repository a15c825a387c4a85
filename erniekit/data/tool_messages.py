"""Tools, tool calls, tool results and reasoning in OpenAI-style messages: checked and normalised once,
for training data, the server and chat alike.

Normal form: tools are `{"type": "function", "function": {"name", "description"?, "parameters"?}}`;
an assistant message has `content` (str or None), optional `reasoning_content` and optional
`tool_calls` `[{"id"?, "type": "function", "function": {"name", "arguments": dict}}]`; a tool
message has a string `content` (JSON results are written as JSON text). ERNIEKit's function-call
data (reasoning inline as `<think>...</think>` before the answer, arguments and results as JSON
objects) and the ERNIE-Bot `function` role normalise to the same form.
"""

from __future__ import annotations

import json
import re

from erniekit.errors import DataError
from erniekit.utils.io import json_problem

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _json(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def check_tools(tools: object, where: str, field: str = "tools") -> list[dict]:
    """The tool list in normal form; a bad schema is a one-line DataError naming `where` and the field."""
    if tools is None:
        return []
    if isinstance(tools, str):  # ShareGPT / LLaMA-Factory keep the list as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else []
        except (ValueError, RecursionError) as e:  # not JSON, too deep, or a huge integer
            raise DataError(
                f"{where}: field '{field}' is a string but not JSON ({json_problem(e)}); write a list of tools"
            ) from None
    if not isinstance(tools, list):
        raise DataError(f"{where}: field '{field}' must be a list of {{'type': 'function', 'function': {{...}}}}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"{where}: {field}[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) and "function" in tool else tool
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise DataError(f"{at}.type={tool.get('type')!r}: only 'function' tools exist")
        if not isinstance(fn, dict):
            raise DataError(f"{at} must be {{'type': 'function', 'function': {{'name': str, 'parameters': {{...}}}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise DataError(f"{at}: function name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if name in seen:
            raise DataError(f"{at}: a second tool named {name!r}; tool names must be unique")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise DataError(f"{at}: description of {name!r} must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise DataError(f"{at}: parameters of {name!r} must be a JSON schema object {{'type': 'object', ...}}")
            props = params.get("properties", {})
            required = params.get("required", [])
            if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
                raise DataError(f"{at}: parameters.properties of {name!r} must map names to schemas")
            if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
                raise DataError(f"{at}: parameters.required of {name!r} must list names from its properties")
        out.append(
            {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}
        )
    return out


def check_tool_calls(calls: object, where: str, names: set[str] | None) -> list[dict]:
    """An assistant's tool calls in normal form (arguments parsed from JSON text to an object)."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}: tool_calls must be a non-empty list of {{'type': 'function', 'function': {{...}}}}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(f"{at} must be {{'type': 'function', 'function': {{'name': str, 'arguments': ...}}}}")
        name = fn["name"]
        if names is not None and name not in names:
            raise DataError(f"{at} calls {name!r}, which is not among the tools ({', '.join(sorted(names)) or 'none'})")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:  # not JSON, too deep, or a huge integer
                raise DataError(f"{at}.function.arguments is not JSON ({json_problem(e)}): {args[:60]!r}") from None
        if not isinstance(args, dict):
            raise DataError(f"{at}.function.arguments must be a JSON object, got {type(args).__name__}")
        norm = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            if any(c.get("id") == call["id"] for c in out):
                raise DataError(f"{at}.id {call['id']!r} is the id of an earlier call too; give each call its own id")
            norm = {"id": call["id"], **norm}
        out.append(norm)
    return out


def _answer(open_calls: list[dict], m: dict, at: str) -> None:
    """Take the call a tool message answers off `open_calls` (the one its tool_call_id names, else the
    first), or a one-line DataError when it answers none."""
    if not open_calls:
        raise DataError(
            f"{at}: a tool result that answers no call (the calls before it all have their results); "
            "give one tool message per tool call"
        )
    tid = m.get("tool_call_id")
    ids = [c["id"] for c in open_calls if "id" in c]
    if isinstance(tid, str) and ids:
        if tid not in ids:
            raise DataError(f"{at}.tool_call_id {tid!r} names no unanswered call (open: {', '.join(ids)})")
        open_calls.remove(next(c for c in open_calls if c.get("id") == tid))
    else:
        open_calls.pop(0)


def _check_answered(open_calls: list[dict], at: str) -> None:
    if open_calls:
        names = ", ".join(c["function"]["name"] for c in open_calls)
        raise DataError(
            f"{at}: {len(open_calls)} tool call(s) before it have no result ({names}); "
            "put a tool message for each call right after the assistant message that makes it"
        )


def split_think(content: str) -> tuple[str | None, str]:
    """`<think>\\nR\\n</think>\\n\\nA` (reasoning inline, as ERNIEKit's thinking data writes it) -> (R, A)."""
    end = content.find("</think>")
    if end < 0:
        return None, content
    head = content[:end]
    start = head.find("<think>")
    if start >= 0:
        if head[:start].strip():
            return None, content  # text before <think>: not a leading thinking block
        head = head[start + len("<think>") :]
    return head.removeprefix("\n").removesuffix("\n"), content[end + len("</think>") :].lstrip("\n")


def is_tool_dialog(messages: list, tools: object = None) -> bool:
    """Whether messages need the tool-aware reader (tools, tool results, tool calls, reasoning)."""
    if tools:
        return True
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role") in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            return True
        if m.get("reasoning_content") is not None:
            return True
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and "</think>" in m["content"]:
            return True
    return False


def normalize_dialog(messages: list, where: str, tools: list[dict], end: str = "assistant") -> list[dict]:
    """Check and normalise a message list with tools; `end` = "assistant" (training data: it ends with a
    reply) or "prompt" (a request: it ends with a user or tool message)."""
    names = {t["function"]["name"] for t in tools} if tools else None
    out: list[dict] = []
    open_calls: list[dict] = []  # calls of the last assistant message still without a result
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object {{'role', 'content'}}")
        role = "tool" if m.get("role") == "function" else m.get("role")
        content = m.get("content")
        prev = out[-1]["role"] if out else None
        if role == "system":
            if out:
                raise DataError(f"{at}: a system message goes first, once")
            if not isinstance(content, str):
                raise DataError(f"{at}.content must be a string")
            out.append({"role": "system", "content": content})
        elif role == "user":
            if not isinstance(content, str):
                raise DataError(f"{at}.content must be a string (or text/image parts)")
            if prev == "user":
                raise DataError(f"{at}: two user messages in a row; merge them or put the reply between")
            _check_answered(open_calls, at)
            out.append({"role": "user", "content": content})
        elif role == "assistant":
            if prev not in ("user", "tool"):
                raise DataError(
                    f"{at}: an assistant message must follow a user or tool message, not {prev or 'nothing'}"
                )
            _check_answered(open_calls, at)
            calls = m.get("tool_calls")
            if calls is None and m.get("function_call") is not None:  # ERNIE-Bot / old OpenAI single call
                calls = [{"type": "function", "function": m["function_call"]}]
            if content is not None and not isinstance(content, str):
                raise DataError(f"{at}.content must be a string or null")
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise DataError(f"{at}.reasoning_content must be a string")
            if reasoning is None and content:
                reasoning, content = split_think(content)
            msg: dict = {"role": "assistant", "content": content or None}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = check_tool_calls(calls, at, names)
                open_calls = list(msg["tool_calls"])
                if content and content.strip():
                    raise DataError(
                        f"{at}: text next to tool_calls ({content[:40]!r}); the ERNIE thinking format writes either an "
                        "answer or tool calls after the reasoning: move the text into reasoning_content"
                    )
            elif not content:
                raise DataError(f"{at}: an assistant message needs content or tool_calls")
            out.append(msg)
        elif role == "tool":
            if prev not in ("assistant", "tool") or (prev == "assistant" and not out[-1].get("tool_calls")):
                raise DataError(f"{at}: a tool result must follow an assistant message with tool_calls")
            if content is None:
                raise DataError(f"{at}.content is missing: the tool's result")
            _answer(open_calls, m, at)
            msg = {"role": "tool", "content": _json(content)}
            if isinstance(m.get("tool_call_id"), str):
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        else:
            raise DataError(f"{at}.role={m.get('role')!r} must be system, user, assistant or tool")
    last = out[-1]["role"] if out else None
    if end == "assistant" and last != "assistant":
        raise DataError(f"{where}: messages must end with an assistant message (the reply trained on)")
    if end == "prompt" and last not in ("user", "tool"):
        raise DataError(f"{where}: messages must end with a user or tool message")
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{where}: messages need at least one user message")
    return out
