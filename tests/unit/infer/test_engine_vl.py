"""The serving engine with a vision-language model: requests with images of different sizes,
several images, and text only, decoded together in one batch, each get the tokens greedy
generation gives it alone (erniekit/infer/vl_generate.py); a text model refuses images."""

from __future__ import annotations

import threading
import time

import numpy as np
import paddle
import pytest
from PIL import Image

from erniekit.infer.engine import Engine, complete
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.vl_generate import generate_vl
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
from erniekit.models.ernie4_5_vl.processor import ImageSettings, image_tokens, preprocess_image
from erniekit.models.registry import model_config

SETTINGS = ImageSettings(min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    m = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    m.eval()
    return m


def _image(rng, w: int, h: int):
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _request(model, rng, sizes: list[tuple[int, int]]):
    """A prompt of random text around images of the given sizes, and its (patches, grids)."""
    ids, patches, grids = [int(t) for t in rng.integers(5, 1000, size=3)], [], []
    for w, h in sizes:
        p, g = preprocess_image(_image(rng, w, h), SETTINGS)
        patches.append(p)
        grids.append(g)
        ids += image_tokens(g, model.config) + [int(t) for t in rng.integers(5, 1000, size=int(rng.integers(1, 6)))]
    return ids, ((np.concatenate(patches), np.concatenate(grids)) if sizes else None)


def _concurrently(engine, requests: list[tuple[list[int], int, dict]]) -> list[list[int]]:
    """The completion ids of (prompt, max_new_tokens, images / videos) requests sent at once from
    their own threads; the engine is closed afterwards."""
    out = [None] * len(requests)

    def run(i):
        ids, n, media = requests[i]
        out[i] = complete(engine, ids, SamplingParams(max_new_tokens=n), **media)[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    return out


def test_image_and_text_requests_decoded_together_get_their_single_request_tokens(model):
    rng = np.random.default_rng(1)
    shapes = [[(84, 84)], [(112, 56), (56, 56)], [], [(60, 100)], []]
    reqs = [_request(model, rng, s) for s in shapes]
    lengths = [9, 6, 11, 7, 5]
    ref = [
        generate_vl(model, ids, im, n, stop_ids=[], vocab=len(default_tokenizer()))
        for (ids, im), n in zip(reqs, lengths)
    ]
    engine = Engine(model, default_tokenizer(), max_batch=3, max_model_len=128)
    out = _concurrently(engine, [(ids, n, {"images": im}) for (ids, im), n in zip(reqs, lengths)])
    assert out == ref
    assert len({tuple(r) for r in ref}) == len(ref)  # the images change what is generated
    assert engine.steps < sum(lengths)  # decoded together


def test_an_image_request_to_a_text_model_is_refused():
    paddle.seed(0)
    text = Ernie4_5ForCausalLM(get_preset("tiny-dense"))
    engine = Engine(text, default_tokenizer(), max_batch=2, max_model_len=64)
    try:
        p, g = preprocess_image(_image(np.random.default_rng(0), 56, 56), SETTINGS)
        with pytest.raises(ValueError, match="reads no images"):
            complete(engine, [5, 6, 7], SamplingParams(max_new_tokens=2), images=(p, g))
    finally:
        engine.close()


def test_a_video_request_batched_with_an_image_request_gets_its_single_request_tokens(model):
    from erniekit.models.ernie4_5_vl.video import VideoSettings, preprocess_video, video_tokens

    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    patches, grid = preprocess_video(frames, None, VideoSettings(min_pixels=56 * 84, max_pixels=56 * 84))
    video_ids = [7, 8] + video_tokens(grid, model.config) + [9, 10, 11]
    image_ids, images = _request(model, rng, [(84, 84)])
    ref_video = generate_vl(
        model, video_ids, None, 8, stop_ids=[], videos=(patches, grid), vocab=len(default_tokenizer())
    )
    ref_image = generate_vl(model, image_ids, images, 8, stop_ids=[], vocab=len(default_tokenizer()))
    engine = Engine(model, default_tokenizer(), max_batch=2, max_model_len=128)
    out = _concurrently(engine, [(video_ids, 8, {"videos": (patches, grid)}), (image_ids, 8, {"images": images})])
    assert out == [ref_video, ref_image]


@pytest.fixture()
def http(model, tmp_path):
    """The OpenAI server in this process on the tiny VL model, local media under tmp_path."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from erniekit.infer.server import OpenAIServer, build_app
    from erniekit.models.ernie4_5_vl.video import VideoSettings

    model.image_settings = SETTINGS
    model.video_settings = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=2, max_frames=4)
    tok = default_tokenizer()
    engine = Engine(model, tok, max_batch=2, max_model_len=256, stop_token_ids=[])
    server = OpenAIServer(engine, tok, "m", local_media_root=str(tmp_path))
    with TestClient(build_app(server)) as c:
        c.server = server
        yield c
    engine.close()


def _png_uri(mime: str = "image/png", size: int = 56) -> str:
    import base64
    import io

    buf = io.BytesIO()
    _image(np.random.default_rng(size), size, size).save(buf, format="PNG")
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def test_hostile_media_parts_are_400s_naming_the_part(http, tmp_path, monkeypatch):
    """What a client must not make the server do (a NUL in a path, a data: URI that is not an
    image, more decoded pixels than a request may hold, a video without frames) is a one-line 400
    naming the part, and the server keeps serving."""
    from erniekit.models.ernie4_5_vl import processor

    av = pytest.importorskip("av")
    with av.open(str(tmp_path / "none.avi"), "w") as out:  # a video stream without a frame
        stream = out.add_stream("mpeg4", rate=6)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        out.start_encoding()
    monkeypatch.setattr(processor, "MAX_REQUEST_PIXELS", 2 * 56 * 56 - 1, raising=False)  # two 56x56: one too many

    def post(*parts):
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is it?"}]}]
        return http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    cases = [
        ((image(str(tmp_path) + "/a\x00.png"),), "messages[0].content[0]", "NUL"),
        (({"type": "video_url", "video_url": {"url": "file://" + str(tmp_path) + "/\x00"}},), "[0]", "NUL"),
        ((image(_png_uri("text/plain")),), "messages[0].content[0]", "is not an image"),
        ((image(_png_uri()), image(_png_uri())), "messages[0].content[1].image_url.url", "images total 6272 pixels"),
        (({"type": "video_url", "video_url": {"url": str(tmp_path / "none.avi")}},), "[0]", "none.avi: the video"),
    ]
    for parts, param, words in cases:
        r = post(*parts)
        err = r.json()["error"]
        assert r.status_code == 400 and words in err["message"], (words, r.status_code, err)
        assert param in err["param"] and "\n" not in err["message"]
    assert post(image(_png_uri())).status_code == 200


def _post(http, *parts):
    """Greedy: the tiny VL model has 8 ids past the bundled tokenizer's 1024, and a reply sampled
    from fresh entropy now and then drew one, which the tokenizer cannot decode (a 500)."""
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is it?"}]}]
    body = {"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0}
    return http.post("/v1/chat/completions", json=body)


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_media_decoding_is_bounded_across_requests(http, monkeypatch):
    """At most MEDIA_REQUESTS_AT_ONCE requests hold decoded media: with every slot taken, an image
    request waits for one (up to MEDIA_WAIT_S), then is a one-line 503; text requests never wait;
    every request gives its slot back, refused ones too."""
    from erniekit.infer import server as srv

    slots, n = http.server._media_slots, srv.MEDIA_REQUESTS_AT_ONCE
    monkeypatch.setattr(srv, "MEDIA_WAIT_S", 0.05)
    assert all(slots.acquire(blocking=False) for _ in range(n))  # n other requests decoding
    try:
        r = _post(http, _image_part(_png_uri()))
        err = r.json()["error"]
        assert r.status_code == 503 and err["type"] == "server_error" and err["code"] == "server_busy", err
        assert err["param"] == "messages[0].content[0]" and "\n" not in err["message"]
        assert _post(http).status_code == 200  # text only: no slot
        monkeypatch.setattr(srv, "MEDIA_WAIT_S", 120.0)
        # image requests waiting for a slot wait on the event loop, not in the worker threads that
        # parse every request: more of them than there are threads, and a text request still passes
        # (behind them, it would pass only once they gave up, with 503s, after MEDIA_WAIT_S)
        replies: list = []
        waiting = [
            threading.Thread(target=lambda: replies.append(_post(http, _image_part(_png_uri())))) for _ in range(10)
        ]
        for t in waiting:
            t.start()
        time.sleep(0.5)
        r = _post(http)
        assert r.status_code == 200, r.text
        assert replies == []  # they are still waiting
        slots.release()  # one of them finishes: the waiting requests run, one at a time
        for t in waiting:
            t.join(60)
        assert [r.status_code for r in replies] == [200] * 10, [r.text for r in replies if r.status_code != 200]
    finally:
        for _ in range(n - 1):
            slots.release()
    assert _post(http, _image_part("data:image/png;base64,@@")).status_code == 400
    assert _post(http, _image_part(_png_uri())).status_code == 200
    assert all(slots.acquire(blocking=False) for _ in range(n))  # all given back
    for _ in range(n):
        slots.release()


def test_file_urls_are_percent_decoded_and_checked_decoded(http, tmp_path):
    """file:///dir/a%20b.png names `a b.png` (a plain path is taken as it is); NUL, `..` and
    symlinks out of --allowed-local-media-path are refused after decoding."""
    import urllib.parse

    rng = np.random.default_rng(3)
    for name in ("a b.png", "c%20d.png"):
        _image(rng, 56, 56).save(tmp_path / name)
    _image(rng, 56, 56).save(tmp_path.parent / "secret.png")
    (tmp_path / "l n.png").symlink_to(tmp_path.parent / "secret.png")
    url = "file://" + urllib.parse.quote(str(tmp_path))
    assert _post(http, _image_part(url + "/a%20b.png")).status_code == 200
    assert _post(http, _image_part(str(tmp_path / "c%20d.png"))).status_code == 200
    for bad, words in [
        (url + "/a%00.png", "NUL"),
        (url + "/%2E%2E/secret.png", "outside --allowed-local-media-path"),
        (url + "/l%20n.png", "outside --allowed-local-media-path"),
        (str(tmp_path / "a%20b.png"), "not found"),
    ]:
        r = _post(http, _image_part(bad))
        assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.json())


def test_a_vl_prompt_past_the_models_context_is_one_line_not_a_reply():
    """`erniekit chat --image` (vl_generate.answer) refuses a prompt whose images fill the model's
    context, as the text chat does, instead of decoding at positions it never saw."""
    from erniekit.data.formats import IMAGE_MARKER, Conversation
    from erniekit.errors import DataError
    from erniekit.infer.vl_generate import answer

    paddle.seed(0)
    small = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(max_position_embeddings=16))
    conv = Conversation(
        None, [(IMAGE_MARKER + "what is it?", "")], [True], "chat", [_image(np.random.default_rng(0), 112, 112)]
    )
    with pytest.raises(
        DataError, match=r"^chat: the prompt with its images and videos is \d+ tokens, the model's context is 16;"
    ):
        answer(small, default_tokenizer(), conv, SETTINGS, 4)
