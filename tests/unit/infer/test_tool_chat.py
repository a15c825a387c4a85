"""`erniekit chat` with a thinking-format model: reasoning shown apart from the answer, tool calls
printed, and with --tools a local function called in a loop until the model answers; the tool
schemas `--tools` builds from a Python file; FastDeploy's parser flags for such a checkpoint."""

from __future__ import annotations

import io
import json

import pytest

from erniekit.errors import CheckpointError, ConfigError
from erniekit.infer.chat import MAX_CALLS_PER_REPLY, ChatSession
from erniekit.infer.local_tools import MAX_RESULT_CHARS, call_tool, load_tools, tool_schema
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
    assert call_tool(funcs, "nope", "{}") == "error: no tool named 'nope'; the tools are calculator, lookup"
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match="defines no public functions"):
        load_tools(str(tmp_path / "empty.py"))
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="broken.py:1: importing it failed \\(RuntimeError: boom\\)"):
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


HOSTILE_PY = """
import datetime
import sys


def now():
    return datetime.datetime(2020, 1, 1)


def huge():
    return "x" * 10_000_000


def add(a: int, b: float = 1.0):
    return a + b


def bye():
    sys.exit(3)


def spin():
    while True:
        try:
            pass
        except Exception:
            pass
"""


def test_a_failing_tool_call_is_a_short_result_the_model_sees(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(HOSTILE_PY)
    _, funcs = load_tools(str(path))
    assert call_tool(funcs, "now", "{}") == '"2020-01-01 00:00:00"'  # not JSON-serialisable: its text
    big = call_tool(funcs, "huge", "{}")
    assert big.startswith("xxx") and len(big) < MAX_RESULT_CHARS + 100 and "10000000 characters" in big
    assert call_tool(funcs, "bye", "{}") == "error: SystemExit: 3"  # the session is not ended by a tool
    assert call_tool(funcs, "spin", "{}", timeout=0.2) == "error: spin did not return within 0.2 s and was stopped"
    assert call_tool(funcs, "add", '{"a": 2}') == "3.0"
    assert call_tool(funcs, "add", '{"a": "2", "b": 3}') == "error: add: argument 'a' must be a JSON integer, got \"2\""
    assert call_tool(funcs, "add", '{"a": true}').startswith("error: add: argument 'a' must be a JSON integer")
    assert call_tool(funcs, "add", '{"b": 2}') == "error: add: missing a required argument: 'a'"
    assert call_tool(funcs, "add", '{"a": 1, "c": 2}') == "error: add: got an unexpected keyword argument 'c'"
    assert call_tool(funcs, "add", "[1, 2]") == "error: the arguments of add must be a JSON object, got list"
    assert call_tool(funcs, "add", "{oops") == call_tool(funcs, "add", '{"a": ' + "[" * 100_000) != ""
    assert call_tool(funcs, "add", "{oops").startswith("error: the arguments of add are not JSON")


def test_a_tools_file_that_cannot_load_is_one_line_with_its_line(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\n\n\ndef f():\n    pass\n\n\nsys.exit('no')\n")
    with pytest.raises(ConfigError, match=r"exits.py:8: importing it failed \(SystemExit: no\)") as e:
        load_tools(str(tmp_path / "exits.py"))
    assert "\n" not in str(e.value)
    (tmp_path / "syntax.py").write_text("def f(:\n    pass\n")
    with pytest.raises(ConfigError, match=r"syntax.py:1: importing it failed \(SyntaxError"):
        load_tools(str(tmp_path / "syntax.py"))


def test_a_function_name_no_tool_may_have_is_one_line_naming_its_line(tmp_path):
    """The schemas go through the readers' check (check_tools): a name outside the tools API's rule
    is refused where the function is, with the way out (a leading '_' keeps a helper out)."""
    (tmp_path / "uni.py").write_text(
        "def add(a: int, b: int) -> int:\n    return a + b\n\n\ndef 计算器(x: str) -> str:\n    return x\n"
    )
    with pytest.raises(ConfigError) as e:
        load_tools(str(tmp_path / "uni.py"))
    assert str(e.value).startswith(f"--tools {tmp_path / 'uni.py'}:5: function '计算器' cannot be a tool")
    assert "start it with '_'" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "helper.py").write_text(
        "def add(a: int, b: int) -> int:\n    return a + b\n\n\ndef _计算器(x):\n    return x\n"
    )
    tools, funcs = load_tools(str(tmp_path / "helper.py"))
    assert [t["function"]["name"] for t in tools] == ["add"] and list(funcs) == ["add"]


def test_a_tools_file_with_postponed_annotations_and_a_dataclass_loads_with_its_types(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass P:\n"
        "    x: int\n\n\ndef f(a: int, b: list[str] | None = None, c: float = 0.0) -> int:\n    return a\n"
    )
    tools, funcs = load_tools(str(path))
    props = tools[0]["function"]["parameters"]["properties"]
    assert props == {"a": {"type": "integer"}, "b": {"type": "array"}, "c": {"type": "number"}}
    assert call_tool(funcs, "f", '{"a": 1, "b": null}') == "1"


def test_the_chat_goes_on_through_a_flood_of_calls_and_a_hostile_call(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS_PY)
    tools, funcs = load_tools(str(path))
    ran = []
    funcs = {**funcs, "calculator": lambda expression: ran.append(expression) or "1"}
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1*1"}}\n</tool_call>\n'
    deep = '<tool_call>\n{"name": "calculator", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}\n</tool_call>\n"
    out = io.StringIO()
    session = ScriptedSession(
        ["r\n</think>\n\n" + call * 1000, "r\n</think>\n\n" + deep], out=out, tools=tools, functions=funcs
    )
    answer = session.reply("go")
    assert len(ran) == MAX_CALLS_PER_REPLY  # the other calls are answered "not run", not run
    results = [m for m in session.messages if m["role"] == "tool"]
    assert len(results) == 1000 and results[-1]["content"].startswith("error: not run")
    ids = [c["id"] for c in session.messages[1]["tool_calls"]]
    assert [m["tool_call_id"] for m in results] == ids
    assert answer.startswith("<tool_call>") and session.messages[-1]["role"] == "assistant"  # a broken call is text


def test_rerank_with_a_thinking_checkpoint_is_one_line_not_ignored():
    with pytest.raises(CheckpointError, match="--rerank scores plain replies") as e:
        ScriptedSession([], rerank=4)
    assert "\n" not in str(e.value)


def test_a_broken_tools_file_is_reported_before_the_model_loads(tmp_path):
    import argparse

    from erniekit.infer.chat import run_chat

    (tmp_path / "tools.py").write_text("import nope_not_a_module\n")
    args = argparse.Namespace(model_dir=str(tmp_path / "no-such-checkpoint"), tools=str(tmp_path / "tools.py"))
    with pytest.raises(ConfigError, match=r"tools.py:1: importing it failed \(ModuleNotFoundError"):
        run_chat(args)
