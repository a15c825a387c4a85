"""The serving engine with a vision-language model: requests with images of different sizes,
several images, and text only, decoded together in one batch, each get the tokens greedy
generation gives it alone (erniekit/infer/vl_generate.py); a text model refuses images."""

from __future__ import annotations

import threading

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
    ref = [generate_vl(model, ids, im, n, stop_ids=[]) for (ids, im), n in zip(reqs, lengths)]
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
    ref_video = generate_vl(model, video_ids, None, 8, stop_ids=[], videos=(patches, grid))
    ref_image = generate_vl(model, image_ids, images, 8, stop_ids=[])
    engine = Engine(model, default_tokenizer(), max_batch=2, max_model_len=128)
    out = _concurrently(engine, [(video_ids, 8, {"videos": (patches, grid)}), (image_ids, 8, {"images": images})])
    assert out == [ref_video, ref_image]
