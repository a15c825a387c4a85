"""Vision-language conversations into token ids, loss labels and the patches of their images.

Each IMAGE_MARKER in a user turn becomes "Picture N:" and the image's own tokens (start, one
placeholder per merged 2x2 patch block, end; erniekit/models/ernie4_5_vl/processor.py), each
VIDEO_MARKER "Video N:" and the video's (video.py), as the hub's chat template and processor
render image and video parts, never trained; the text
around it is tokenized as the chat template renders it, as for text SFT (erniekit/data/encode.py).
A row carries its images as (patches [n, 3*p*p], grid_thw [k, 3]) under "images" (videos under
"videos"), so rows split over data-parallel ranks keep their own.
"""

from __future__ import annotations

import re

import numpy as np

from erniekit.data.encode import IGNORE_INDEX, _render_pieces
from erniekit.data.formats import IMAGE_MARKER, VIDEO_MARKER, Conversation
from erniekit.errors import DataError
from erniekit.models.ernie4_5_vl.processor import ImageSettings, image_tokens, load_image, preprocess_image
from erniekit.models.ernie4_5_vl.video import VideoSettings, load_video, preprocess_video, video_tokens

_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


def encode_vl_conversation(
    conv: Conversation,
    tokenizer,
    config,
    settings: ImageSettings,
    max_seq_len: int,
    video_settings: VideoSettings | None = None,
) -> dict[str, object]:
    """One conversation -> {"input_ids", "labels", "images": (patches, grids) | None, "videos": ...}."""
    video_settings = video_settings or VideoSettings()
    ids: list[int] = []
    labels: list[int] = []
    media = {IMAGE_MARKER: ([], [], list(conv.images)), VIDEO_MARKER: ([], [], list(conv.videos))}
    names = {IMAGE_MARKER: ("Picture", "image"), VIDEO_MARKER: ("Video", "video")}
    for text, train in _render_pieces(conv, tokenizer):
        pieces = _MARKERS.split(text)  # text, marker, text, marker, ..., text
        if train and len(pieces) > 1:
            raise DataError(f"{conv.source}: a reply contains an image or video marker; they go in user turns")
        for k in range(0, len(pieces), 2):
            chunk, marker = pieces[k], pieces[k + 1] if k + 1 < len(pieces) else None
            if marker is not None:  # the hub processor's rendering: "Picture N:" / "Video N:" before its tokens
                patches, grids, pending = media[marker]
                chunk += f"{names[marker][0]} {len(patches) + 1}:"
            if chunk:
                piece = tokenizer.encode(chunk)
                ids += piece
                labels += piece if train else [IGNORE_INDEX] * len(piece)
            if marker is None:
                continue
            if not pending:
                raise DataError(f"{conv.source}: more {names[marker][1]} markers than {names[marker][1]}s")
            src = pending.pop(0)  # a path or data: URI, or decoded already (an image from the server)
            if marker == IMAGE_MARKER:
                image = load_image(src, where=conv.source) if isinstance(src, str) else src
                p, g = preprocess_image(image, settings)
                tok = image_tokens(g, config)
            else:
                frames, times = load_video(src, conv.source, video_settings) if isinstance(src, str) else src
                p, g = preprocess_video(frames, times, video_settings)
                tok = video_tokens(g, config)
            patches.append(p)
            grids.append(g)
            ids += tok
            labels += [IGNORE_INDEX] * len(tok)
    for marker, (_, _, pending) in media.items():
        if pending:
            raise DataError(f"{conv.source}: {len(pending)} {names[marker][1]}(s) without a place in the text")
    if len(ids) > max_seq_len:
        raise DataError(
            f"{conv.source}: {len(ids)} tokens (images included) > max_seq_len={max_seq_len}; raise max_seq_len "
            "or lower max_pixels (fewer tokens per image)"
        )
    (ip, ig, _), (vp, vg, _) = media[IMAGE_MARKER], media[VIDEO_MARKER]
    return {
        "input_ids": np.asarray(ids, np.int64),
        "labels": np.asarray(labels, np.int64),
        "images": (np.concatenate(ip), np.concatenate(ig)) if ip else None,
        "videos": (np.concatenate(vp), np.concatenate(vg)) if vp else None,
    }


def collate_images(rows_images) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The images of a batch's rows, in row order (the order of their placeholders in the batch)."""
    kept = [im for im in rows_images if im is not None]
    if not kept:
        return None, None
    return np.concatenate([p for p, _ in kept]), np.concatenate([g for _, g in kept])
