"""The token ids that end a reply, shared by chat, the server, the WebUI and VL generation."""

from __future__ import annotations


def stop_ids(model, tokenizer) -> list[int]:
    """End of a reply: the template's sep token, eos, and the config's eos ids; for a
    vision-language model also its image / video tokens and the ids past the tokenizer's
    vocabulary (a reply cannot contain them)."""
    ids = [tokenizer.sep_token_id, tokenizer.eos_token_id, *model.config.eos_token_ids]
    if hasattr(model, "visual_features"):
        c = model.config
        ids += [c.image_start_token_id, c.image_end_token_id, c.image_token_id]
        ids += [c.video_start_token_id, c.video_end_token_id, c.video_token_id]
        ids += range(tokenizer.vocab_size, c.vocab_size)
    return sorted({int(i) for i in ids if i is not None})
