"""Videos into what ERNIE-4.5-VL reads, following transformers' `Ernie4_5_VLMoeVideoProcessor`:
frames sampled evenly (every frame, or `fps` per second, within min / max frames), optionally
stamped with their time in the top-left corner (the hub checkpoints' font), an odd count padded
with the last frame, every frame resized to patch-merge multiples within the video pixel budget,
normalised and cut into patches in (frame, merge block) order. Two frames make one temporal
patch: a video of t frames takes t / 2 x (h / 2) x (w / 2) placeholder tokens.

Files are decoded with PyAV (`pip install av`; only the sampled frames are kept, each stamped and
resized as it is decoded, so a 4K video is never held at full resolution), never fetched
from the network; frames already decoded (an array [T, H, W, 3] of uint8) go straight in.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass

import numpy as np

from erniekit.models.ernie4_5_vl.processor import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_SOURCE_PIXELS,
    ImageError,
    check_image_size,
    read_processor_config,
    smart_resize,
)
from erniekit.utils.io import atomic_write_json


@dataclass(frozen=True)
class VideoSettings:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 299 * 28 * 28  # per frame: the hub video processor's size["shortest_edge"]
    max_pixels: int = 1196 * 28 * 28  # its size["longest_edge"]
    min_frames: int = 16
    max_frames: int = 180
    fps: float | None = None  # frames sampled per second of video; None: every frame (within min / max)
    font: str | None = None  # a TrueType file: stamp each frame with its time (the hub checkpoints do)


def sample_frame_indices(total: int, video_fps: float | None, settings: VideoSettings = VideoSettings()) -> np.ndarray:
    """Indices of the frames kept from a video of `total` frames: n evenly spaced ones, n =
    total (or duration x settings.fps) clamped to [min_frames, max_frames] and to total; the
    spacing truncated as the reference computes it (float32 steps of total / n)."""
    if total < 1:
        raise ImageError("the video has no frames")
    if settings.fps is not None:
        if not video_fps:
            raise ImageError("sampling by fps needs the video's frame rate; this video does not give one")
        n = total / video_fps * settings.fps
    else:
        n = total
    n = min(max(n, settings.min_frames), settings.max_frames, total)
    step = total / n
    count = math.ceil(total / step)
    return np.trunc((np.arange(count, dtype=np.float64) * step).astype(np.float32)).astype(np.int64)


def timestamp_text(seconds: float) -> str:
    """`time: HH:MM:SS.ss`, what the hub checkpoints saw stamped on their video frames."""
    hours, rest = divmod(seconds, 3600)
    minutes, rest = divmod(rest, 60)
    return f"time: {int(hours):02d}:{int(minutes):02d}:{rest:05.02f}"


def stamp(frame: np.ndarray, text: str, font: str) -> np.ndarray:
    """Black text with a white outline at the frame's top-left, a tenth of its shorter side tall."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.fromarray(frame)
    size = int(min(image.size) * 0.1)
    ImageDraw.Draw(image).text(
        (0, 0),
        text,
        font=ImageFont.truetype(font, size),
        fill=(0, 0, 0),
        stroke_width=int(size * 0.1),
        stroke_fill=(255, 255, 255),
    )
    return np.asarray(image)


class PreparedFrames(np.ndarray):
    """Frames [n, h, w, 3] uint8 that `load_video` already stamped (when `settings.font` is set)
    and resized for `settings`: preprocess_video takes them as they are, so a video never sits in
    memory at full resolution."""

    settings: VideoSettings | None = None

    def __array_finalize__(self, obj) -> None:
        self.settings = getattr(obj, "settings", None)

    def __reduce__(self):
        fn, args, state = super().__reduce__()
        return fn, args, (state, self.settings)

    def __setstate__(self, state) -> None:
        state, self.settings = state
        super().__setstate__(state)


