"""Synthetic tool-use task: call a `calculator` for arithmetic, answer small sums by heart.

A question "47*86=?" (a product, or a sum with a number above 4) is answered by calling
`calculator` with the expression, reading the tool's result and answering with it; "3+4=?"
(two numbers from 0 to 4 added: 25 facts a tiny model learns by heart) is answered directly. Held-out questions come from a
fixed partition of the problem space (erniekit/data/synthetic.py is_heldout), so none is trained on.

The tool's schema varies as users write it: half the training conversations give `calculator` a
`description` (a first docstring line, as `erniekit chat --tools` sends one) from a pool of
phrasings, the others none. The eval split alternates no description and phrasings from a separate
pool never trained on, so its held-out lines measure robustness to a docstring the model never saw.
"""

from __future__ import annotations

import os
import random

from erniekit.data.synthetic import is_heldout, write_jsonl
from erniekit.errors import DataError

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# First docstring lines people write for such a function: trained on (DESCRIPTIONS) and held out
# for the eval split (HELDOUT_DESCRIPTIONS, never trained on); docs/tools.md
DESCRIPTIONS = (
    "Evaluate an arithmetic expression.",
    "Calculator tool",
    "Computes a+b, a-b or a*b and returns the result as a string",
    "Calculate.",
    "A calculator.",
    "Evaluate a math expression and return the result.",
    "Returns the value of an arithmetic expression",
    "Add, subtract or multiply two whole numbers.",
    "Use this tool for arithmetic.",
    "Simple calculator",
    "Run a calculation, e.g. 12*34, and return the answer.",
    "Compute the result of EXPRESSION.",
    "evaluate expression",
    "Performs basic arithmetic (addition, subtraction, multiplication).",
    "Calculator: evaluates expressions like 7+8 or 23*4.",
    "Multiply or add numbers",
    "Do the math.",
    "Return the result of a simple arithmetic expression as text.",
    "Arithmetic helper.",
    "Solve an arithmetic problem given as a string.",
    "Evaluates the expression and returns its value",
    "Compute expression",
    "A tool that calculates sums, differences and products of integers.",
    "TODO: document this",
    "Calculator function for the assistant.",
    "Calculate the value of a+b, a-b or a*b.",
    "Math tool - evaluates an expression",
    "Takes an expression string and returns the computed number.",
    "Evaluate `expression` and return the result.",
    "Basic calculator; supports +, - and *.",
    "Call this to do arithmetic instead of guessing.",
    "Integer arithmetic.",
    "Compute a product or a sum.",
    "Evaluates simple math expressions safely (no eval).",
    "Calculator for two-number expressions",
    "Gets the answer to an arithmetic question.",
    "Returns str(result) for the given expression.",
    "Evaluate expression: str -> str",
    "calculator",
    "Use for any multiplication or addition with large numbers.",
)
HELDOUT_DESCRIPTIONS = (
    "Calculate an arithmetic expression.",
    "Simple math evaluator",
    "Returns the numeric result of a+b, a-b or a*b.",
    "Compute.",
    "Arithmetic calculator tool for integers",
    "Evaluate the given expression, for example 15*3, and return its value as a string.",
    "Adds, subtracts or multiplies numbers.",
    "math helper",
    "Work out the value of a simple arithmetic expression.",
    "Calculator (supports +, -, *).",
    "Use this tool to compute products and sums.",
    "Evaluates expression strings like '8+9'.",
)
DESCRIBED_SHARE = 0.5  # of the training conversations; the eval split alternates


# The reasoning restates what it works on (the expression, then the tool's result), as thinking
# models do: twice the copying per conversation, the skill a tiny model learns last (docs/tools.md)
TOOL_REASONING = "{expr}: use the calculator."
DIRECT_REASONING = "{expr}: I know this."
RESULT_REASONING = "It is {answer}."
HELDOUT_FRACTION = 0.1


