"""The chat format of ERNIE-4.5 Thinking models: thinking blocks, tools, tool calls, tool results.

What the text looks like, and where each part comes from (docs/tools.md has the full account):
- `<|im_start|>ROLE\\n ... <|im_end|>\\n\\n` turns, a system turn that always carries
  `<global_setting>\\nthink_mode=True\\n</global_setting>`, a user system prompt inside
  `<system_setting>\\n...\\n</system_setting>\\n\\n`, and the generation prompt
  `<|im_start|>assistant\\n<think>\\n`: as ms-swift's, LLaMA-Factory's and Unsloth's renderings of
  baidu/ERNIE-4.5-21B-A3B-Thinking's template write them.
- What the assistant writes: `REASONING\\n</think>\\n\\n<response>\\nANSWER\\n</response>\\n` or
  `REASONING\\n</think>\\n\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n` (one
  block per call): the text FastDeploy's `ernie-x1` reasoning and tool-call parsers read.
- Tool results as `<|im_start|>tool\\n...<|im_end|>` turns (LLaMA-Factory's ERNIE observation
  format) and the tool list as JSON lines in `<tool_list>` inside the system turn: ours where the
  public sources we could read do not show the hub template's own choice. A checkpoint that ships
  its own template is always rendered with that one (tokenizer.apply_chat_template).

`ERNIE_THINKING_CHAT_TEMPLATE` is the jinja text written into tokenizer_config.json (what
transformers, FastDeploy and vLLM render); `render_thinking` is the same format in Python, the
fast path apply_chat_template takes for this exact template (tests hold the two equal).
"""

from __future__ import annotations

import json
from typing import Any

# Tags a thinking checkpoint's vocabulary holds as single tokens (FastDeploy looks up </think> and
# <tool_call> as ids); added to a tokenizer that lacks them (with_thinking_tokens).
THINKING_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<response>",
    "</response>",
    "<tool_call>",
    "</tool_call>",
)
END_OF_TURN = "<|im_end|>"

ERNIE_THINKING_CHAT_TEMPLATE = (
    "{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}\n"
    "{%- set ns = namespace(system='') -%}\n"
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if ns.system -%}{{- '<system_setting>\\n' + ns.system + '\\n</system_setting>\\n\\n' -}}{%- endif -%}\n"
    "{%- if tools -%}\n"
    "    {{- '<tool_list>\\n' -}}\n"
    "    {%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}\n"
    "    {{- '</tool_list>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '<global_setting>\\nthink_mode=' + ('True' if enable_thinking else 'False') -}}\n"
    "{{- '\\n</global_setting><|im_end|>\\n\\n' -}}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message.role == 'user' -%}\n"
    "        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n\\n' -}}\n"
    "    {%- elif message.role == 'tool' -%}\n"
    "        {{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n\\n' -}}\n"
    "    {%- elif message.role == 'assistant' -%}\n"
    "        {{- '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' -}}\n"
    "        {%- if message.content -%}{{- '<response>\\n' + message.content + '\\n</response>\\n' -}}{%- endif -%}\n"
    "        {%- for call in (message.tool_calls or []) -%}\n"
    "            {%- set fn = call.function if call.function is defined else call -%}\n"
    "            {{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}\n"
    "            {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}\n"
    "            {{- '}\\n</tool_call>\\n' -}}\n"
    "        {%- endfor -%}\n"
    "        {{- '<|im_end|>\\n\\n' -}}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n<think>\\n' -}}\n"
    "    {%- if not enable_thinking -%}{{- '\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}"
)


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tool_call(call: dict) -> str:
    """One `<tool_call>` block as the assistant writes it."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    args = args if isinstance(args, str) else _tojson(args)
    return '<tool_call>\n{"name": ' + _tojson(fn.get("name")) + ', "arguments": ' + args + "}\n</tool_call>\n"


def render_thinking(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """ERNIE_THINKING_CHAT_TEMPLATE in Python (same text, without a jinja round trip)."""
    out = ["<|im_start|>system\n"]
    system = messages[0].get("content") if messages and messages[0].get("role") == "system" else None
    if system:
        out.append(f"<system_setting>\n{system}\n</system_setting>\n\n")
    if tools:
        out.append("<tool_list>\n" + "".join(_tojson(t) + "\n" for t in tools) + "</tool_list>\n\n")
    out.append(
        f"<global_setting>\nthink_mode={'True' if enable_thinking else 'False'}\n</global_setting><|im_end|>\n\n"
    )
    for m in messages:
        role = m.get("role")
        if role in ("user", "tool"):
            out.append(f"<|im_start|>{role}\n{m['content']}<|im_end|>\n\n")
        elif role == "assistant":
            out.append(f"<|im_start|>assistant\n<think>\n{m.get('reasoning_content') or ''}\n</think>\n\n")
            if m.get("content"):
                out.append(f"<response>\n{m['content']}\n</response>\n")
            out.extend(render_tool_call(c) for c in m.get("tool_calls") or [])
            out.append("<|im_end|>\n\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n<think>\n" + ("" if enable_thinking else "\n</think>\n\n"))
    return "".join(out)
