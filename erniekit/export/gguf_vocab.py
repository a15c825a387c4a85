"""The tokenizer inside a GGUF file: a sentencepiece vocabulary written the way llama.cpp's
converter writes one (`tokenizer.ggml.model = "llama"`), so llama.cpp cuts text into the ids
erniekit's tokenizer gives.

It is read from a tokenizer directory in the hub layout (tokenizer.model, tokenizer_config.json,
optional added_tokens.json), as the converter reads a checkpoint. Token types are the
sentencepiece piece types (GGUF numbers them the same); tokens of `added_tokens_decoder` become
CONTROL when special and USER_DEFINED otherwise, as the converter does: llama.cpp then keeps both
whole, like our tokenizer (CONTROL ones only when asked to parse special tokens). Ids the
tokenizer does not fill up to the model's vocab_size are `[PAD{id}]` UNUSED tokens. The space
prefix follows the sentencepiece model's own `add_dummy_prefix` (what `sp.encode` does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from erniekit.errors import CheckpointError

# sentencepiece ModelProto piece types == GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_ROLES = ("bos", "eos", "unk", "sep", "pad", "mask")  # the roles GGUF has a key for (no cls)


@dataclass
class GGUFVocab:
    tokens: list[bytes]
    scores: list[float]
    types: list[int]
    special_ids: dict[str, int] = field(default_factory=dict)  # role (bos, eos, ..., eot) -> id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    from erniekit.utils.io import read_json_object

    return read_json_object(path, "fix or regenerate the tokenizer file")


def _content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def sentencepiece_vocab(tokenizer_dir: str, vocab_size: int, end_of_turn: str | None = None) -> GGUFVocab:
    """The GGUF vocabulary of the tokenizer in `tokenizer_dir`, padded to the model's `vocab_size`.
    end_of_turn: the token closing an assistant turn in the chat template (written as the eot id,
    which llama.cpp stops generating at)."""
    from sentencepiece import sentencepiece_model_pb2

    model_file = os.path.join(tokenizer_dir, "tokenizer.model")
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    n = len(proto.pieces)
    config = _json(os.path.join(tokenizer_dir, "tokenizer_config.json"))
    added = {t: int(i) for t, i in _json(os.path.join(tokenizer_dir, "added_tokens.json")).items()}
    decoder = {int(i): e for i, e in (config.get("added_tokens_decoder") or {}).items()}
    top = max([n - 1, *added.values(), *decoder])
    if top >= vocab_size:
        raise CheckpointError(
            f"{tokenizer_dir}: the tokenizer has token id {top} but the model's vocab_size is {vocab_size}; "
            "use the tokenizer the model was trained with"
        )
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [UNUSED] * vocab_size
    for i, p in enumerate(proto.pieces):
        tokens[i], scores[i], types[i] = p.piece.encode("utf-8"), p.score, p.type
    for tok, i in added.items():
        tokens[i], scores[i], types[i] = tok.encode("utf-8"), -1000.0, USER_DEFINED
    for i, entry in decoder.items():
        tok = _content(entry)
        if tok is None:
            raise CheckpointError(f"{tokenizer_dir}/tokenizer_config.json: added_tokens_decoder[{i}] has no content")
        special = isinstance(entry, dict) and entry.get("special", True)
        tokens[i], scores[i], types[i] = tok.encode("utf-8"), -1000.0, CONTROL if special else USER_DEFINED
    ids = {t.decode("utf-8"): i for i, t in enumerate(tokens) if types[i] != UNUSED}
    special_ids = {}
    for role in SPECIAL_ROLES:
        tok = _content(config.get(f"{role}_token"))
        if tok is not None and tok in ids:
            special_ids[role] = ids[tok]
    if end_of_turn is not None:
        if end_of_turn not in ids:
            raise CheckpointError(f"{tokenizer_dir}: the chat template's end-of-turn token {end_of_turn!r} is no token")
        special_ids["eot"] = ids[end_of_turn]
    template = config.get("chat_template")
    jinja = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    return GGUFVocab(
        tokens,
        scores,
        types,
        special_ids,
        add_bos=bool(config.get("add_bos_token", False)),
        add_eos=bool(config.get("add_eos_token", False)),
        add_space_prefix=bool(proto.normalizer_spec.add_dummy_prefix),
        chat_template=template if isinstance(template, str) else None,
    )


def write_vocab(writer, vocab: GGUFVocab) -> None:
    """The tokenizer.* keys of a GGUF file (a gguf.GGUFWriter before its header is written)."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    for role, i in vocab.special_ids.items():
        getattr(writer, f"add_{role}_token_id")(i)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def read_vocab(reader) -> GGUFVocab:
    """What `write_vocab` wrote, from a gguf.GGUFReader."""
    f = reader.fields

    def get(key: str, default=None):
        return f[key].contents() if key in f else default

    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]) for i in f["tokenizer.ggml.tokens"].data]
    import gguf

    keys = {r: getattr(gguf.Keys.Tokenizer, f"{r.upper()}_ID") for r in (*SPECIAL_ROLES, "eot")}
    special = {r: int(get(k)) for r, k in keys.items() if k in f}
    return GGUFVocab(
        tokens,
        [float(s) for s in get("tokenizer.ggml.scores")],
        [int(t) for t in get("tokenizer.ggml.token_type")],
        special,
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", False)),
        chat_template=get("tokenizer.chat_template"),
    )
