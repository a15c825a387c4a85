"""`erniekit chat` with a thinking-format model: reasoning shown apart from the answer, tool calls
printed, and with --tools a local function called in a loop until the model answers; the tool
schemas `--tools` builds from a Python file; FastDeploy's parser flags for such a checkpoint."""

from __future__ import annotations

import io
import json

import pytest

from erniekit.errors import ConfigError
from erniekit.infer.chat import ChatSession
from erniekit.infer.local_tools import call_tool, load_tools, tool_schema
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.server import fastdeploy_parser_flags
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

TOOLS_PY = '''
def calculator(expression: str) -> str:
    """Evaluate 'a op b'.

    More text."""
    a, b = expression.split("*")
    return str(int(a) * int(b))


def lookup(key: str, limit: int = 3, exact: bool = False, tags: list = None):
    return {"key": key, "limit": limit}


def _private():
    pass
'''


def test_tool_schemas_from_a_python_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS_PY)
    tools, funcs = load_tools(str(path))
    assert sorted(funcs) == ["calculator", "lookup"]
    calc = next(t for t in tools if t["function"]["name"] == "calculator")["function"]
    assert calc["description"] == "Evaluate 'a op b'."
    assert calc["parameters"] == {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }
    look = tool_schema("lookup", funcs["lookup"])["function"]["parameters"]
    assert look["properties"] == {
        "key": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
        "tags": {"type": "array"},
    }
    assert look["required"] == ["key"]
    assert call_tool(funcs, "calculator", '{"expression": "6*7"}') == "42"
    assert json.loads(call_tool(funcs, "lookup", {"key": "k"})) == {"key": "k", "limit": 3}
    assert call_tool(funcs, "calculator", '{"expression": "x"}').startswith("error: ValueError")
    assert call_tool(funcs, "nope", "{}") == "error: no tool named 'nope'"
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match="defines no public functions"):
        load_tools(str(tmp_path / "empty.py"))
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="importing it failed \\(RuntimeError: boom\\)"):
        load_tools(str(tmp_path / "broken.py"))


class ScriptedSession(ChatSession):
    """A chat session whose model writes scripted replies (the generation itself is tested elsewhere)."""

    def __init__(self, replies, **kw):
        self.replies, self.prompts = list(replies), []
        super().__init__(None, default_tokenizer().with_thinking_template(), SamplingParams(max_new_tokens=8), **kw)

    def _generate(self, on_text):
        self.prompts.append(self.tokenizer.decode(self.prompt_ids(), skip_special_tokens=False))
        text = self.replies.pop(0)
        for i in range(0, len(text), 3):  # streamed in pieces
            (on_text or self._write)(text[i : i + 3])
        return text


def test_chat_shows_reasoning_apart_and_runs_local_tools_in_a_loop(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS_PY)
    tools, funcs = load_tools(str(path))
    out = io.StringIO()
    session = ScriptedSession(
        [
            'need it\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n',
            "got it\n</think>\n\n<response>\n42\n</response>\n",
        ],
        out=out,
        tools=tools,
        functions=funcs,
    )
    assert session.reply("What is 6*7?") == "42"
    shown = out.getvalue()
    assert "[thinking] need it\n" in shown and '[tool call] calculator({"expression": "6*7"})' in shown
    assert "[tool result] 42" in shown and shown.rstrip().endswith("42") and "</think>" not in shown
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}
    # the second reply was generated from a prompt holding the call and its result
    assert "<|im_start|>tool\n42<|im_end|>" in session.prompts[1] and "<tool_list>" in session.prompts[1]


def test_chat_without_tool_functions_prints_the_call_and_stops():
    out = io.StringIO()
    session = ScriptedSession(['\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'], out=out)
    assert session.reply("hi") == ""
    assert "[tool call] f({})" in out.getvalue() and len(session.messages) == 2


def test_fastdeploy_gets_the_ernie_x1_parsers_for_a_thinking_checkpoint(tmp_path):
    thinking, plain = tmp_path / "t", tmp_path / "p"
    default_tokenizer().with_thinking_template().save_pretrained(str(thinking))
    default_tokenizer().save_pretrained(str(plain))
    for d, model_type in ((thinking, "ernie4_5_moe"), (plain, "ernie4_5")):
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert fastdeploy_parser_flags(str(thinking)) == [
        "--reasoning-parser",
        "ernie-x1",
        "--tool-call-parser",
        "ernie-x1",
    ]
    assert fastdeploy_parser_flags(str(plain)) == []
    (thinking / "config.json").write_text(json.dumps({"model_type": "ernie4_5_moe_vl"}))
    assert fastdeploy_parser_flags(str(thinking))[1] == "ernie-45-vl-thinking"
