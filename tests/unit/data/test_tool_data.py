"""Tool-call training data: OpenAI messages with tools, ERNIEKit's function-call records and
ShareGPT's function_call / observation turns read to one form; the loss covers only what the
assistant writes (optionally not its reasoning); bad schemas and calls are one-line errors with
file and line."""

from __future__ import annotations

import json

import pytest

from erniekit.data.encode import IGNORE_INDEX, encode_conversation
from erniekit.data.formats import load_sft_examples
from erniekit.data.synthetic_tools import CALCULATOR, calculate, make_tool_conversations
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer().with_thinking_template()


def _write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


OPENAI = {
    "messages": [
        {"role": "user", "content": "What is 12*13?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the calculator.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12*13"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "156"},
        {"role": "assistant", "content": "156", "reasoning_content": "Answer with the result."},
    ],
    "tools": [CALCULATOR],
}
# ERNIEKit's function-call jsonl: reasoning inline, arguments and results as JSON values
ERNIEKIT_FC = {
    "messages": [
        {"role": "user", "content": "What is 12*13?"},
        {
            "role": "assistant",
            "content": "<think>Use the calculator.</think>",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*13"}}}
            ],
        },
        {"role": "tool", "content": 156},
        {"role": "assistant", "content": "<think>\nAnswer with the result.\n</think>\n\n156"},
    ],
    "tools": [CALCULATOR],
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "What is 12*13?"},
        {"from": "function_call", "value": '{"name": "calculator", "arguments": {"expression": "12*13"}}'},
        {"from": "observation", "value": "156"},
        {"from": "gpt", "value": "156"},
    ],
    "tools": json.dumps([CALCULATOR]),
}


def test_the_three_formats_read_to_the_same_dialog(tmp_path):
    convs = [
        load_sft_examples(_write(tmp_path, [r], f"{k}.jsonl"))[0] for k, r in enumerate((OPENAI, ERNIEKIT_FC, SHAREGPT))
    ]
    for c in convs:
        assert c.tools[0]["function"]["name"] == "calculator"
        roles = [m["role"] for m in c.dialog]
        assert roles == ["user", "assistant", "tool", "assistant"]
        call = c.dialog[1]["tool_calls"][0]["function"]
        assert call == {"name": "calculator", "arguments": {"expression": "12*13"}}
        assert c.dialog[2]["content"] == "156" and c.dialog[3]["content"] == "156"
    assert convs[0].dialog[1]["reasoning_content"] == convs[1].dialog[1]["reasoning_content"] == "Use the calculator."
    assert convs[1].dialog[3]["reasoning_content"] == "Answer with the result."  # split from <think>...</think>


def test_loss_covers_only_what_the_assistant_writes(tmp_path, tok):
    conv = load_sft_examples(_write(tmp_path, [OPENAI]))[0]
    ids, labels = encode_conversation(conv, tok, 4096)
    trained = tok.decode([i for i, l in zip(ids, labels) if l != IGNORE_INDEX], skip_special_tokens=False)
    assert trained == (
        'Use the calculator.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n'
        "</tool_call>\n<|im_end|>\n\nAnswer with the result.\n</think>\n\n<response>\n156\n</response>\n<|im_end|>\n\n"
    )
    masked = tok.decode([i for i, l in zip(ids, labels) if l == IGNORE_INDEX], skip_special_tokens=False)
    assert "<tool_list>" in masked and "What is 12*13?" in masked and "<|im_start|>tool\n156" in masked

    _, no_reasoning = encode_conversation(conv, tok, 4096, train_on_reasoning=False)
    kept = tok.decode([i for i, l in zip(ids, no_reasoning) if l != IGNORE_INDEX], skip_special_tokens=False)
    assert "calculator." not in kept and "Answer with the result" not in kept
    assert kept.startswith("</think>\n\n<tool_call>") and "<response>\n156\n</response>" in kept


def test_training_ids_are_the_inference_prompt_ids(tmp_path, tok):
    """The prompt before each reply is what chat / the server encode for the same history."""
    from erniekit.infer.chat import chat_prompt_ids

    conv = load_sft_examples(_write(tmp_path, [OPENAI]))[0]
    ids, labels = encode_conversation(conv, tok, 4096)
    for k in (1, 3):  # the two assistant messages
        prompt = chat_prompt_ids(tok, conv.dialog[:k], conv.tools)
        assert ids[: len(prompt)] == prompt and labels[len(prompt) - 1] == IGNORE_INDEX != labels[len(prompt)]


