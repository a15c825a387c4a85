"""Image preprocessing equal to transformers' Ernie4_5_VLMoeImageProcessorPil, bit for bit, on random
images of random sizes and modes; bad images are one-line errors naming the source."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from erniekit.errors import DataError
from erniekit.models.ernie4_5_vl.processor import (
    ImageError,
    ImageSettings,
    load_image,
    load_image_settings,
    preprocess_image,
    save_image_settings,
    smart_resize,
)

transformers = pytest.importorskip("transformers")


def _random_image(r, mode):
    h, w = (int(v) for v in r.integers(8, 400, 2))
    arr = r.integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    im = Image.fromarray(arr, "RGBA" if mode == "RGBA" else "RGB")
    return im.convert(mode) if mode in ("L", "P") else im


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_patches_equal_the_hub_processor(seed, mode):
    r = np.random.default_rng(seed)
    im = _random_image(r, mode)
    kw = {}
    settings = ImageSettings()
    if seed % 2:  # a small pixel budget: downscaling path
        settings = ImageSettings(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
        kw = {"size": {"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels}}
    want = transformers.Ernie4_5_VLMoeImageProcessorPil(**kw)(images=im, return_tensors="np")
    got, grid = preprocess_image(im, settings)
    np.testing.assert_array_equal(got, want["pixel_values"])
    np.testing.assert_array_equal(grid, want["image_grid_thw"])


def test_saved_image_settings_are_what_the_hub_processor_reads(tmp_path):
    """preprocessor_config.json round-trips through ours and configures transformers' processor to
    the same patches; a directory without one gets the hub processor's defaults."""
    settings = ImageSettings(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 9)
    save_image_settings(str(tmp_path), settings)
    assert load_image_settings(str(tmp_path)) == settings
    theirs = transformers.Ernie4_5_VLMoeImageProcessorPil.from_pretrained(str(tmp_path))
    im = Image.fromarray(np.random.default_rng(7).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    want = theirs(images=im, return_tensors="np")
    assert want["image_grid_thw"].prod() <= 9 * 4  # the saved budget, not the default one, was used
    got, grid = preprocess_image(im, load_image_settings(str(tmp_path)))
    np.testing.assert_array_equal(got, want["pixel_values"])
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    assert load_image_settings(str(tmp_path / "nowhere")) == ImageSettings()
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(DataError, match="preprocessor_config.json"):
        load_image_settings(str(tmp_path))


def test_smart_resize_keeps_the_budget_and_multiples():
    for h, w in [(10, 10), (3000, 4000), (57, 1000)]:
        rh, rw = smart_resize(h, w, 28, 56 * 56, 28 * 28 * 64)
        assert rh % 28 == 0 and rw % 28 == 0 and 56 * 56 <= rh * rw <= 28 * 28 * 64


def test_images_load_from_paths_and_data_uris_only(tmp_path):
    im = Image.fromarray(np.zeros((5, 7, 3), np.uint8))
    path = tmp_path / "a.png"
    im.save(path)
    assert load_image(str(path)).size == (7, 5)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert load_image(uri).size == (7, 5)
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image")
    cases = {
        str(tmp_path / "missing.png"): "not found",
        str(tmp_path / "empty.png"): "empty",
        str(tmp_path / "text.png"): "not a readable image",
        "https://example.com/cat.png": "local paths or data: URIs only",
        "data:image/png;base64,@@@": "does not decode",
    }
    for source, why in cases.items():
        with pytest.raises(ImageError, match=why) as e:
            load_image(source, where="data.jsonl:3")
        assert str(e.value).startswith("data.jsonl:3:") and "\n" not in str(e.value)


def test_a_huge_image_is_refused_before_decoding(tmp_path, monkeypatch):
    from erniekit.models.ernie4_5_vl import processor

    monkeypatch.setattr(processor, "MAX_SOURCE_PIXELS", 100)
    path = tmp_path / "big.png"
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(path)
    with pytest.raises(ImageError, match="more than 100"):
        load_image(str(path))


def test_a_data_uri_must_say_image_and_errors_name_no_file_object(tmp_path):
    """A data: URI of another type is refused even when its bytes are a picture; an unreadable
    payload's message names the URI, not a Python object's repr."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    payload = base64.b64encode(buf.getvalue()).decode()
    for head in ("data:text/plain;base64,", "data:;base64,", "data:application/octet-stream;base64,"):
        with pytest.raises(ImageError, match="is not an image; send data:image/") as e:
            load_image(head + payload, where="messages[0].content[0]")
        assert str(e.value).startswith("messages[0].content[0]:")
    assert load_image("data:IMAGE/jpeg;base64," + payload).size == (4, 4)  # the bytes say what they are
    with pytest.raises(ImageError, match="not a readable image") as e:
        load_image("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), where="w")
    assert "object at 0x" not in str(e.value) and "BytesIO" not in str(e.value)


def test_an_eps_picture_never_runs_ghostscript(monkeypatch):
    from PIL import EpsImagePlugin

    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs", raising=False)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"
    with pytest.raises(ImageError, match="not a readable image"):
        load_image("data:image/eps;base64," + base64.b64encode(eps).decode(), where="w")
    assert ran == []


@pytest.mark.parametrize("key", ["patch_size", "merge_size"])
def test_a_zero_patch_or_merge_size_in_the_processor_config_is_one_line(tmp_path, key):
    save_image_settings(str(tmp_path), ImageSettings())
    cfg = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**cfg, key: 0}))
    with pytest.raises(DataError, match=f"{key}=0 must be at least 1"):
        load_image_settings(str(tmp_path))


def test_special_files_are_refused_without_reading_them(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.png")  # opening it would block until a writer came
    for path in (str(tmp_path / "fifo.png"), "/dev/zero", str(tmp_path)):
        with pytest.raises(ImageError, match="is not a regular file"):
            load_image(path, where="w")
