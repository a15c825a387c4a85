"""ERNIE-4.5-VL videos (erniekit/models/ernie4_5_vl/video.py): frame sampling as transformers'
video processor computes it (torch.arange of float32 steps), timestamps, the patch layout against a
naive loop and against the image processor on still frames, decoding a real file with PyAV (only
the sampled frames kept), video parts in data, and `erniekit chat --video` using the video."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from media_files import moving_square, write_mp4

from erniekit.errors import DataError
from erniekit.models.ernie4_5_vl.processor import ImageSettings, preprocess_image
from erniekit.models.ernie4_5_vl.video import (
    PreparedFrames,
    VideoSettings,
    load_video,
    load_video_settings,
    preprocess_video,
    resize_frame,
    sample_frame_indices,
    save_video_settings,
    timestamp_text,
)

torch = pytest.importorskip("torch")


def _reference_indices(total, video_fps, fps, lo, hi):
    """transformers' Ernie4_5_VLMoeVideoProcessor.sample_frames, written out."""
    n = total / video_fps * fps if fps is not None else total
    n = min(max(n, lo), hi, total)
    return torch.arange(0, total, total / n).int().numpy()


@pytest.mark.parametrize("total", [1, 5, 16, 17, 31, 179, 180, 181, 997, 4001])
@pytest.mark.parametrize("fps", [None, 0.5, 2.0, 3.7])
def test_frame_sampling_matches_the_reference(total, fps):
    s = VideoSettings(fps=fps, min_frames=16, max_frames=180)
    got = sample_frame_indices(total, 29.97, s)
    np.testing.assert_array_equal(got, _reference_indices(total, 29.97, fps, 16, 180))
    assert len(got) == len(set(got.tolist())) and got.max() < total


def test_timestamps_read_hours_minutes_seconds():
    assert timestamp_text(0.0) == "time: 00:00:00.00"
    assert timestamp_text(3723.456) == "time: 01:02:03.46"
    assert timestamp_text(59.999) == "time: 00:00:60.00"  # the reference's rounding, kept


def test_patches_follow_frame_then_merge_block_order():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)  # odd: the last frame is repeated
    s = VideoSettings(min_pixels=56 * 84, max_pixels=56 * 84)
    patches, grid = preprocess_video(frames, None, s)
    assert grid.tolist() == [[4, 4, 6]] and patches.shape == (4 * 4 * 6, 3 * 14 * 14)
    x = np.concatenate([frames, frames[-1:]]).astype(np.float32)
    x = (x - np.float32(255) * np.array([0.48145466, 0.4578275, 0.40821073], np.float32)) / (
        np.float32(255) * np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
    )
    rows = []
    for t in range(4):  # frame, merge-block row, merge-block column, row in block, column in block
        for bi in range(2):
            for bj in range(3):
                for i in range(2):
                    for j in range(2):
                        r, c = (2 * bi + i) * 14, (2 * bj + j) * 14
                        rows.append(x[t, r : r + 14, c : c + 14].transpose(2, 0, 1).reshape(-1))
    np.testing.assert_allclose(patches, np.stack(rows), rtol=0, atol=1e-6)


def test_still_frames_give_the_image_processors_patches():
    """Two copies of a picture: each frame's patches are the image's in the same layout. Not
    bit-equal: the image processor resizes with Pillow, the video processor as torch does (their
    fixed-point bicubic weights differ by a level on under 2% of values), and video normalisation
    is fused."""
    from PIL import Image

    im = Image.fromarray(np.random.default_rng(1).integers(0, 256, (90, 130, 3), dtype=np.uint8))
    img, g = preprocess_image(im, ImageSettings(min_pixels=3136, max_pixels=28 * 28 * 12))
    vid, vg = preprocess_video(
        np.stack([np.asarray(im)] * 2), None, VideoSettings(min_pixels=3136, max_pixels=28 * 28 * 12)
    )
    assert vg.tolist() == [[2, *g[0, 1:].tolist()]]
    n = img.shape[0]
    level = 1 / (255 * 0.2613)  # one of 255 levels, normalised by the smallest std
    for frame in (vid[:n], vid[n:]):
        diff = np.abs(frame - img)
        assert diff.max() < 2.01 * level and (diff > 1e-5).mean() < 0.02