@pytest.mark.parametrize(
    "record, message",
    [
        ({**OPENAI, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function name 'bad name!'"),
        (
            {**OPENAI, "tools": [{"type": "function", "function": {"name": "c", "parameters": {"type": "array"}}}]},
            "JSON schema object",
        ),
        ({**OPENAI, "tools": "[not json"}, "is a string but not JSON"),
        ({**OPENAI, "tools": [CALCULATOR, CALCULATOR]}, "tool names must be unique"),
        (
            {
                **OPENAI,
                "messages": [
                    OPENAI["messages"][0],
                    {
                        **OPENAI["messages"][1],
                        "tool_calls": [
                            {"type": "function", "function": {"name": "calculator", "arguments": "{'expression': 1"}}
                        ],
                    },
                    *OPENAI["messages"][2:],
                ],
            },
            "arguments is not JSON",
        ),
        (
            {
                **OPENAI,
                "messages": [
                    OPENAI["messages"][0],
                    {
                        **OPENAI["messages"][1],
                        "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {}}}],
                    },
                    *OPENAI["messages"][2:],
                ],
            },
            "calls 'search', which is not among the tools",
        ),
        (
            {**OPENAI, "messages": [OPENAI["messages"][0], OPENAI["messages"][2], OPENAI["messages"][3]]},
            "must follow an assistant message with tool_calls",
        ),
        ({**OPENAI, "messages": OPENAI["messages"][:3]}, "must end with an assistant message"),
        (
            {
                **OPENAI,
                "messages": [
                    OPENAI["messages"][0],
                    {**OPENAI["messages"][1], "content": "hm"},
                    *OPENAI["messages"][2:],
                ],
            },
            "text next to tool_calls",
        ),
        (
            {**SHAREGPT, "conversations": [SHAREGPT["conversations"][0], {"from": "function_call", "value": "{oops"}]},
            "function_call value is not JSON",
        ),
        (  # a second result for the one call
            {**OPENAI, "messages": [*OPENAI["messages"][:3], {"role": "tool", "content": "7"}, OPENAI["messages"][3]]},
            "messages[3]: a tool result that answers no call",
        ),
        (
            {
                **OPENAI,
                "messages": [
                    *OPENAI["messages"][:2],
                    {**OPENAI["messages"][2], "tool_call_id": "c9"},
                    OPENAI["messages"][3],
                ],
            },
            "messages[2].tool_call_id 'c9' names no unanswered call (open: c1)",
        ),
        (  # the call is never answered
            {**OPENAI, "messages": [*OPENAI["messages"][:2], OPENAI["messages"][0], OPENAI["messages"][3]]},
            "messages[2]: 1 tool call(s) before it have no result (calculator)",
        ),
        (
            {
                **OPENAI,
                "messages": [
                    OPENAI["messages"][0],
                    {**OPENAI["messages"][1], "tool_calls": OPENAI["messages"][1]["tool_calls"] * 2},
                    *OPENAI["messages"][2:],
                ],
            },
            "tool_calls[1].id 'c1' is the id of an earlier call too",
        ),
        (
            {
                **OPENAI,
                "messages": [
                    OPENAI["messages"][0],
                    {
                        **OPENAI["messages"][1],
                        "tool_calls": [
                            {"type": "function", "function": {"name": "calculator", "arguments": "[" * 100_000}}
                        ],
                    },
                    *OPENAI["messages"][2:],
                ],
            },
            "arguments is not JSON (arrays or objects nested too deeply to read)",
        ),
        ({**OPENAI, "tools": "[" * 100_000}, "is a string but not JSON (arrays or objects nested too deeply to read)"),
        (  # an integer past Python's digit limit was a ValueError traceback
            {**OPENAI, "tools": '[{"type": "function", "function": {"name": "f", "x": 1' + "0" * 5000 + "}}]"},
            "is a string but not JSON (Exceeds the limit (4300 digits)",
        ),
    ],
)
def test_bad_tools_and_calls_are_one_line_errors_with_file_and_line(tmp_path, record, message):
    path = _write(tmp_path, [SHAREGPT if "conversations" in record else OPENAI, record])
    with pytest.raises(DataError) as e:
        load_sft_examples(path)
    text = str(e.value)
    assert f"{path}:2" in text and message in text and "\n" not in text


def test_tool_data_with_a_template_that_drops_tool_calls_is_refused(tmp_path):
    conv = load_sft_examples(_write(tmp_path, [OPENAI]))[0]
    with pytest.raises(DataError, match="chat_template: ernie_thinking"):
        encode_conversation(conv, default_tokenizer(), 4096)  # the plain ERNIE template
    with pytest.raises(DataError, match="train_on_reasoning: false needs a thinking chat template"):
        plain = load_sft_examples(
            _write(
                tmp_path,
                [
                    {
                        "messages": [
                            {"role": "user", "content": "a"},
                            {"role": "assistant", "content": "<think>r</think>b"},
                        ]
                    }
                ],
                "p.jsonl",
            )
        )[0]
        encode_conversation(plain, default_tokenizer(), 4096, train_on_reasoning=False)


def test_synthetic_tool_conversations_are_right_and_held_out():
    train = make_tool_conversations(400, 0, "train")
    held = make_tool_conversations(100, 0, "eval")
    q = lambda r: r["messages"][0]["content"]  # noqa: E731
    tool_questions = {q(r) for r in held if len(r["messages"]) > 2}
    assert tool_questions and not tool_questions & {q(r) for r in train}  # tool problems never trained on
    for r in train + held:
        msgs = r["messages"]
        expr = msgs[0]["content"].removesuffix("=?")
        assert msgs[-1]["content"] == str(eval(expr))  # noqa: S307 - the reference: Python's own arithmetic
        if len(msgs) > 2:
            assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"expression": expr}
            assert msgs[2]["content"] == calculate(expr)
            # the reasoning restates the expression, then the tool's result: the copying to learn
            assert msgs[1]["reasoning_content"] == f"{expr}: use the calculator."
            assert msgs[3]["reasoning_content"] == f"It is {msgs[2]['content']}."
        else:
            x, y = expr.split("+")
            assert int(x) <= 4 and int(y) <= 4 and msgs[1]["reasoning_content"] == f"{expr}: I know this."
    for bad in ("__import__('os')", "833++80", "", "1.5*2"):
        with pytest.raises(ValueError, match="not 'a\\+b'"):
            calculate(bad)


def test_the_bundled_demo_data_is_what_the_generator_writes(tmp_path):
    from pathlib import Path

    from erniekit.data.synthetic_tools import write_tool_dataset

    paths = write_tool_dataset(str(tmp_path), 6000, 200, 0)
    bundled = Path(__file__).resolve().parents[3] / "examples" / "data" / "tools"
    for split, path in paths.items():
        assert Path(path).read_bytes() == (bundled / f"{split}.jsonl").read_bytes(), split


def _description(record: dict) -> str | None:
    return record["tools"][0]["function"].get("description")


def test_tool_descriptions_vary_and_the_eval_phrasings_are_never_trained():
    """Half the training conversations describe `calculator` (a first docstring line from a pool),
    the others do not; the eval split alternates none and phrasings never trained on."""
    from erniekit.data.synthetic_tools import DESCRIPTIONS, HELDOUT_DESCRIPTIONS

    assert not set(DESCRIPTIONS) & set(HELDOUT_DESCRIPTIONS)
    train = [_description(r) for r in make_tool_conversations(400, 0, "train")]
    described = [d for d in train if d is not None]
    assert 0.4 < len(described) / len(train) < 0.6
    assert set(described) <= set(DESCRIPTIONS) and len(set(described)) >= 30
    assert {len(d) for d in described} >= {len("Calculate."), len(DESCRIPTIONS[2])}  # short and long
    held = [_description(r) for r in make_tool_conversations(100, 0, "eval")]
    assert held[0::2] == [None] * 50 and set(held[1::2]) <= set(HELDOUT_DESCRIPTIONS)
    assert len(set(held[1::2])) >= 8
    assert train == [_description(r) for r in make_tool_conversations(400, 0, "train")]  # deterministic
    assert train != [_description(r) for r in make_tool_conversations(400, 1, "train")]  # from the seed


def test_the_bundled_eval_phrasings_never_appear_in_the_bundled_train_data():
    from pathlib import Path

    bundled = Path(__file__).resolve().parents[3] / "examples" / "data" / "tools"
    read = lambda split: (bundled / f"{split}.jsonl").read_text(encoding="utf-8")  # noqa: E731
    held = {_description(json.loads(line)) for line in read("eval").splitlines()} - {None}
    assert len(held) >= 8
    train = read("train")
    assert not [d for d in held if json.dumps(d) in train]


def test_a_described_calculator_reads_and_renders_as_chat_sends_a_docstring(tmp_path, tok):
    """The readers accept the described schema and put its description in the tool list, where
    `erniekit chat --tools` puts a function's first docstring line."""
    from erniekit.data.synthetic_tools import DESCRIPTIONS, calculator_schema, conversation
    from erniekit.infer.local_tools import tool_schema

    description = DESCRIPTIONS[0]
    record = conversation(47, "*", 86, description)
    conv = load_sft_examples(_write(tmp_path, [record]))[0]
    assert conv.tools == [calculator_schema(description)]

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        More lines, which chat leaves out."""

    assert tool_schema("calculator", calculator) == calculator_schema(description)  # as dicts: order aside
    ids, labels = encode_conversation(conv, tok, 4096)
    masked = tok.decode([i for i, l in zip(ids, labels) if l == IGNORE_INDEX], skip_special_tokens=False)
    assert f'{{"name": "calculator", "description": "{description}", "parameters": ' in masked
    assert calculator_schema(None) == CALCULATOR


def test_chat_sends_a_docstring_as_the_training_data_renders_a_description(tmp_path, tok):
    """`erniekit chat --tools` prompts with a docstring's first line as training renders a described
    tool, token for token (the demo model, trained on the readers' order, copies no numbers with
    the description after the parameters: held-out final-answer accuracy 0.09 against 0.98)."""
    from erniekit.data.synthetic_tools import conversation
    from erniekit.infer.chat import chat_prompt_ids
    from erniekit.infer.local_tools import load_tools

    (tmp_path / "tools.py").write_text(
        'def calculator(expression: str) -> str:\n    """Evaluate an arithmetic expression."""\n    return expression\n'
    )
    tools, _ = load_tools(str(tmp_path / "tools.py"))
    conv = load_sft_examples(_write(tmp_path, [conversation(47, "*", 86, "Evaluate an arithmetic expression.")]))[0]
    ids, _ = encode_conversation(conv, tok, 4096)
    prompt = chat_prompt_ids(tok, conv.dialog[:1], tools)
    assert ids[: len(prompt)] == prompt
