"""Videos end to end against transformers' own Ernie4_5_VLMoeVideoProcessor: the settings we save
(video_preprocessor_config.json, the font beside it) loaded by it, the frames it samples, the
timestamps it stamps, its resize, normalisation and patch layout: our patches equal its
`pixel_values_videos` bit for bit, for frame arrays and for an mp4 file each side decodes.

The reference needs torchvision, which runs in its own process (tests/video_processor_reference.py
says why). It is looked for in the test environment, then in `<venv>/torchvision-reference`
(`pip install --no-deps --target .venv/torchvision-reference torchvision==0.28.0`, the build that
matches torch 2.13). Without it the test skips; CI installs it and sets ERNIEKIT_REQUIRE_TORCHVISION=1,
which turns that skip into a failure."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import video_processor_reference
from media_files import moving_square, write_mp4

from erniekit.models.ernie4_5_vl.video import (
    VideoSettings,
    load_video,
    load_video_settings,
    preprocess_video,
    sample_frame_indices,
    save_video_settings,
)

REFERENCE = video_processor_reference.__file__
SIDE_DIR = os.path.join(sys.prefix, "torchvision-reference")


def _torchvision_path() -> str | None:
    """'' when the test environment imports torchvision itself, the side directory when it holds
    one, None when there is none."""
    if importlib.util.find_spec("torchvision") is not None:
        return ""
    if os.path.isdir(os.path.join(SIDE_DIR, "torchvision")):
        return SIDE_DIR
    return None


def _font() -> str:
    import matplotlib  # a dependency of VisualDL: its DejaVu Sans is on every machine that runs erniekit

    return os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")


# (frames, height, width, the video's fps, settings): every frame or `fps` per second, within
# min / max frames; odd counts (the last frame repeated); down- and up-scaling; stamped or not
ARRAY_CASES = [
    (37, 90, 130, 29.97, dict(min_frames=4, max_frames=30)),
    (37, 90, 130, 29.97, dict(min_frames=4, max_frames=30, fps=2.0, font=True)),
    (20, 200, 150, 10.0, dict(min_frames=4, max_frames=180, font=True)),
    (181, 64, 64, 30.0, dict(min_frames=4, max_frames=180, fps=0.5)),
    (5, 28, 40, 24.0, dict(min_frames=16, max_frames=180, min_pixels=56 * 56 * 4, font=True)),
    (9, 300, 420, 25.0, dict(min_frames=2, max_frames=180, fps=3.7, max_pixels=28 * 28 * 60)),
]
FILE_CASE = (41, 64, 96, 10, dict(min_frames=4, max_frames=180, fps=2.0, font=True))


def _settings(kw: dict) -> VideoSettings:
    kw = dict(kw)
    kw.setdefault("min_pixels", 3136)
    kw.setdefault("max_pixels", 28 * 28 * 40)
    kw["font"] = _font() if kw.pop("font", False) else None
    return VideoSettings(**kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Our settings saved per case, all cases run through the reference in one process: (case
    directories, the reference's outputs)."""
    path = _torchvision_path()
    if path is None:
        if os.environ.get("ERNIEKIT_REQUIRE_TORCHVISION") == "1":
            pytest.fail(f"torchvision is in neither the test environment nor {SIDE_DIR}")
        pytest.skip(f"no torchvision for transformers' video processor (see this file's docstring): {SIDE_DIR}")
    root = tmp_path_factory.mktemp("video-reference")
    rng = np.random.default_rng(0)
    cases, spec = [], []
    for i, (n, h, w, fps, kw) in enumerate(ARRAY_CASES):
        d = root / f"case-{i}"
        d.mkdir()
        save_video_settings(str(d), _settings(kw))
        frames = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
        np.save(d / "frames.npy", frames)
        cases.append((d, frames, fps))
        spec.append({"processor_dir": str(d), "frames": str(d / "frames.npy"), "fps": fps})
    n, h, w, fps, kw = FILE_CASE
    d = root / "file"
    d.mkdir()
    save_video_settings(str(d), _settings(kw))
    write_mp4(d / "v.mp4", moving_square(n, h, w), fps)
    cases.append((d, None, fps))
    spec.append({"processor_dir": str(d), "video": str(d / "v.mp4")})
    (root / "spec.json").write_text(json.dumps({"cases": spec}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p))
    run = subprocess.run(
        [sys.executable, REFERENCE, str(root / "spec.json"), str(root)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return cases, [dict(np.load(root / f"case-{i}.npz")) for i in range(len(spec))]


@pytest.mark.parametrize("case", range(len(ARRAY_CASES)))
def test_frame_arrays_give_the_reference_patches_bit_for_bit(reference, case):
    cases, outputs = reference
    d, frames, fps = cases[case]
    theirs = outputs[case]
    settings = load_video_settings(str(d))  # what we saved, read back as a checkpoint's
    assert (settings.font is not None) == bool(ARRAY_CASES[case][4].get("font"))
    keep = sample_frame_indices(len(frames), fps, settings)
    np.testing.assert_array_equal(keep, theirs["frames_indices"])
    patches, grid = preprocess_video(frames[keep], keep / fps, settings)
    np.testing.assert_array_equal(grid, theirs["video_grid_thw"])
    np.testing.assert_array_equal(patches, theirs["pixel_values_videos"])


def test_a_video_file_gives_the_reference_patches_bit_for_bit(reference):
    """Each side decodes the mp4 itself (both with PyAV), samples by fps and stamps the times."""
    cases, outputs = reference
    d, _, fps = cases[-1]
    theirs = outputs[-1]
    settings = load_video_settings(str(d))
    frames, times = load_video(str(d / "v.mp4"), settings=settings)
    np.testing.assert_array_equal(np.round(times * fps).astype(int), theirs["frames_indices"])
    patches, grid = preprocess_video(frames, times, settings)
    assert (
        grid.tolist() == theirs["video_grid_thw"].tolist() == [[10, 4, 6]]
    )  # 9 frames (every 5th of 41), the last repeated
    np.testing.assert_array_equal(patches, theirs["pixel_values_videos"])


def test_stamping_changes_the_patches(reference):
    """The stamped cases are not passing by accident: without the time drawn our patches differ
    from the reference's."""
    cases, outputs = reference
    d, frames, fps = cases[1]
    settings = load_video_settings(str(d))
    keep = sample_frame_indices(len(frames), fps, settings)
    bare = VideoSettings(**{**settings.__dict__, "font": None})
    patches, _ = preprocess_video(frames[keep], keep / fps, bare)
    assert not np.array_equal(patches, outputs[1]["pixel_values_videos"])
