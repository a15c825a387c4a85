"""A model that records the control attributes it was trained on (control_attributes.json;
docs/control.md): `erniekit chat --control` and the server refuse an attribute it never saw, or a
value never seen for a closed key, in one line with a did-you-mean; a model without the record
takes any attribute as before."""

from __future__ import annotations

import json
import os
import shutil

import paddle
import pytest

from erniekit.cli import main
from erniekit.data.control import CONTROL_RECORD_NAME, count_controls, write_control_record
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

RECORD = count_controls([{"style": "words"}, {"style": "digits"}, {"length": "short"}])


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    """An untrained tiny-moe checkpoint without a record (a base model, an older checkpoint)."""
    path = str(tmp_path_factory.mktemp("rec") / "plain")
    paddle.seed(0)
    save_pretrained(Ernie4_5ForCausalLM(get_preset("tiny-moe")), path, tokenizer=default_tokenizer())
    return path


@pytest.fixture(scope="module")
def recorded(plain, tmp_path_factory) -> str:
    """The same checkpoint with the record an SFT run on style / length controls writes."""
    path = str(tmp_path_factory.mktemp("rec") / "recorded")
    shutil.copytree(plain, path)
    write_control_record(path, RECORD)
    return path


def _chat(model_dir: str, *control: str) -> list[str]:
    flags = [x for c in control for x in ("--control", c)]
    return ["chat", model_dir, "--prompt", "12+30=", "--max-new-tokens", "3", *flags]


def test_chat_refuses_a_misspelled_attribute_before_loading_the_weights(tmp_path, capsys):
    only_record = tmp_path / "no-weights"  # the record alone: chat never reaches the weights
    only_record.mkdir()
    write_control_record(str(only_record), RECORD)
    assert main(_chat(str(only_record), "stlye=words")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--control stlye=words: this model was not trained with the attribute 'stlye' (did you mean 'style'?)" in err
    assert f"its attributes: length, style ({only_record}/{CONTROL_RECORD_NAME}; docs/control.md)" in err


def test_chat_refuses_an_untrained_value_and_answers_trained_ones(recorded, capsys):
    assert main(_chat(recorded, "style=wrods")) == 2
    err = capsys.readouterr().err
    assert "--control style=wrods: this model was trained on style = digits, words only (did you mean 'words'?)" in err
    assert main(_chat(recorded, "style=words", "length=short")) == 0
    assert capsys.readouterr().out.strip()


def test_a_damaged_record_stops_only_a_chat_that_gives_control(tmp_path, capsys):
    from erniekit.cli import _chat_parser, _check_control_flags

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / CONTROL_RECORD_NAME).write_text('{"version": 1, "attributes": []}')
    _check_control_flags(_chat_parser().parse_args([str(damaged), "--prompt", "hi"]))  # not read: no --control
    assert main(_chat(str(damaged), "style=words")) == 2
    assert "'attributes' must be an object" in capsys.readouterr().err


def test_without_a_record_chat_takes_any_attribute(plain, capsys):
    assert main(_chat(plain, "stlye=wrods")) == 0
    assert capsys.readouterr().out.strip()


def test_server_answers_400_for_an_untrained_attribute(recorded, plain, monkeypatch):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from starlette.testclient import TestClient

    answers: dict[str, list] = {}

    def serve(app, **_):  # instead of binding a port: the requests below, through the started app
        with TestClient(app) as http:
            for control in ({"stlye": "words"}, {"style": "wrods"}, {"style": "words"}):
                body = {"model": name, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
                r = http.post("/v1/chat/completions", json={**body, "control": control})
                answers.setdefault(name, []).append((r.status_code, r.json()))

    monkeypatch.setattr(uvicorn, "run", serve)
    for name in ("recorded", "plain"):
        assert main(["server", recorded if name == "recorded" else plain, "--served-model-name", name]) == 0
    (s1, typo), (s2, value), (s3, ok) = answers["recorded"]
    assert (s1, s2, s3) == (400, 400, 200)
    assert typo["error"]["param"] == "control" == value["error"]["param"]
    assert typo["error"]["message"] == (
        "control stlye=words: this model was not trained with the attribute 'stlye' (did you mean 'style'?); "
        "its attributes: length, style (docs/control.md)"
    )  # no server path in what a client reads
    assert "trained on style = digits, words only (did you mean 'words'?)" in value["error"]["message"]
    assert ok["choices"][0]["message"]["content"] is not None
    assert [s for s, _ in answers["plain"]] == [200, 200, 200]  # no record: any attribute, as before


def test_a_damaged_record_stops_the_server_before_loading(recorded, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONTROL_RECORD_NAME).write_text(json.dumps({"version": 1, "attributes": {"style": "words"}}))
    assert main(["server", str(broken)]) == 2  # no weights there: the record is read first
    err = capsys.readouterr().err
    assert f"{os.path.join(broken, CONTROL_RECORD_NAME)}: attributes.style must be" in err and err.count("\n") == 1


def test_the_credibility_report_refuses_untrained_controls_before_loading(tmp_path):
    """eval --credibility renders its data's controls: one the model never saw is refused, naming the
    record, before the weights (none here) are read."""
    from erniekit.errors import DataError
    from erniekit.infer.credibility_report import run_credibility_report

    only_record = tmp_path / "no-weights"
    only_record.mkdir()
    write_control_record(str(only_record), RECORD)
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps({"src": ["1+2="], "tgt": ["3"], "control": {"stlye": "words"}}) + "\n")
    with pytest.raises(DataError, match=rf"^{data}:1: control stlye=words: .*did you mean 'style'"):
        run_credibility_report(str(only_record), str(data), str(tmp_path / "out"), 10, 2, 4)
