"""Vision-language conversations into token ids, loss labels and the patches of their images.

Each IMAGE_MARKER in a user turn becomes "Picture N:" and the image's own tokens (start, one
placeholder per merged 2x2 patch block, end; erniekit/models/ernie4_5_vl/processor.py), as the
hub's chat template and processor render an image part, never trained; the text
around it is tokenized as the chat template renders it, as for text SFT (erniekit/data/encode.py).
A row carries its images as (patches [n, 3*p*p], grid_thw [k, 3]) under "images", so rows split
over data-parallel ranks keep their images.
"""

from __future__ import annotations

import numpy as np

from erniekit.data.encode import IGNORE_INDEX, _render_pieces
from erniekit.data.formats import IMAGE_MARKER, Conversation
from erniekit.errors import DataError
from erniekit.models.ernie4_5_vl.processor import ImageSettings, image_tokens, load_image, preprocess_image


def encode_vl_conversation(
    conv: Conversation, tokenizer, config, settings: ImageSettings, max_seq_len: int
) -> dict[str, object]:
    """One conversation -> {"input_ids", "labels", "images": (patches, grids)}."""
    ids: list[int] = []
    labels: list[int] = []
    patches, grids = [], []
    pending = list(conv.images)
    for text, train in _render_pieces(conv, tokenizer):
        chunks = text.split(IMAGE_MARKER)
        if train and len(chunks) > 1:
            raise DataError(f"{conv.source}: a reply contains an image marker; images go in user turns")
        # the hub processor's rendering: each image is "Picture N:" (N counting the conversation's
        # images) before its tokens
        n0 = len(conv.images) - len(pending)
        chunks = [c + f"Picture {n0 + k + 1}:" if k < len(chunks) - 1 else c for k, c in enumerate(chunks)]
        for k, chunk in enumerate(chunks):
            if k:
                if not pending:
                    raise DataError(f"{conv.source}: more image markers than images")
                src = pending.pop(0)  # a path or data: URI, or an image already decoded (the server's)
                image = load_image(src, where=conv.source) if isinstance(src, str) else src
                p, g = preprocess_image(image, settings)
                patches.append(p)
                grids.append(g)
                tok = image_tokens(g, config)
                ids += tok
                labels += [IGNORE_INDEX] * len(tok)
            if chunk:
                piece = tokenizer.encode(chunk)
                ids += piece
                labels += piece if train else [IGNORE_INDEX] * len(piece)
    if pending:
        raise DataError(f"{conv.source}: {len(pending)} image(s) without a place in the text")
    if len(ids) > max_seq_len:
        raise DataError(
            f"{conv.source}: {len(ids)} tokens (images included) > max_seq_len={max_seq_len}; raise max_seq_len "
            "or lower max_pixels (fewer tokens per image)"
        )
    images = (np.concatenate(patches), np.concatenate(grids)) if patches else None
    return {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64), "images": images}


def collate_images(rows_images) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The images of a batch's rows, in row order (the order of their placeholders in the batch)."""
    kept = [im for im in rows_images if im is not None]
    if not kept:
        return None, None
    return np.concatenate([p for p, _ in kept]), np.concatenate([g for _, g in kept])
