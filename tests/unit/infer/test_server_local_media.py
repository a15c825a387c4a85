"""A vision-language server started without --allowed-local-media-path reads no local file: image
and video parts naming a path or a file:// URL, even one that exists, are one-line 400s that name
the part and say how to send the picture instead; data: URIs are served."""

from __future__ import annotations

import base64

import numpy as np
import paddle
import pytest
from PIL import Image

from erniekit.infer.engine import Engine
from erniekit.infer.stops import stop_ids
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
from erniekit.models.ernie4_5_vl.processor import ImageSettings
from erniekit.models.registry import model_config

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from erniekit.infer.server import OpenAIServer, build_app  # noqa: E402

MODEL = "m"


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("media") / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def http():
    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl"))
    model.image_settings = ImageSettings(min_pixels=56 * 56, max_pixels=56 * 56)
    model.eval()
    tok = default_tokenizer()
    engine = Engine(model, tok, max_batch=2, max_model_len=128, stop_token_ids=stop_ids(model, tok))
    with TestClient(build_app(OpenAIServer(engine, tok, MODEL))) as c:  # no local_media_root
        yield c
    engine.close()


def _post(http, part: dict):
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]
    # greedy: a sampled reply may draw one of the tiny VL model's 8 ids the bundled tokenizer lacks (a 500)
    return http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    )


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_local_pictures_and_videos_are_refused_without_the_flag(http, picture, scheme):
    for part, instead in (
        ({"type": "image_url", "image_url": {"url": scheme + picture}}, "data:image/...;base64"),
        ({"type": "video_url", "video_url": {"url": scheme + picture}}, "--allowed-local-media-path"),
    ):
        r = _post(http, part)
        err = r.json()["error"]
        assert r.status_code == 400, err
        assert "local files are read only when the server runs with --allowed-local-media-path" in err["message"]
        assert instead in err["message"] and "\n" not in err["message"]
        assert err["param"].startswith("messages[0].content[0]")


def test_a_data_uri_is_served(http, picture):
    with open(picture, "rb") as f:
        uri = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    r = _post(http, {"type": "image_url", "image_url": {"url": uri}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 4  # the picture's placeholder tokens count