def test_a_video_file_decodes_to_its_sampled_frames(tmp_path):
    frames = moving_square(40)
    write_mp4(tmp_path / "v.mp4", frames, 10)
    s = VideoSettings(fps=2.0, min_frames=4, max_frames=180, min_pixels=56 * 84, max_pixels=56 * 84)
    got, times = load_video(str(tmp_path / "v.mp4"), settings=s)
    want = sample_frame_indices(40, 10.0, VideoSettings(fps=2.0, min_frames=4))
    assert len(got) == len(want) == 8 and np.allclose(times, want / 10.0)
    for g, i in zip(got, want):  # lossy codec: the frame is the one sampled (resized), within compression error
        assert np.abs(g.astype(int) - resize_frame(frames[i], 56, 84)).mean() < 8
    with pytest.raises(DataError, match="not found"):
        load_video(str(tmp_path / "missing.mp4"))
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(DataError, match="not a readable video"):
        load_video(str(tmp_path / "bad.mp4"))


def _font() -> str:
    import matplotlib  # its DejaVu Sans, as the reference test stamps with

    return os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")


def _decoded_whole(path) -> np.ndarray:
    """Every frame of a video at full resolution, as load_video kept them before it resized them."""
    av = pytest.importorskip("av")
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


@pytest.mark.parametrize("stamped", [False, True])
def test_a_video_is_held_at_the_models_size_and_gives_the_same_patches(tmp_path, stamped):
    """load_video stamps and resizes each kept frame as it decodes it (4K frames are not held):
    the patches equal preprocessing the full-resolution frames, stamped at full resolution."""
    write_mp4(tmp_path / "v.mp4", moving_square(11, 120, 200), 5)
    s = VideoSettings(min_pixels=3136, max_pixels=28 * 28 * 8, min_frames=4, font=_font() if stamped else None)
    frames, times = load_video(str(tmp_path / "v.mp4"), settings=s)
    assert isinstance(frames, PreparedFrames) and frames.shape == (11, 56, 84, 3)  # not 120 x 200
    whole = _decoded_whole(tmp_path / "v.mp4")
    got, want = preprocess_video(frames, times, s), preprocess_video(whole, times, s)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    again = pickle.loads(pickle.dumps(frames))  # what a worker process would receive
    assert again.settings == s and np.array_equal(preprocess_video(again, times, s)[0], want[0])
    with pytest.raises(DataError, match="decoded for other video settings"):
        preprocess_video(frames, times, VideoSettings(min_pixels=3136, max_pixels=3136))


def test_a_video_without_a_frame_count_is_decoded_once(tmp_path, monkeypatch):
    """A Matroska header gives no frame count: packets are counted without decoding, then the
    frames are decoded once (they were decoded twice); the frames equal the mp4's, also when the
    packet count was wrong."""
    av = pytest.importorskip("av")
    frames = moving_square(24, 56, 84)
    write_mp4(tmp_path / "v.mkv", frames, 8)
    write_mp4(tmp_path / "v.mp4", frames, 8)
    decoded, real_open, doubled = [], av.open, False

    class Counting:
        def __init__(self, c):
            self.c = c

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.c.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.c, name)

        def demux(self, *a, **k):  # packets doubled: a codec whose packets are not one frame each
            for packet in self.c.demux(*a, **k):
                yield from [packet] * (1 + doubled)

        def decode(self, *a, **k):
            for f in self.c.decode(*a, **k):
                decoded.append(f.pts)
                yield f

    monkeypatch.setattr(av, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    s = VideoSettings(min_pixels=56 * 84, max_pixels=56 * 84, min_frames=4, max_frames=10)
    got, times = load_video(str(tmp_path / "v.mkv"), settings=s)
    assert real_open(str(tmp_path / "v.mkv")).streams.video[0].frames == 0 and len(decoded) == 24
    want, want_times = load_video(str(tmp_path / "v.mp4"), settings=s)
    np.testing.assert_array_equal(times, want_times)
    np.testing.assert_array_equal(got, want)
    doubled = True  # 48 packets, 24 frames: found while decoding, sampled again from the frames decoded
    again, again_times = load_video(str(tmp_path / "v.mkv"), settings=s)
    np.testing.assert_array_equal(again_times, want_times)
    np.testing.assert_array_equal(again, want)


def test_video_parts_in_data_become_numbered_videos(tmp_path):
    from erniekit.data.formats import load_sft_examples
    from erniekit.data.vl import encode_vl_conversation
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.models.ernie4_5_vl.configuration import PRESETS

    write_mp4(tmp_path / "v.mp4", moving_square(6), 3)
    rec = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": "v.mp4"}}, {"type": "text", "text": "where?"}],
            },
            {"role": "assistant", "content": "right"},
        ]
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    (conv,) = load_sft_examples(str(tmp_path / "d.jsonl"))
    assert conv.videos == [str(tmp_path / "v.mp4")] and conv.images == []
    cfg = PRESETS["tiny-vl"]
    vs = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 84, min_frames=1)
    row = encode_vl_conversation(conv, default_tokenizer(), cfg, ImageSettings(), 512, vs)
    patches, grid = row["videos"]
    assert row["images"] is None and grid.tolist() == [[6, 4, 6]]
    ids = row["input_ids"].tolist()
    assert ids.count(cfg.video_token_id) == 6 // 2 * 2 * 3  # two frames x 2x2 patches per token
    start = ids.index(cfg.video_start_token_id)
    assert default_tokenizer().decode(ids[:start]).endswith("Video 1:")