def prepare_frame(
    frame: np.ndarray, seconds: float | None, height: int, width: int, settings: VideoSettings
) -> np.ndarray:
    """One frame as the reference prepares it: its time stamped at full resolution (the font is a
    tenth of the frame's shorter side, so stamping after the resize would draw other pixels), then
    resized to (height, width)."""
    if settings.font is not None:
        frame = stamp(frame, timestamp_text(float(seconds)), settings.font)
    return resize_frame(frame, height, width)


def frame_size(height: int, width: int, settings: VideoSettings) -> tuple[int, int]:
    """The (height, width) frames of a video of this size are resized to."""
    factor = settings.patch_size * settings.merge_size
    return smart_resize(height, width, factor, settings.min_pixels, settings.max_pixels)


def load_video(
    source: str, where: str = "video", settings: VideoSettings = VideoSettings()
) -> tuple[PreparedFrames, np.ndarray]:
    """(sampled frames, their times in seconds) of a local video file. Each kept frame is stamped
    and resized as soon as it is decoded (a PreparedFrames, which preprocess_video takes as is:
    the same patches, tested), so memory holds n frames of the model's size, never n decoded ones
    (180 frames of 4K were 4.5 GB)."""
    if "://" in source or source.startswith("data:"):
        raise ImageError(f"{where}: {source[:60]!r}: videos are read from local files only")
    if not os.path.isfile(source):
        what = "is not a regular file" if os.path.exists(source) else "not found"  # a FIFO would block
        raise ImageError(f"{where}: video file {source} {what}")
    try:
        import av
    except ImportError:
        raise ImageError(f"{where}: reading video files needs PyAV: pip install av") from None
    name = f"{where}: {source}"
    try:
        with av.open(source) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else None
            total, counted = stream.frames, not stream.frames
            if counted:  # no count in the header: packets counted without decoding, checked while decoding
                total = sum(1 for packet in container.demux(stream) if packet.size)
            keep, times = _sampled(total, fps, settings, name)
            if counted:
                container.seek(0)
            frames, decoded = _decode_kept(container, stream, keep, times, settings, name, to_end=counted)
            if counted and decoded != total:  # packets that are not one frame each: sample the real count
                keep, times = _sampled(decoded, fps, settings, name)
                container.seek(0)
                frames, _ = _decode_kept(container, stream, keep, times, settings, name, to_end=False)
    except ImageError:
        raise
    except (av.FFmpegError, IndexError, ValueError) as e:
        raise ImageError(f"{name} is not a readable video ({type(e).__name__}: {str(e)[:80]})") from None
    if len(frames) != len(keep):
        raise ImageError(f"{name} decoded to fewer frames than its header says; re-encode it")
    out = np.stack([frames[i] for i in keep.tolist()]).view(PreparedFrames)
    out.settings = settings
    return out, times


