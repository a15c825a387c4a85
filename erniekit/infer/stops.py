"""Which token ids a reply may hold and which end it, shared by chat, the server, the WebUI, VL
generation, evaluation and RL rollouts."""

from __future__ import annotations


def turn_end_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn in the tokenizer's chat format: sep and eos, and
    `<|im_end|>` where it is a token (the ERNIE thinking format)."""
    ids = [tokenizer.sep_token_id, tokenizer.eos_token_id]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tokenizer.convert_ids_to_tokens(end) == "<|im_end|>":
        ids.append(end)
    return [i for i in ids if i is not None]


def decodable_vocab(model, tokenizer) -> int:
    """The ids [0, n) a reply may be made of: those the tokenizer can write. A checkpoint's
    vocabulary is often padded past its tokenizer (to a multiple that shards evenly, or with rows
    kept for tokens added later); a padding id is a legal argmax of the head but no text, so the
    decoders choose below n."""
    return min(len(tokenizer), int(model.config.vocab_size))


def stop_ids(model, tokenizer) -> list[int]:
    """End of a reply: the template's sep token, eos, and the config's eos ids; for a
    vision-language model also its image / video tokens (a reply cannot contain them)."""
    ids = [*turn_end_ids(tokenizer), *model.config.eos_token_ids]
    if hasattr(model, "visual_features"):
        c = model.config
        ids += [c.image_start_token_id, c.image_end_token_id, c.image_token_id]
        ids += [c.video_start_token_id, c.video_end_token_id, c.video_token_id]
    return sorted({int(i) for i in ids if i is not None})
