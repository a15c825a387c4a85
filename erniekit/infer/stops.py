"""The token ids that end a reply, shared by chat, the server, the WebUI and VL generation."""

from __future__ import annotations


def turn_end_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn in the tokenizer's chat format: sep and eos, and
    `<|im_end|>` where it is a token (the ERNIE thinking format)."""
    ids = [tokenizer.sep_token_id, tokenizer.eos_token_id]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tokenizer.convert_ids_to_tokens(end) == "<|im_end|>":
        ids.append(end)
    return [i for i in ids if i is not None]


def stop_ids(model, tokenizer) -> list[int]:
    """End of a reply: the template's sep token, eos, and the config's eos ids; for a
    vision-language model also its image / video tokens and the ids past the tokenizer's
    vocabulary (a reply cannot contain them)."""
    ids = [*turn_end_ids(tokenizer), *model.config.eos_token_ids]
    if hasattr(model, "visual_features"):
        c = model.config
        ids += [c.image_start_token_id, c.image_end_token_id, c.image_token_id]
        ids += [c.video_start_token_id, c.video_end_token_id, c.video_token_id]
        ids += range(tokenizer.vocab_size, c.vocab_size)
    return sorted({int(i) for i in ids if i is not None})
