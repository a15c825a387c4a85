"""Greedy generation of an ERNIE-4.5-VL model from a prompt with images or videos, with a KV cache.

The prefill runs the images through the vision encoder into their placeholders with 3-D positions
(`rope_index`); every decoded token then takes position (tokens so far + the prompt's delta) on
all three axes, as the reference's generation does.
"""

from __future__ import annotations

import numpy as np
import paddle

from erniekit.data.encode import IGNORE_INDEX
from erniekit.data.formats import Conversation
from erniekit.data.vl import encode_vl_conversation
from erniekit.errors import DataError
from erniekit.infer.generate import argmax_or_flag, check_prompt_ids, choice_width, non_finite_error
from erniekit.models.ernie4_5_vl.modeling import rope_index
from erniekit.nn.attention import KVCache


def prompt_of(conv: Conversation, tokenizer, config, settings, video_settings=None) -> tuple[list[int], tuple | None]:
    """The ids (images in place) before the last reply of `conv`, and the images' (patches, grids);
    as erniekit/train/evaluation.prompt_ids derives them for text: only the last reply trained,
    the prompt ends at its first token. A conversation with videos: use `prompt_with_videos`."""
    ids, images, videos = prompt_with_videos(conv, tokenizer, config, settings, video_settings)
    if videos is not None:
        raise ValueError(f"{conv.source}: this path takes images only, not videos")
    return ids, images


def prompt_with_videos(conv: Conversation, tokenizer, config, settings, video_settings=None):
    """prompt_of's (ids, images) and the videos' (patches, grids) (None without videos)."""
    from erniekit.models.ernie4_5_vl.video import VideoSettings

    last = Conversation(
        conv.system, conv.turns, [False] * (len(conv.turns) - 1) + [True], conv.source, conv.images, conv.videos
    )
    row = encode_vl_conversation(last, tokenizer, config, settings, 1 << 30, video_settings or VideoSettings())
    trained = row["labels"] != IGNORE_INDEX
    start = int(np.argmax(trained)) if trained.any() else len(trained)
    return row["input_ids"][:start].tolist(), row["images"], row["videos"]


@paddle.no_grad()
def generate_vl(
    model, ids: list[int], images, max_new_tokens: int, stop_ids: list[int], videos=None, vocab: int | None = None
) -> list[int]:
    """New token ids (stop token excluded) after prompt `ids` whose images (and videos) are
    (patches, grids); only ids below `vocab` are chosen (as `generate_stream`). NonFiniteError when
    the logits turn NaN or inf; RequestError for an id outside the vocabulary (a processor or
    tokenizer of another model)."""
    model.eval()
    c = model.config
    check_prompt_ids([ids], int(c.vocab_size))
    keep = choice_width(model, vocab)
    x = np.asarray([ids], dtype=np.int64)
    dtype = model.model.embed_tokens.weight.dtype
    cache = KVCache(c, 1, len(ids) + max_new_tokens, dtype=dtype)
    kw = {}
    delta = 0
    if images is not None:
        kw.update(pixel_values=paddle.to_tensor(images[0]), image_grid_thw=images[1])
    if videos is not None:
        kw.update(pixel_values_videos=paddle.to_tensor(videos[0]), video_grid_thw=videos[1])
    if kw:
        pos, deltas = rope_index(x, c, kw.get("image_grid_thw"), kw.get("video_grid_thw"))
        kw["position_ids"] = paddle.to_tensor(pos)
        delta = int(deltas[0])
    out: list[int] = []
    logits = model(paddle.to_tensor(x), cache=cache, logits_to_keep=1, **kw).logits
    for step in range(max_new_tokens):
        tok = int(argmax_or_flag(logits[0, -1, :keep]))  # -1: not finite; one host copy, as before
        if tok < 0:
            raise non_finite_error(f"at generation step {step + 1} of {max_new_tokens}", dtype)
        if tok in stop_ids:
            break
        out.append(tok)
        p = cache.length + delta
        pos = paddle.to_tensor(np.full((3, 1, 1), p, dtype=np.int64))
        logits = model(paddle.to_tensor([[tok]]), position_ids=pos, cache=cache, logits_to_keep=1).logits
    return out


def answer(model, tokenizer, conv: Conversation, settings, max_new_tokens: int) -> str:
    """The model's greedy reply to `conv`'s last user turn (its images included)."""
    from erniekit.infer.stops import decodable_vocab, stop_ids

    ids, images, videos = prompt_with_videos(conv, tokenizer, model.config, settings, model.video_settings)
    context = int(model.config.max_position_embeddings)
    if len(ids) >= context:  # positions past the context: a reply the model was never trained to give
        raise DataError(
            f"{conv.source}: the prompt with its images and videos is {len(ids)} tokens, the model's context is "
            f"{context}; send fewer or smaller images (max_pixels in preprocessor_config.json) or a shorter history"
        )
    max_new_tokens = min(max_new_tokens, context - len(ids))
    out = generate_vl(
        model, ids, images, max_new_tokens, stop_ids(model, tokenizer), videos, decodable_vocab(model, tokenizer)
    )
    return tokenizer.decode(out)
