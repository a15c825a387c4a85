"""`erniekit chat`: one-shot output equals generate(), seeded sampling, multi-turn history, errors."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import paddle
import pytest

import erniekit.infer.generate as gen
from erniekit.data.formats import Conversation
from erniekit.infer.chat import run_chat
from erniekit.infer.generate import SamplingParams, generate
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer, default_tokenizer
from erniekit.train.evaluation import prompt_ids

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """An untrained tiny-moe checkpoint with the shipped tokenizer (no training: fast).

    initializer_range 0.2 (not 0.02) makes the random model's reply depend on the prompt
    instead of repeating one token, so history and sampling changes show in the output.
    """
    path = str(tmp_path_factory.mktemp("chat") / "ckpt")
    paddle.seed(0)
    save_pretrained(
        Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.2)), path, tokenizer=default_tokenizer()
    )
    return path


def _args(ckpt: str, **kw) -> argparse.Namespace:
    base = dict(model_dir=ckpt, prompt=None, system=None, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None)
    return argparse.Namespace(**{**base, **kw})


def _cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "chat", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_one_shot_cli_streams_the_greedy_generation(ckpt):
    proc = _cli([ckpt, "--prompt", "1+2=", "--max-new-tokens", "8"])
    assert proc.returncode == 0, proc.stderr
    tok = ErnieTokenizer.from_pretrained(ckpt)
    model = from_pretrained(ckpt)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True))
    stops = [tok.sep_token_id, tok.eos_token_id, *model.config.eos_token_ids]
    out = generate(model, [ids], SamplingParams(max_new_tokens=8, stop_token_ids=stops), pad_id=tok.pad_token_id)[0]
    assert out, "expected a non-empty greedy reply"
    assert proc.stdout == tok.decode(out) + "\n"


def test_seed_reproduces_sampling_and_tiny_top_p_is_greedy(ckpt, capsys):
    def reply(**kw) -> str:
        assert run_chat(_args(ckpt, prompt="3+4=", max_new_tokens=12, **kw)) == 0
        return capsys.readouterr().out

    a = reply(temperature=1.0, seed=7)
    assert reply(temperature=1.0, seed=7) == a
    assert reply(temperature=1.0, seed=8) != a
    greedy = reply()
    assert greedy != a
    assert reply(temperature=1.0, top_p=1e-6, seed=7) == greedy


def test_interactive_keeps_history_clears_and_exits(ckpt, monkeypatch, capsys):
    rendered: list[list[dict]] = []
    real_template = ErnieTokenizer.apply_chat_template

    def spy(self, messages, add_generation_prompt=True, **kw):
        if add_generation_prompt:
            rendered.append([dict(m) for m in messages])
        return real_template(self, messages, add_generation_prompt=add_generation_prompt, **kw)

    prompts: list[list[int]] = []
    real_stream = gen.generate_stream

    def stream_spy(model, ps, params, pad_id=0, vocab=None):
        prompts.append(list(ps[0]))
        return real_stream(model, ps, params, pad_id, vocab=vocab)

    monkeypatch.setattr(ErnieTokenizer, "apply_chat_template", spy)
    monkeypatch.setattr(gen, "generate_stream", stream_spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("1+2=\n3+4=\n/clear\n5+6=\n/exit\n7+8=\n"))
    assert run_chat(_args(ckpt, system="be brief")) == 0
    out = capsys.readouterr().out

    assert [m[-1]["content"] for m in rendered] == ["1+2=", "3+4=", "5+6="]  # nothing after /exit
    second = rendered[1]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[1]["content"] == "1+2=" and second[0]["content"] == "be brief"
    reply1 = second[2]["content"]
    assert out.count("Assistant: ") == 3 and f"Assistant: {reply1}\n" in out
    assert rendered[2] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "5+6="}]
    # the second prompt holds the first turn, tokenized exactly as SFT trains a 2-turn conversation
    tok = ErnieTokenizer.from_pretrained(ckpt)
    conv = Conversation("be brief", [("1+2=", reply1), ("3+4=", "x")], [True, True])
    assert prompts[1] == prompt_ids(conv, tok)
    assert prompts[1][: len(prompts[0])] == prompts[0]


def test_eof_ends_the_session_over_a_pipe(ckpt):
    proc = _cli([ckpt, "--max-new-tokens", "4"], stdin="1+2=\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("User: 1+2=\nAssistant: ") and proc.stdout.count("User: ") == 2


@pytest.mark.parametrize("case", ["missing_dir", "no_tokenizer"])
def test_bad_model_dir_is_one_line_error(ckpt, tmp_path, case):
    path = tmp_path / "nope"
    if case == "no_tokenizer":
        path.mkdir()
        for name in ("config.json", "model.safetensors"):
            (path / name).write_bytes((Path(ckpt) / name).read_bytes())
    proc = _cli([str(path), "--prompt", "hi"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert ("not found" if case == "missing_dir" else "tokenizer") in lines[0]


def test_streaming_writes_pieces_and_holds_back_partial_characters(ckpt, monkeypatch):
    """Byte-fallback pieces of one character are printed together, never as U+FFFD."""
    from erniekit.infer.chat import ChatSession

    tok = ErnieTokenizer.from_pretrained(ckpt)
    text = "héllo 你好 😀"
    ids = tok.encode(text)
    assert len(ids) > len(text) - 2  # multi-byte characters really are several ids here
    monkeypatch.setattr(
        gen,
        "generate_stream",
        lambda model, ps, params, pad_id=0, vocab=None: iter([[i] for i in ids + [tok.sep_token_id]]),
    )

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes: list[str] = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    out = Recorder()
    params = SamplingParams(max_new_tokens=64, stop_token_ids=[tok.sep_token_id])
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=len(tok), max_position_embeddings=4096))  # scripted
    session = ChatSession(model, tok, params, out=out)
    assert session.reply("hi") == text
    assert "".join(out.writes) == text
    assert len(out.writes) >= 8 and not any("\ufffd" in w for w in out.writes)
    assert "你" in out.writes and "😀" in out.writes[-1]


def _cli_bytes(args: list[bytes], stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """_cli with raw bytes: arguments and input that are not UTF-8."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), LC_ALL="C.UTF-8")
    return subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"erniekit", b"chat", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_text_that_is_not_utf8_and_a_bad_seed_are_one_line_errors(ckpt):
    for args in ([b"--prompt", b"\xff\xfe x"], [b"--prompt", b"hi", b"--system", b"\xc3("], [b"--seed", b"-1"]):
        proc = _cli_bytes([os.fsencode(ckpt), *args])
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: chat: "), proc.stderr
        assert ("not UTF-8" in lines[0]) != (args[0] == b"--seed")


