"""Images into what ERNIE-4.5-VL reads: decoded with Pillow from a local path or a `data:` URI
(never the network), resized to patch-merge multiples within a pixel budget, normalised and cut
into flattened patches in merge-block order, as transformers' `Ernie4_5_VLMoeImageProcessorPil`
does (same numbers, tested); and the placeholder tokens each image takes in the text.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from erniekit.errors import DataError
from erniekit.utils.io import atomic_write_json

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_SOURCE_PIXELS = 8192 * 8192  # a decoded image larger than this is refused (decompression bombs)
# decoded image pixels one server request may hold (a few KB of PNG decode to 200 MB: 8 of them per request)
MAX_REQUEST_PIXELS = 2 * MAX_SOURCE_PIXELS


class ImageError(DataError):
    """An image that cannot be used; the message names it and says what to do."""


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56  # the hub processor's size["shortest_edge"]
    max_pixels: int = 28 * 28 * 6177  # its size["longest_edge"]


PREPROCESSOR_FILE = "preprocessor_config.json"


def read_processor_config(path: str, name: str, what: str, build: Callable[[dict], Any]) -> Any | None:
    """`build(config)` of the processor config `name` in a checkpoint directory (None when it has
    none); unreadable JSON, a wrong field or a pixel budget with min > max is one DataError."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            settings = build(json.load(f))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{file}: not a readable {what} processor config ({e}); fix or delete it") from None
    if not 0 < settings.min_pixels <= settings.max_pixels:
        raise DataError(f"{file}: size.shortest_edge / longest_edge must satisfy 0 < min <= max")
    for key in ("patch_size", "merge_size", "temporal_patch_size", "min_frames", "max_frames"):
        if getattr(settings, key, 1) < 1:  # a 0 divides by zero at the first image or video
            raise DataError(f"{file}: {key}={getattr(settings, key)} must be at least 1")
    return settings


def save_image_settings(path: str, settings: ImageSettings) -> None:
    """preprocessor_config.json as the hub's ERNIE-4.5-VL image processor reads it, so a model is
    served with the image sizes it was trained on (by us, transformers or FastDeploy)."""
    atomic_write_json(
        os.path.join(path, PREPROCESSOR_FILE),
        {
            "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
            "patch_size": settings.patch_size,
            "merge_size": settings.merge_size,
            "temporal_patch_size": 1,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD),
            "do_convert_rgb": True,
        },
    )


def load_image_settings(path: str) -> ImageSettings:
    """The image sizes a checkpoint directory's preprocessor_config.json names (the hub processor's
    defaults where it has none, as transformers would use)."""

    def build(cfg: dict) -> ImageSettings:
        size = cfg.get("size") or {}
        return ImageSettings(
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            min_pixels=int(cfg.get("min_pixels", size.get("shortest_edge", ImageSettings.min_pixels))),
            max_pixels=int(cfg.get("max_pixels", size.get("longest_edge", ImageSettings.max_pixels))),
        )

    return read_processor_config(path, PREPROCESSOR_FILE, "image", build) or ImageSettings()


def check_image_size(width: int, height: int, where: str = "image") -> None:
    """What the resize cannot take (no pixels, an aspect ratio above 200, as the reference refuses),
    refused where the source is still known: `where` names it (a data file and line, a request)."""
    if min(height, width) < 1:
        raise ImageError(f"{where}: image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise ImageError(
            f"{where}: image of size {width}x{height}: aspect ratio above 200 is not supported; crop or pad it"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) divisible by `factor`, within [min_pixels, max_pixels], the aspect ratio kept
    as closely as that allows."""
    check_image_size(width, height)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def load_image(source: str, where: str = "image"):
    """A PIL image (RGB) from a local file path or a `data:image/...;base64,` URI; `where` names
    the source in errors (a data file and line, a request field)."""
    from PIL import Image, UnidentifiedImageError

    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ImageError(f"{where}: a data: URI image must be base64 (data:image/png;base64,...)")
        mime = head[len("data:") :].split(";")[0]
        if not mime.lower().startswith("image/"):
            raise ImageError(
                f"{where}: a data: URI of type {mime[:40] or 'none'!r} is not an image; send data:image/...;base64,..."
            )
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{where}: the data: URI's base64 payload does not decode") from None
        fp, name = io.BytesIO(raw), "the data: URI"
    elif "://" in source:
        raise ImageError(f"{where}: {source[:60]!r} is a URL; images are read from local paths or data: URIs only")
    else:
        if not os.path.isfile(source):
            what = "is not a regular file" if os.path.exists(source) else "not found"  # a FIFO would block
            raise ImageError(f"{where}: image file {source} {what}")
        if os.path.getsize(source) == 0:
            raise ImageError(f"{where}: image file {source} is empty (0 bytes)")
        fp, name = source, source
    try:
        with Image.open(fp, formats=_readable_formats()) as im:
            w, h = im.size
            if w * h > MAX_SOURCE_PIXELS:
                raise ImageError(
                    f"{where}: {name} is {w}x{h} pixels, more than {MAX_SOURCE_PIXELS}; downscale it first"
                )
            check_image_size(w, h, f"{where}: {name}")
            im.load()
            return to_rgb(im)
    except ImageError:
        raise
    except UnidentifiedImageError:  # its message is the file object's repr
        raise ImageError(f"{where}: {name} is not a readable image (not a format Pillow reads)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: {name} is not a readable image ({type(e).__name__}: {str(e)[:80]})") from None


def _readable_formats() -> list[str]:
    """Pillow's formats but EPS, whose decoding runs Ghostscript on the file (no request runs a program)."""
    from PIL import Image

    Image.init()
    return [f for f in Image.OPEN if f != "EPS"]


def to_rgb(image):
    """RGB, transparency composited onto white (as the hub processor converts)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_image(image, settings: ImageSettings = ImageSettings()) -> tuple[np.ndarray, np.ndarray]:
    """A PIL image -> (patches [gh * gw, 3 * p * p] float32, grid_thw [1, gh, gw])."""
    from PIL import Image

    p, m = settings.patch_size, settings.merge_size
    image = to_rgb(image)
    h, w = smart_resize(image.height, image.width, p * m, settings.min_pixels, settings.max_pixels)
    x = np.asarray(image.resize((w, h), resample=Image.BICUBIC))  # [h, w, 3] uint8
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)
    x = x.transpose(2, 0, 1)  # [3, h, w]
    gh, gw = h // p, w // p
    patches = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * p * p)), np.array([[1, gh, gw]], dtype=np.int64)


def image_tokens(grid_thw: np.ndarray, config) -> list[int]:
    """The ids one image takes in the text: start, one placeholder per merged patch block, end."""
    t, h, w = (int(v) for v in np.asarray(grid_thw).reshape(3))
    n = t * h * w // config.vision.spatial_merge_size**2
    return [config.image_start_token_id] + [config.image_token_id] * n + [config.image_end_token_id]
