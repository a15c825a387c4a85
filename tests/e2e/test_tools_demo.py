"""The tool-calling demo (examples/configs/tiny/sft_tools.yaml), shortened to 150 steps of batch 8
(~2 min alone at 1 thread on an AMD EPYC without AVX-512) and trained once, then driven as a user would: the run
ends with its held-out tool-call and final-answer lines, and the `openai` client's tools API
against `erniekit server` on the trained model, whole and streamed, gives a tool call with its
reasoning, takes the result back and answers. 150 steps learn the format and when to call, not the
copying of numbers: the assertions are about what the format and the API promise (the full config's
accuracy over seeds is recorded in bench_results/tools_default_matrix*.json, held to docs/tools.md's
floor below)."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pytest
from launched_jobs import free_port, serve, train

openai = pytest.importorskip("openai")
ROOT = str(Path(__file__).resolve().parents[2])
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


FLOOR = 0.85  # docs/tools.md: "final-answer accuracy at least 0.85 on any seed or thread count"


# what a matrix's name says when it is not of the shipped recipe: its step count (..._1000_steps.json)
# or, for the same steps, other training data (the one calculator schema before descriptions varied)
STALE_DATA_SUFFIX = "_fixed_schema.json"


def test_the_recorded_runs_of_the_full_demo_meet_the_floor_the_docs_state():
    """The full config is too long for the suite (6-9 min on 2 AMD EPYC cores, 20-35 on 2 Intel
    Xeon ones); its seeds x threads matrices are
    recorded (tools/embedded_default_matrix.py), one file per machine. Every one is of the shipped
    config and finished; those of the shipped step count and training data (the sha256 of the
    bundled train.jsonl, in the matrix's key) hold the floor, over seeds {1, 2, 3, 42} at 1 thread
    and some at 2; a matrix of an earlier recipe names its step count (..._1000_steps.json) or its
    data (..._fixed_schema.json), so a stale record can never stand in for the shipped one."""
    import hashlib

    import yaml

    docs = open(f"{ROOT}/docs/tools.md").read()
    assert f"final-answer accuracy\nat least {FLOOR:.2f}" in docs
    config = yaml.safe_load(open(f"{ROOT}/examples/configs/tiny/sft_tools.yaml"))
    steps = config["max_steps"]
    data = hashlib.sha256(open(f"{ROOT}/{config['train_dataset_path']}", "rb").read()).hexdigest()
    current = []
    for path in sorted(glob.glob(f"{ROOT}/bench_results/tools_default_matrix*.json")):
        matrix = json.load(open(path))
        key = {k: v for k, v in matrix["key"].items() if k != "train_data_sha256"}
        assert key == {"config": "examples/configs/tiny/sft_tools.yaml", "overrides": []}, path
        runs = matrix["runs"]
        assert runs and all(r["returncode"] == 0 for r in runs), path
        (ran,) = {r["global_step"] for r in runs}
        if ran != steps:
            assert path.endswith(f"_{ran}_steps.json"), f"{path}: {ran} steps, the config {steps}: re-run or rename it"
        elif matrix["key"].get("train_data_sha256") != data:
            assert path.endswith(STALE_DATA_SUFFIX), f"{path}: not of the bundled train.jsonl: re-run or rename it"
        else:
            current += runs
    assert {r["seed"] for r in current if r["threads"] == 1} >= {1, 2, 3, 42}, current
    assert {r["threads"] for r in current} >= {1, 2}, current
    assert min(r["final_answer_accuracy"] for r in current) >= FLOOR, current
    for r in current:  # docs/tools.md's table is these runs
        row = f"| {r['seed']} | {r['threads']} | {r['tool_call_match']:.3f} | {r['final_answer_accuracy']:.3f} |"
        assert row in docs, row


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools")
    args = ["examples/configs/tiny/sft_tools.yaml", "max_steps=150", "warmup_steps=30", "eval_steps=150"]
    args += ["per_device_train_batch_size=8", "save_steps=150", "eval_max_samples=40", "disable_tqdm=true"]
    args += [f"output_dir={out}"]
    r = train(args, ROOT, timeout=900)
    return str(out), r.stdout


def test_the_run_ends_with_the_tool_lines(demo):
    _, stdout = demo
    call = re.search(r"held-out tool-call exact match: ([0-9.]+)", stdout)
    final = re.search(r"held-out final-answer accuracy: ([0-9.]+)", stdout)
    assert call and final, stdout[-2000:]
    # measured at 150 steps of 8: call match 0.575 at seeds 1 and 2 (final 0.125 / 0.075); every
    # test of this file passed there, and at 120 and 160 steps with seed 42 (300 steps gave the
    # same 0.575); the format and the call/answer choice are learned, copying the numbers has
    # begun, not finished
    assert float(call[1]) >= 0.25, stdout[-2000:]


@pytest.fixture(scope="module")
def client(demo):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    for _ in serve(["server", demo[0], "--port", str(port), "--served-model-name", "tools"], base + "/health", ROOT):
        yield openai.OpenAI(base_url=base + "/v1", api_key="none")


QUESTION = "47*86=?"  # a product: a call to the calculator


def _round_trip(client, stream: bool) -> tuple[dict, dict]:
    msgs = [{"role": "user", "content": QUESTION}]
    first = _ask(client, msgs, stream)
    assert first["finish_reason"] == "tool_calls", first
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "calculator" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"expression"}
    assert first["reasoning_content"].endswith(": use the calculator.") and not first["content"]
    msgs += [
        # the reasoning goes back too: the history then renders as the model was trained on it
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": first["reasoning_content"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "4042"},
    ]
    final = _ask(client, msgs, stream)
    assert final["finish_reason"] == "stop" and final["content"].isdigit(), final
    assert final["reasoning_content"].startswith("It is ") and not final["tool_calls"]
    return first, final


def _ask(client, msgs, stream: bool) -> dict:
    kw = dict(model="tools", messages=msgs, tools=[CALC], temperature=0, max_tokens=100)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        m = c.message
        calls = [
            {"id": t.id, "type": t.type, "function": {"name": t.function.name, "arguments": t.function.arguments}}
            for t in m.tool_calls or []
        ]
        return {
            "finish_reason": c.finish_reason,
            "content": m.content,
            "tool_calls": calls,
            "reasoning_content": (m.model_extra or {}).get("reasoning_content"),
        }
    out = {"finish_reason": None, "content": "", "tool_calls": [], "reasoning_content": ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        d = c.delta
        out["content"] += d.content or ""
        out["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:  # accumulated by index, as the openai client's helpers do
            while len(out["tool_calls"]) <= t.index:
                out["tool_calls"].append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            acc = out["tool_calls"][t.index]
            acc["id"] = t.id or acc["id"]
            acc["function"]["name"] += t.function.name or ""
            acc["function"]["arguments"] += t.function.arguments or ""
        out["finish_reason"] = c.finish_reason or out["finish_reason"]
    out["content"] = out["content"] or None  # no content deltas: None, as the whole reply says
    return out


def test_openai_client_tool_round_trip_whole_and_streamed_agree(client):
    first, final = _round_trip(client, stream=False)
    s_first, s_final = _round_trip(client, stream=True)
    strip = lambda r: {**r, "tool_calls": [c["function"] for c in r["tool_calls"]]}  # noqa: E731 - ids differ
    assert strip(s_first) == strip(first) and strip(s_final) == strip(final)


def test_a_one_digit_sum_is_answered_without_the_tool(client):
    msgs = [{"role": "user", "content": "3+4=?"}]
    r = client.chat.completions.create(model="tools", messages=msgs, tools=[CALC], temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content.isdigit()
    assert (c.message.model_extra or {}).get("reasoning_content", "").endswith(": I know this.")


def test_a_tool_with_a_docstring_the_data_never_has_is_called_as_one_without(client):
    """Half the training data describes the calculator (erniekit/data/synthetic_tools.py): a
    description it never saw still gets a call with the one argument, as no description does (the
    model trained on the one schema without a description wrote no call)."""
    described = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate a basic arithmetic expression and return the answer as a string.",
            "parameters": CALC["function"]["parameters"],
        },
    }
    msgs = [{"role": "user", "content": QUESTION}]
    for tool in (CALC, described):
        r = client.chat.completions.create(model="tools", messages=msgs, tools=[tool], temperature=0, max_tokens=100)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (tool, c)
        (call,) = c.message.tool_calls
        assert call.function.name == "calculator" and set(json.loads(call.function.arguments)) == {"expression"}
