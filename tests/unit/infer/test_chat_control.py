"""`erniekit chat --control / --rerank` and `erniekit eval --credibility` on a tiny checkpoint
(docs/control.md): the reply is the generation from the prompt with the control prefix, --rerank
returns the most credible of its samples, the eval report is the credibility scores of the data."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.paddle import save_file

from erniekit.cli import main
from erniekit.data.control import with_control
from erniekit.data.formats import load_sft_examples
from erniekit.infer.chat import chat_prompt_ids, load_chat_model, run_chat
from erniekit.infer.credibility import credibility_report, sample_replies
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.stops import stop_ids
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, load_credibility_head, sequence_logits

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """An untrained tiny-moe checkpoint (initializer_range 0.2: replies depend on the prompt) with a
    random credibility head beside it."""
    path = str(tmp_path_factory.mktemp("ctl") / "ckpt")
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.2))
    save_pretrained(model, path, tokenizer=default_tokenizer())
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (model.config.hidden_size, 1)).astype("float32")
    save_file(
        {"weight": paddle.to_tensor(w), "bias": paddle.to_tensor([0.1])}, os.path.join(path, CREDIBILITY_HEAD_NAME)
    )
    return path


def _args(ckpt: str, **kw) -> argparse.Namespace:
    base = dict(model_dir=ckpt, prompt="12+30=", system=None, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None)
    return argparse.Namespace(**{**base, **kw})


def test_chat_control_generates_from_the_prefixed_prompt(ckpt, capsys):
    model, tok = load_chat_model(ckpt)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids(model, tok))
    outs = {}
    for control in ({"style": "words"}, {}):
        assert run_chat(_args(ckpt, control=control, system="S")) == 0
        outs[str(control)] = capsys.readouterr().out
        ids = chat_prompt_ids(
            tok, with_control([{"role": "system", "content": "S"}, {"role": "user", "content": "12+30="}], control)
        )
        assert outs[str(control)] == tok.decode(generate(model, [ids], params, pad_id=tok.pad_token_id)[0]) + "\n"
    assert outs["{'style': 'words'}"] != outs["{}"]  # the prefix changes what the random model says


def test_cli_control_flag(ckpt):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "erniekit", "chat", ckpt, "--prompt", "12+30=", "--max-new-tokens", "8", *a],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok = run("--control", "style=words", "--control", "length=short")
    assert ok.returncode == 0, ok.stderr
    model, tok = load_chat_model(ckpt)
    msgs = with_control([{"role": "user", "content": "12+30="}], {"style": "words", "length": "short"})
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids(model, tok))
    assert (
        ok.stdout
        == tok.decode(generate(model, [chat_prompt_ids(tok, msgs)], params, pad_id=tok.pad_token_id)[0]) + "\n"
    )


@pytest.mark.parametrize(
    "flags, what",
    [
        (["--control", "style"], "--control 'style' must be KEY=VALUE"),
        (["--control", "a=x;y"], "without ; = < >"),
        (["--rerank", "3"], "--rerank 3 samples answers to choose from: set --temperature > 0"),
        (["--rerank", "0"], "--rerank 0 must be in 1..64"),
        (["--rerank", "2", "--temperature", "1", "--speculative"], "--speculative supports greedy"),
    ],
)
def test_bad_chat_flags_are_one_line_before_loading(ckpt, capsys, flags, what):
    assert main(["chat", ckpt, "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert what in err and err.count("\n") == 1


def test_rerank_returns_the_most_credible_sample(ckpt, capsys):
    assert run_chat(_args(ckpt, control={}, rerank=4, temperature=1.0, seed=5, max_new_tokens=6)) == 0
    got = capsys.readouterr().out
    model, tok = load_chat_model(ckpt)
    head = load_credibility_head(ckpt, model.config.hidden_size)
    msgs = [{"role": "user", "content": "12+30="}]
    ids = chat_prompt_ids(tok, msgs)
    answers = sample_replies(model, tok, [ids] * 4, 1.0, 6, 4, seed=5)
    assert len(set(answers)) > 1  # the samples differ, so the choice matters
    from erniekit.data.formats import Conversation
    from erniekit.infer.credibility import reply_sequence

    conv = Conversation(None, [("12+30=", "")], [True])
    scores = sequence_logits(model, head, [reply_sequence(conv, a, tok) for a in answers], 0).numpy()
    assert got == answers[int(np.argmax(scores))] + "\n"


def test_rerank_without_a_head_is_one_line(ckpt, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    os.remove(bare / CREDIBILITY_HEAD_NAME)
    assert main(["chat", str(bare), "--prompt", "x", "--rerank", "2", "--temperature", "1"]) == 2
    err = capsys.readouterr().err
    assert "--rerank needs the credibility head (credibility_head.safetensors)" in err and err.count("\n") == 1


def test_eval_credibility_reports_the_scores_of_the_data(ckpt, tmp_path, capsys):
    data = ROOT / "examples" / "data" / "control" / "eval.jsonl"
    out = tmp_path / "rep"
    argv = ["eval", ckpt, "--credibility", "--data", str(data), "--max-samples", "12", "--max-new-tokens", "6"]
    assert main([*argv, "--batch-size", "6", "--out", str(out), "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "credibility.json").read_text())
    assert f"ROC AUC (real vs generated): {rep['auc']:.3f}" in printed
    model, tok = load_chat_model(ckpt)
    head = load_credibility_head(ckpt, model.config.hidden_size)
    want = credibility_report(model, head, tok, load_sft_examples(str(data))[:12], 6, 6, 1.0, 2)
    assert rep["auc"] == pytest.approx(want["auc"]) and rep["real"] == pytest.approx(want["real"])
    assert rep["examples"] == 12 and rep["generated"]["n"] == 12 - rep["identical"]


def test_eval_credibility_without_a_head_is_one_line(ckpt, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    os.remove(bare / CREDIBILITY_HEAD_NAME)
    assert main(["eval", str(bare), "--credibility", "--max-samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "no credibility_head.safetensors; train with credibility_loss_weight > 0" in err and err.count("\n") == 1
    assert main(["eval", str(bare), "--credibility", "--temperature", "0"]) == 2
    assert "--temperature in (0, 2]" in capsys.readouterr().err


def test_eval_credibility_on_tool_data_is_one_line(ckpt, tmp_path, capsys):
    data = ROOT / "examples" / "data" / "tools" / "eval.jsonl"
    assert main(["eval", ckpt, "--credibility", "--data", str(data), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--data {data}: no plain conversations to score" in err and err.count("\n") == 1


def test_rerank_with_only_blank_samples_says_so(ckpt, capsys, monkeypatch):
    """Every sample blank (the model ended each reply at once): one line saying so, not an empty
    reply; the samples come from a stand-in sampler, the scoring and the choice are real."""
    import erniekit.infer.credibility as credibility

    monkeypatch.setattr(
        credibility, "sample_replies", lambda model, tok, prompts, *a: ["", " "] + [""] * (len(prompts) - 2)
    )
    assert run_chat(_args(ckpt, control={}, rerank=3, temperature=1.0, seed=5)) == 0
    out = capsys.readouterr().out
    assert (
        out
        == "(all 3 sampled answers were empty: the model ended each reply at once; ask again, or raise --rerank or --temperature)\n"
    )
