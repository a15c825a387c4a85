"""Vision-language data: OpenAI image_url parts and ERNIEKit's image_info / text_info records, their
encoding (image tokens in place, never trained), and one-line errors naming file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from erniekit.data.formats import IMAGE_MARKER, load_sft_examples
from erniekit.data.vl import collate_images, encode_vl_conversation
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.configuration import PRESETS
from erniekit.models.ernie4_5_vl.processor import ImageSettings

CFG = PRESETS["tiny-vl"]
SMALL = ImageSettings(min_pixels=28 * 28, max_pixels=56 * 56)


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


@pytest.fixture
def picture(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 60, 3), dtype=np.uint8)).save(tmp_path / "p.png")
    return "p.png"  # relative to the data file


def test_openai_image_parts_become_markers_and_sources(tmp_path, picture):
    rec = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "Colour?"}],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    (conv,) = load_sft_examples(_write(tmp_path, [rec]))
    assert conv.turns == [(IMAGE_MARKER + "Colour?", "red")]
    assert conv.images == [str(tmp_path / picture)]


def test_erniekit_vl_records_group_prompts_and_replies(tmp_path, picture):
    rec = {
        "image_info": [
            {"image_url": picture, "matched_text_index": 0},
            {"image_url": picture, "matched_text_index": 2},
        ],
        "text_info": [
            {"text": "What is it?", "tag": "mask"},
            {"text": "A cat.", "tag": "no_mask"},
            {"text": "And this?", "tag": "mask"},
            {"text": "A dog.", "tag": "no_mask"},
        ],
    }
    (conv,) = load_sft_examples(_write(tmp_path, [rec]))
    assert conv.turns == [(IMAGE_MARKER + "What is it?", "A cat."), (IMAGE_MARKER + "And this?", "A dog.")]
    assert len(conv.images) == 2


@pytest.mark.parametrize(
    "rec, why",
    [
        ({"text_info": [{"text": "x", "tag": "no_mask"}]}, "starts with a reply"),
        ({"text_info": [{"text": "x", "tag": "mask"}]}, "ends with a prompt"),
        ({"text_info": [{"text": "x", "tag": "other"}]}, "text_info\\[0\\]"),
        (
            {
                "image_info": [{"image_url": "a.png", "matched_text_index": 5}],
                "text_info": [{"text": "x", "tag": "mask"}],
            },
            "matched_text_index",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "a"}]},
            "content\\[0\\]",
        ),
    ],
)
def test_malformed_records_are_one_line_errors_with_file_and_line(tmp_path, rec, why):
    path = _write(tmp_path, [rec])
    with pytest.raises(DataError, match=why) as e:
        load_sft_examples(path)
    assert f"{path}:1" in str(e.value) and "\n" not in str(e.value)


def test_encoding_puts_image_tokens_in_place_and_trains_only_the_reply(tmp_path, picture):
    rec = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": picture}}],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    (conv,) = load_sft_examples(_write(tmp_path, [rec]))
    row = encode_vl_conversation(conv, default_tokenizer(), CFG, SMALL, 128)
    ids, labels = row["input_ids"], row["labels"]
    patches, grids = row["images"]
    n = int(grids.prod() // 4)
    start = int(np.nonzero(ids == CFG.image_start_token_id)[0][0])
    assert (
        ids[start + 1 : start + 1 + n].tolist() == [CFG.image_token_id] * n
        and ids[start + 1 + n] == CFG.image_end_token_id
    )
    assert (labels[start : start + n + 2] == -100).all()
    assert patches.shape == (int(grids.prod()), 588)
    assert default_tokenizer().decode([t for t in labels if t >= 0]).startswith("red")
    pixels, g = collate_images(np.array([row["images"], None, row["images"]], dtype=object))
    assert pixels.shape[0] == 2 * patches.shape[0] and g.shape == (2, 3)


def test_images_are_numbered_pictures_across_the_conversation(tmp_path, picture):
    """As the hub chat template renders image parts: "Picture N:" before each image's tokens, N
    counting the images of the whole conversation."""
    two = [{"type": "image_url", "image_url": {"url": picture}}] * 2
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, *two]},
            {"role": "assistant", "content": "b"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "c"}],
            },
            {"role": "assistant", "content": "d"},
        ]
    }
    (conv,) = load_sft_examples(_write(tmp_path, [rec]))
    ids = encode_vl_conversation(conv, default_tokenizer(), CFG, SMALL, 256)["input_ids"].tolist()
    text = default_tokenizer().decode([t for t in ids if t < 1024])
    starts = [i for i, t in enumerate(ids) if t == CFG.image_start_token_id]
    assert len(starts) == 3
    for n, i in enumerate(starts, 1):  # the text just before each image is "Picture N:"
        assert default_tokenizer().decode(ids[max(0, i - 6) : i]).endswith(f"Picture {n}:"), text


def _bad_image(tmp_path, kind: str) -> str:
    if kind == "not an image":
        (tmp_path / "bad.png").write_text("nope")
    elif kind == "empty":
        (tmp_path / "bad.png").write_bytes(b"")
    elif kind == "aspect ratio":
        Image.new("RGB", (600, 2)).save(tmp_path / "bad.png")
    elif kind == "huge":
        Image.new("1", (9000, 9000)).save(tmp_path / "bad.png")  # 1 bit a pixel: a small file
    return "bad.png"  # "missing": never written


@pytest.mark.parametrize(
    "kind, why",
    [
        ("not an image", "not a readable image"),
        ("missing", "not found"),
        ("empty", "is empty"),
        ("aspect ratio", "aspect ratio above 200"),
        ("huge", "downscale it first"),
    ],
)
def test_a_bad_image_names_the_file_and_line(tmp_path, kind, why):
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _bad_image(tmp_path, kind)}}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    path = _write(tmp_path, [rec, rec])
    convs = load_sft_examples(path)
    with pytest.raises(DataError, match=why) as e:
        encode_vl_conversation(convs[1], default_tokenizer(), CFG, SMALL, 128)
    assert str(e.value).startswith(f"{path}:2:") and "\n" not in str(e.value)
