"""The held-out tool evaluation runs the model's calls as an agent would: a bad call (a malformed
expression, a wrong argument, an unknown tool) becomes an error result the model sees, never a
crash of the training run (seed 2 at 2 threads once ended its 1000 steps with the error
"calculator: '833++80' is not ..." instead of its accuracy lines)."""

from __future__ import annotations

import json

from erniekit.train.tool_eval import _run_tool


def test_a_good_call_runs_the_real_calculator():
    assert _run_tool("calculator", {"expression": "47*86"}, {}) == "4042"


def test_bad_calls_come_back_as_error_results():
    for args in ({"expression": "833++80"}, {"expression": ""}, {"expr": "1+2"}, {"expression": "1+2", "x": 1}):
        got = _run_tool("calculator", args, {})
        assert got.startswith("error: "), (args, got)
    assert "'833++80' is not 'a+b'" in _run_tool("calculator", {"expression": "833++80"}, {})


def test_other_tools_answer_with_the_reference_result_of_the_same_call():
    expected = {("weather", json.dumps({"city": "Paris"}, sort_keys=True)): "sunny"}
    assert _run_tool("weather", {"city": "Paris"}, expected) == "sunny"
    assert _run_tool("weather", {"city": "Rome"}, expected) == "error: unknown call"