def calculate(expression: str) -> str:
    """The calculator tool: `a+b`, `a-b` or `a*b` on non-negative integers (no eval of any kind).
    Anything else is a ValueError, the error a tool raises for a bad argument: an agent (the
    held-out evaluation, `erniekit chat --tools`) hands its message back to the model."""
    for op in "+-*":
        a, sep, b = expression.partition(op)
        if sep and a.strip().isdigit() and b.strip().isdigit():
            x, y = int(a), int(b)
            return str(x + y if op == "+" else x - y if op == "-" else x * y)
    raise ValueError(f"calculator: {expression!r} is not 'a+b', 'a-b' or 'a*b' with whole numbers")


def question(a: int, op: str, b: int) -> str:
    """The expression first: the call copies the user message's start as the answer copies the tool
    message's start (one skill for a tiny model to learn; behind "What is " two seeds in three had
    not learned the first by step 1500)."""
    return f"{a}{op}{b}=?"


SMALL = 4  # sums of two numbers up to this are answered by heart


def needs_tool(a: int, op: str, b: int) -> bool:
    return op != "+" or a > SMALL or b > SMALL


def calculator_schema(description: str | None = None) -> dict:
    """`CALCULATOR`, with `description` when given (in the readers' order: name, description,
    parameters)."""
    if description is None:
        return CALCULATOR
    fn = CALCULATOR["function"]
    return {
        "type": "function",
        "function": {"name": fn["name"], "description": description, "parameters": fn["parameters"]},
    }


def conversation(a: int, op: str, b: int, description: str | None = None) -> dict:
    """One record in the messages format with tools (`calculator` described by `description`)."""
    q, expr = question(a, op, b), f"{a}{op}{b}"
    answer = calculate(expr)
    msgs = [{"role": "user", "content": q}]
    if needs_tool(a, op, b):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": TOOL_REASONING.format(expr=expr),
                "tool_calls": [call],
            },
            {"role": "tool", "content": answer},
        ]
        reasoning = RESULT_REASONING.format(answer=answer)
    else:
        reasoning = DIRECT_REASONING.format(expr=expr)
    msgs.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    return {"messages": msgs, "tools": [calculator_schema(description)]}


def _problem(rng: random.Random) -> tuple[int, str, int]:
    kind = rng.random()
    if kind < 0.3:  # by heart
        return rng.randint(0, SMALL), "+", rng.randint(0, SMALL)
    if kind < 0.65:
        return rng.randint(10, 99), "*", rng.randint(2, 99)
    return rng.randint(10, 999), "+", rng.randint(0, 999)


def make_tool_conversations(n: int, seed: int, split: str) -> list[dict]:
    """`n` records of the `split` ("train" or "eval") partition; eval problems are distinct."""
    if split not in ("train", "eval"):
        raise DataError(f"make_tool_conversations: split={split!r}; use 'train' or 'eval'")
    rng = random.Random(f"tools-{seed}-{split}")
    describe = random.Random(f"tools-{seed}-{split}-descriptions")  # its own stream: the problems stay as they were
    rows, seen, tries = [], set(), 0
    while len(rows) < n:
        tries += 1
        if tries > 1000 * n + 10_000:
            raise DataError(f"make_tool_conversations: only {len(rows)} of {n} {split} problems found")
        a, op, b = _problem(rng)
        text = question(a, op, b)
        # small sums are facts learned by heart: all 25 are trained, and asked in the eval split too
        small = not needs_tool(a, op, b)
        if not small and is_heldout(text, HELDOUT_FRACTION) != (split == "eval"):
            continue
        if split == "eval":
            if text in seen:
                continue
            seen.add(text)
        rows.append(conversation(a, op, b, _description(describe, split, len(rows))))
    return rows


def _description(rng: random.Random, split: str, k: int) -> str | None:
    """The `description` of the `k`-th conversation of `split`: a trained phrasing for a share of
    the training split; every other eval conversation one never trained on."""
    if split == "train":
        return rng.choice(DESCRIPTIONS) if rng.random() < DESCRIBED_SHARE else None
    return rng.choice(HELDOUT_DESCRIPTIONS) if k % 2 else None


def write_tool_dataset(out_dir: str, n_train: int, n_eval: int, seed: int) -> dict[str, str]:
    """Write train.jsonl and eval.jsonl (messages with tools) under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("eval", n_eval)):
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        write_jsonl(paths[split], make_tool_conversations(n, seed, split))
    return paths