def test_chat_answers_about_a_video(tmp_path, capsys):
    import paddle

    from erniekit.cli import main
    from erniekit.data.formats import VIDEO_MARKER, Conversation
    from erniekit.infer.vl_generate import answer
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.registry import load_model, model_config, save_model

    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    model.video_settings = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=4, max_frames=8)
    save_model(model, str(tmp_path / "m"), tokenizer=default_tokenizer())
    write_mp4(tmp_path / "a.mp4", moving_square(16, 56, 56), 8)
    write_mp4(tmp_path / "b.mp4", moving_square(16, 56, 56)[::-1], 8)
    replies = []
    for name in ("a.mp4", "b.mp4"):
        assert (
            main(
                [
                    "chat",
                    str(tmp_path / "m"),
                    "--video",
                    str(tmp_path / name),
                    "--prompt",
                    "what moves?",
                    "--max-new-tokens",
                    "6",
                ]
            )
            == 0
        )
        replies.append(capsys.readouterr().out.strip())
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.video_settings == model.video_settings  # video_preprocessor_config.json read back
    video = load_video(str(tmp_path / "a.mp4"), settings=loaded.video_settings)
    conv = Conversation(None, [(VIDEO_MARKER + "what moves?", "")], [True], "ref", [], [video])
    assert replies[0] == answer(loaded, default_tokenizer(), conv, loaded.image_settings, 6).strip()
    assert replies[0] != replies[1]  # the frames' order is read


@pytest.mark.parametrize(
    "shape",
    [
        (64, 96, 56, 84),
        (90, 130, 112, 168),
        (481, 641, 252, 336),
        (50, 50, 112, 112),
        (1000, 700, 448, 308),
        (77, 33, 84, 28),
    ],
)
def test_frames_are_resized_bit_for_bit_as_the_reference(shape):
    """The reference resizes uint8 frames with torchvision, which on CPU calls torch's antialiased
    bicubic `interpolate` on the uint8 tensor itself: ours equals it exactly, down and up."""
    h, w, H, W = shape
    frame = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    t = torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous()
    ref = torch.nn.functional.interpolate(t, size=[H, W], mode="bicubic", align_corners=False, antialias=True)
    np.testing.assert_array_equal(resize_frame(frame, H, W), ref[0].permute(1, 2, 0).numpy())


def test_a_video_without_frames_names_its_file(tmp_path):
    av = pytest.importorskip("av")
    path = tmp_path / "none.avi"
    with av.open(str(path), "w") as out:  # a header and a video stream, no frame
        stream = out.add_stream("mpeg4", rate=6)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        out.start_encoding()
    with pytest.raises(DataError, match="has no frames") as e:
        load_video(str(path), "data.jsonl:4")
    assert str(e.value).startswith(f"data.jsonl:4: {path}") and "\n" not in str(e.value)
    with pytest.raises(DataError, match="is not a regular file"):  # a directory, a FIFO: never opened
        load_video(str(tmp_path), "data.jsonl:4")


@pytest.mark.parametrize("key", ["max_frames", "temporal_patch_size"])
def test_a_zero_frame_count_in_the_video_config_is_one_line(tmp_path, key):
    save_video_settings(str(tmp_path), VideoSettings())
    file = tmp_path / "video_preprocessor_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), key: 0}))
    with pytest.raises(DataError, match=f"{key}=0 must be at least 1"):
        load_video_settings(str(tmp_path))
