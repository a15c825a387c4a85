"""Videos written by tests (PyAV): a red square moving across a plain background, encoded as mp4."""

import numpy as np
import pytest


def moving_square(n: int, height: int = 64, width: int = 96) -> np.ndarray:
    """[n, height, width, 3] uint8 frames of a 16-pixel-wide square moving left to right."""
    frames = np.full((n, height, width, 3), 230, np.uint8)
    for i in range(n):
        x = 4 + i * (width - 24) // max(n - 1, 1)
        frames[i, 20:36, x : x + 16] = (200, 30, 30)
    return frames


def write_mp4(path, frames: np.ndarray, fps: int, codec: str = "mpeg4") -> None:
    """`frames` as an mp4 file (libx264: what a browser plays); skips the test without PyAV."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
