"""`erniekit server` on a vision-language checkpoint, through the official `openai` client:
image_url parts (data: URIs; local files only under --allowed-local-media-path) and video_url parts
(files under that directory) reach the model (each reply equals greedy generation with that
picture, and different pictures give different replies); what the server must not read is
refused with one-line 400s naming the part."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import numpy as np
import paddle
import pytest
from launched_jobs import free_port, serve
from media_files import moving_square, write_mp4
from PIL import Image

from erniekit.data.formats import IMAGE_MARKER, Conversation
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
from erniekit.models.ernie4_5_vl.processor import ImageSettings
from erniekit.models.ernie4_5_vl.video import VideoSettings
from erniekit.models.registry import model_config, save_model

openai = pytest.importorskip("openai")
ROOT = str(Path(__file__).resolve().parents[2])
MODEL = "tiny-vl-test"


def _png(seed: int, w: int = 84, h: int = 84) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("srvvl")
    ckpt, media = str(root / "ckpt"), root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(_png(5))
    (root / "secret.png").write_bytes(_png(6))
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    model.image_settings = ImageSettings(min_pixels=56 * 56, max_pixels=112 * 112)  # saved with it
    model.video_settings = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=2, max_frames=6)
    save_model(model, ckpt, tokenizer=default_tokenizer())
    write_mp4(media / "clip.mp4", moving_square(6, 64, 64), 6)  # the square moves right
    write_mp4(media / "back.mp4", moving_square(6, 64, 64)[::-1], 6)  # and left
    write_mp4(root / "outside.mp4", moving_square(6, 64, 64), 6)
    return ckpt, str(media), str(root)


@pytest.fixture(scope="module")
def live(dirs):
    ckpt, media, _ = dirs
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["server", ckpt, "--port", str(port), "--max-model-len", "256", "--served-model-name", MODEL]
    yield from (base for _ in serve(args + ["--allowed-local-media-path", media], base + "/health", ROOT))


def _reference(ckpt: str, text: str, images: list[str], max_tokens: int) -> str:
    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.vl_generate import answer

    model, tok = load_chat_model(ckpt)
    assert model.image_settings.max_pixels == 112 * 112  # read back from preprocessor_config.json
    conv = Conversation(None, [(IMAGE_MARKER * len(images) + text, "")], [True], "ref", images)
    return answer(model, tok, conv, model.image_settings, max_tokens)


def _message(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def _video_message(url: str, n: int = 1) -> dict:
    return {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}] * n}


def test_image_url_parts_reach_the_model(live, dirs):
    ckpt, media, _ = dirs
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)
    replies = []
    for urls in ([_uri(_png(1))], [_uri(_png(2, 112, 56)), _uri(_png(3))], [os.path.join(media, "a.png")]):
        r = client.chat.completions.create(
            model=MODEL, messages=_message("what is it?", *urls), max_tokens=6, temperature=0
        )
        got = r.choices[0].message.content
        assert got == _reference(ckpt, "what is it?", urls, 6)
        assert r.usage.prompt_tokens > 9  # the image's placeholder tokens count
        replies.append(got)
    assert len(set(replies)) == len(replies)  # the pictures change the answer
    stream = client.chat.completions.create(
        model=MODEL, messages=_message("what is it?", _uri(_png(1))), max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == replies[0]


def test_video_url_parts_under_the_allowed_directory_reach_the_model(live, dirs):
    from erniekit.data.formats import VIDEO_MARKER
    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.vl_generate import answer
    from erniekit.models.ernie4_5_vl.video import load_video

    ckpt, media, _ = dirs
    model, tok = load_chat_model(ckpt)
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)
    replies = []
    for name in ("clip.mp4", "back.mp4"):
        part = {"type": "video_url", "video_url": {"url": os.path.join(media, name)}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "where does it go?"}]}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        video = load_video(os.path.join(media, name), settings=model.video_settings)
        conv = Conversation(None, [(VIDEO_MARKER + "where does it go?", "")], [True], "ref", [], [video])
        assert r.choices[0].message.content == answer(model, tok, conv, model.image_settings, 6)
        replies.append(r.choices[0].message.content)
    assert replies[0] != replies[1]  # the frames' order is read


def test_images_the_server_must_not_read_are_refused(live, dirs):
    import urllib.error
    import urllib.request

    _, media, root = dirs

    def post(messages):
        # greedy: a sampled reply may draw one of the tiny VL model's 8 ids the bundled tokenizer lacks
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(
            live + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    cases = [
        (_message("x", "https://example.com/cat.png"), "network"),
        (_message("x", os.path.join(root, "secret.png")), "outside --allowed-local-media-path"),
        (_message("x", os.path.join(media, "..", "secret.png")), "outside --allowed-local-media-path"),
        (_message("x", "data:image/png;base64,@@@"), "does not decode"),
        (_message("x", "data:image/png;base64," + base64.b64encode(b"not a png").decode()), "not a readable image"),
        (_message("x", *[_uri(_png(1))] * 9), "more than 8 images"),
        (
            [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _uri(_png(1))}}]}],
            "user messages",
        ),
        (_message("x", os.path.join(media, "missing.png")), "not found"),
        ([_video_message(os.path.join(root, "outside.mp4"))], "outside --allowed-local-media-path"),
        ([_video_message("data:video/mp4;base64,AAAA")], "must name a video file"),
        ([_video_message(os.path.join(media, "clip.mp4"), 3)], "more than 2 videos"),
    ]
    for messages, words in cases:
        status, err = post(messages)
        assert status == 400 and words in err["error"]["message"], (words, err)
        assert err["error"]["param"].startswith("messages[0].content[")
        assert "\n" not in err["error"]["message"]
    assert post(_message("x", _uri(_png(1))))[0] == 200  # and it keeps serving
