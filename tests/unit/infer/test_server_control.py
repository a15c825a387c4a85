"""The server's `control` field (the openai client's extra_body; docs/control.md): the prompt is the
chat template over the messages with the control prefix, exactly as `erniekit chat --control` and
SFT render it; malformed values are one-line 400s naming `control`."""

from __future__ import annotations

import paddle
import pytest

from erniekit.data.control import with_control
from erniekit.infer.chat import chat_prompt_ids
from erniekit.infer.engine import Engine
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.stops import stop_ids
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from erniekit.infer.server import OpenAIServer, build_app  # noqa: E402

MODEL = "m"


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.5))
    m.eval()
    return m


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def http(model, tok):
    engine = Engine(model, tok, max_batch=4, max_model_len=128, stop_token_ids=stop_ids(model, tok))
    with TestClient(build_app(OpenAIServer(engine, tok, MODEL))) as c:
        yield c
    engine.close()


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


@pytest.mark.parametrize("system", [None, "Answer briefly."])
def test_extra_body_control_renders_the_prefix_the_model_was_trained_on(client, model, tok, system):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "12+30="}]
    control = {"style": "words", "length": "short"}
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=8, extra_body={"control": control}
    )
    ids = chat_prompt_ids(tok, with_control(msgs, control))
    assert "<control>length=short; style=words</control>" in tok.decode(ids)
    assert r.usage.prompt_tokens == len(ids)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids(model, tok))
    want = tok.decode(generate(model, [ids], params, pad_id=tok.pad_token_id)[0])
    assert r.choices[0].message.content == want
    plain = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    assert plain.usage.prompt_tokens == len(chat_prompt_ids(tok, msgs)) < len(ids)


@pytest.mark.parametrize(
    "control, what",
    [
        ("words", "must be an object"),
        ({"style": 1}, "control.style must be a non-empty string"),
        ({"style": "a\nb"}, "without ; = < > or line breaks"),
        ({"bad key": "x"}, "control key 'bad key'"),
        ({f"k{i}": "v" for i in range(20)}, "at most 8"),
    ],
)
def test_a_bad_control_is_a_one_line_400(http, control, what):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "control": control}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "control" and what in err["message"] and "\n" not in err["message"]


def test_control_is_a_chat_option(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 2, "control": {"a": "b"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "control"
    assert "chat/completions" in r.json()["error"]["message"]