def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(ckpt):
    proc = _cli_bytes([os.fsencode(ckpt), b"--max-new-tokens", b"4"], stdin=b"\xff\xfe\n1+2=\n")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode().strip().splitlines()
    assert err == ["error: that line is not UTF-8 text; type it again"]
    out = proc.stdout.decode()  # the bad line is not echoed: stdout stays UTF-8
    assert out.count("Assistant: ") == 1 and out.startswith("User: User: 1+2=\nAssistant: ")


def test_replies_stop_at_the_context_and_an_overlong_history_leaves_it_as_it_was(ckpt, monkeypatch):
    """max_new_tokens is capped at what the model's positions leave after the prompt (it sized the
    KV cache: --max-new-tokens 10**6 took GBs); a prompt that fills them is one error, and the
    turn it belonged to is dropped."""
    from erniekit.errors import ErniekitError
    from erniekit.infer.chat import ChatSession, load_chat_model

    model, tok = load_chat_model(ckpt)
    asked: list[int] = []
    real_stream = gen.generate_stream

    def stream_spy(model, ps, params, pad_id=0, vocab=None):
        asked.append(params.max_new_tokens)
        return real_stream(model, ps, params, pad_id, vocab=vocab)

    monkeypatch.setattr(gen, "generate_stream", stream_spy)
    session = ChatSession(model, tok, SamplingParams(max_new_tokens=10**6), out=io.StringIO())
    taken: list[int] = []
    monkeypatch.setattr(session, "_emit", lambda text, tok, write: (text.push(tok), taken.append(len(text.ids))))
    first = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True)))
    model.config = model.config.replace(max_position_embeddings=first + 3)
    session.reply("1+2=")
    assert asked == [3] and 1 <= max(taken) <= 3
    before = ([dict(m) for m in session.messages], session._text, list(session._ids))
    with pytest.raises(ErniekitError, match=rf"conversation is \d+ tokens, the model's context is {first + 3}"):
        session.reply("4+5=")
    assert (session.messages, session._text, session._ids) == before