def _sampled(total: int, fps: float | None, settings: VideoSettings, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the frames kept, their times in seconds)."""
    try:
        keep = sample_frame_indices(total, fps, settings)
    except ImageError as e:  # it knows no file: name it
        raise ImageError(f"{name}: {e}") from None
    return keep, (keep / fps if fps else keep.astype(np.float64))


def _decode_kept(container, stream, keep, times, settings: VideoSettings, name: str, to_end: bool) -> tuple[dict, int]:
    """({index: prepared frame} of the kept frames, frames decoded): decoding stops after the last
    kept frame unless `to_end` (to count them all)."""
    wanted = dict(zip(keep.tolist(), times.tolist()))
    last, frames, source, target, count = int(keep[-1]), {}, None, None, 0
    for i, frame in enumerate(container.decode(stream)):
        count = i + 1
        if frame.width * frame.height > MAX_SOURCE_PIXELS:
            raise ImageError(f"{name} has {frame.width}x{frame.height} frames; downscale it first")
        check_image_size(frame.width, frame.height, name)
        if i in wanted:
            if source is None:  # the size every frame is resized to, from the decoded size (once)
                source = (frame.width, frame.height)
                target = frame_size(frame.height, frame.width, settings)
            elif source != (frame.width, frame.height):
                raise ImageError(
                    f"{name} changes its frame size from {source[0]}x{source[1]} to "
                    f"{frame.width}x{frame.height}; re-encode it at one size"
                )
            frames[i] = prepare_frame(frame.to_ndarray(format="rgb24"), wanted[i], *target, settings)
        if i >= last and not to_end:  # the rest of a long video is not decoded for nothing
            break
    return frames, count


def preprocess_video(
    frames: np.ndarray, times: np.ndarray | None = None, settings: VideoSettings = VideoSettings()
) -> tuple[np.ndarray, np.ndarray]:
    """Frames [n, H, W, 3] uint8 (already sampled; or what load_video returns, already stamped
    and resized) -> (patches [t * gh * gw, 3 * p * p] float32, grid_thw [1, t, gh, gw]) with t = n
    rounded up to even. Frames are stamped and resized one at a time (one full-size copy at once)."""
    prepared = isinstance(frames, PreparedFrames)
    if prepared and frames.settings != settings:
        raise ImageError("these video frames were decoded for other video settings; load the video with these")
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ImageError(f"video frames must be a non-empty uint8 array [frames, height, width, 3], got {frames.shape}")
    p, m = settings.patch_size, settings.merge_size
    if prepared:
        x, (h, w) = frames, frames.shape[1:3]
    else:
        if settings.font is not None and times is None:
            raise ImageError("stamping frames with their time needs the frames' times")
        h, w = frame_size(frames.shape[1], frames.shape[2], settings)
        seconds = [None] * len(frames) if times is None else [float(s) for s in times]
        x = np.stack([prepare_frame(f, s, h, w, settings) for f, s in zip(frames, seconds)])
    if len(x) % settings.temporal_patch_size:  # the last frame repeated, as stamped (the same time)
        x = np.concatenate([x, x[-1:]])
    # rescale and normalise fused, in float32: (x - 255 mean) / (255 std)
    mean = np.asarray(CLIP_MEAN, np.float32) * np.float32(255.0)
    std = np.asarray(CLIP_STD, np.float32) * np.float32(255.0)
    x = x.astype(np.float32)
    x -= mean  # in place: the same numbers, one float copy of the video instead of three
    x /= std
    x = x.transpose(0, 3, 1, 2)  # [t, 3, h, w]
    t, gh, gw = x.shape[0], h // p, w // p
    patches = x.reshape(t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 2, 5, 3, 6, 1, 4, 7)
    return np.ascontiguousarray(patches.reshape(t * gh * gw, 3 * p * p)), np.array([[t, gh, gw]], dtype=np.int64)


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with a = -0.5 (Pillow's and torch's antialiased bicubic filter)."""
    a, x = -0.5, np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _filter_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source indices [out, k], int16-range fixed-point weights [out, k] and their precision
    of an antialiased bicubic resize along one axis, as torch computes them for uint8 images:
    double weights normalised per output, quantised to the most bits that keep the largest
    weight in int16."""
    scale = in_size / out_size
    support, stretch = (2.0 * scale, 1.0 / scale) if scale >= 1.0 else (2.0, 1.0)
    centers = scale * (np.arange(out_size) + 0.5)
    start = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    count = np.minimum((centers + support + 0.5).astype(np.int64), in_size) - start
    j = np.arange(int(count.max()))
    w = np.where(j < count[:, None], _cubic((j + start[:, None] - centers[:, None] + 0.5) * stretch), 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
    bits = 0
    while bits < 22 and int(0.5 + w.max() * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    fixed = np.trunc(w * (1 << bits) + np.where(w < 0, -0.5, 0.5)).astype(np.int32)
    return np.minimum(start[:, None] + j, in_size - 1), fixed, bits


def _resize_axis(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """One pass, accumulated a tap at a time (int32, as torch; integer sums do not depend on the
    order): a few output-sized buffers, not [out, taps] of the whole frame."""
    index, fixed, bits = _filter_taps(x.shape[axis], size)
    shape = [1] * x.ndim
    shape[axis] = size
    out = list(x.shape)
    out[axis] = size
    acc, tap = np.full(out, 1 << (bits - 1), np.int32), np.empty(out, np.int32)
    for j in range(index.shape[1]):
        np.multiply(np.take(x, index[:, j], axis=axis), fixed[:, j].reshape(shape), out=tap)
        acc += tap
    return np.clip(acc >> bits, 0, 255).astype(np.uint8)


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """A uint8 frame [h, w, 3] resized as the reference resizes video frames (torchvision calls
    torch's antialiased bicubic on the uint8 tensor: fixed-point weights, the width first, an
    uint8 result after each pass): bit-equal to it (tested). Pillow's bicubic, which the image
    processor uses, rounds its weights to 22 bits instead and differs by a level here and there."""
    if frame.shape[1] != width:
        frame = _resize_axis(frame, 1, width)
    if frame.shape[0] != height:
        frame = _resize_axis(frame, 0, height)
    return frame


def video_tokens(grid_thw: np.ndarray, config) -> list[int]:
    """The ids one video takes in the text: start, one placeholder per 2 frames x 2 x 2 patches, end."""
    t, h, w = (int(v) for v in np.asarray(grid_thw).reshape(3))
    v = config.vision
    n = t * h * w // (v.spatial_merge_size**2 * v.temporal_merge_size)
    return [config.video_start_token_id] + [config.video_token_id] * n + [config.video_end_token_id]


VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"


def save_video_settings(path: str, settings: VideoSettings) -> None:
    """video_preprocessor_config.json as the hub's video processor reads it (the font file, when
    frames are stamped, is copied beside it)."""
    font = None
    if settings.font is not None:
        font = os.path.basename(settings.font)
        if os.path.abspath(os.path.join(path, font)) != os.path.abspath(settings.font):
            shutil.copyfile(settings.font, os.path.join(path, font))
    config = {
        "video_processor_type": "Ernie4_5_VLMoeVideoProcessor",
        "size": {"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
        "patch_size": settings.patch_size,
        "merge_size": settings.merge_size,
        "temporal_patch_size": settings.temporal_patch_size,
        "min_frames": settings.min_frames,
        "max_frames": settings.max_frames,
        "fps": settings.fps,
        "do_sample_frames": True,
        "draw_on_frames": font is not None,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "rescale_factor": 1 / 255,
    }
    if font is not None:  # no key without a font: transformers' processor cannot load `"font": null`
        config["font"] = font
    atomic_write_json(os.path.join(path, VIDEO_PREPROCESSOR_FILE), config)


def load_video_settings(path: str) -> VideoSettings:
    """The video settings a checkpoint directory names (the hub processor's defaults without a
    file; frames are stamped only when it says so and ships its font)."""

    def build(cfg: dict) -> VideoSettings:
        size = cfg.get("size") or {}
        font = cfg.get("font") if cfg.get("draw_on_frames") else None
        d = VideoSettings()
        return VideoSettings(
            patch_size=int(cfg.get("patch_size", d.patch_size)),
            merge_size=int(cfg.get("merge_size", d.merge_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
            min_pixels=int(size.get("shortest_edge", d.min_pixels)),
            max_pixels=int(size.get("longest_edge", d.max_pixels)),
            min_frames=int(cfg.get("min_frames", d.min_frames)),
            max_frames=int(cfg.get("max_frames", d.max_frames)),
            fps=None if cfg.get("fps") is None else float(cfg["fps"]),
            font=None if font is None else os.path.join(path, font),
        )

    settings = read_processor_config(path, VIDEO_PREPROCESSOR_FILE, "video", build)
    if settings is None:
        return VideoSettings()
    if settings.font is not None and not os.path.isfile(settings.font):
        raise ImageError(
            f"{os.path.join(path, VIDEO_PREPROCESSOR_FILE)}: draw_on_frames needs its font {settings.font}, "
            "which is missing; copy it beside"
        )
    return settings
