"""ErnieTokenizer: special tokens, round trips, ERNIE chat template, hub layout, transformers parity."""

import json
import os
import shutil

import pytest

from erniekit.errors import CheckpointError, DataError
from erniekit.models.ernie4_5.tokenizer import ERNIE_CHAT_TEMPLATE, RESOURCE_DIR, ErnieTokenizer, default_tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "12+345=357 and 9-10=-1, 0.25 * 1000",
    "  two  spaces, trailing space \n\nnew\tlines ",
    " leading space",
    "héllo wörld — naïve café, 世界 🙂, Привет",
    "<|begin_of_sentence|>You are kind.\nUser: 3-17=\nAssistant: -14<|end_of_sentence|>",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "10-12="},
    {"role": "assistant", "content": "-2"},
    {"role": "user", "content": "7+7="},
]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_shipped_special_token_ids(tok):
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.pad_token_id == 0  # ERNIE pads with <unk>
    assert (tok.cls_token_id, tok.sep_token_id) == (3, 4)
    assert tok.convert_tokens_to_ids("<|endofprompt|>") == 5
    assert tok.convert_tokens_to_ids(["<mask:0>", "<mask:7>"]) == [6, 13]
    assert 512 <= tok.vocab_size <= 1024
    assert sum(os.path.getsize(os.path.join(RESOURCE_DIR, f)) for f in os.listdir(RESOURCE_DIR)) < 600_000


def test_special_tokens_encode_to_single_ids(tok):
    specials = list(tok.special_tokens.values()) + tok.additional_special_tokens
    for s in specials:
        sid = tok.convert_tokens_to_ids(s)
        assert tok.encode(s) == [sid], s
        ids = tok.encode(f"ab{s}cd")
        assert ids.count(sid) == 1 and len(ids) > 1, s
        assert tok.decode(ids, skip_special_tokens=False) == f"ab{s}cd"
        assert tok.decode(ids) == "abcd"


def test_decode_encode_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("x\ny"), skip_special_tokens=True) == "x\ny"


def test_text_that_is_not_unicode_is_a_data_error(tok):
    """A lone surrogate (a JSON \\ud800 escape, bytes decoded with surrogateescape) made
    sentencepiece raise a bare RuntimeError; it is one DataError naming the place."""
    assert tok.encode("caf\u00e9 \U0001f600")  # text beyond ASCII still encodes
    for text, at in (("\ud800 hi", 0), ("ok \udcff", 3), ("1+2=<|end_of_sentence|>x\udfff", 24)):
        with pytest.raises(DataError, match=rf"not valid Unicode: .* at character {at} "):
            tok.encode(text)


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok.encode("9876543210"))
    assert pieces == list("9876543210")


def test_add_special_tokens_follows_ernie_config(tok):
    # ERNIE 4.5 sets add_bos_token = add_eos_token = False, like transformers does for it
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_chat_template_literal(tok):
    expected = (
        "<|begin_of_sentence|>You are a calculator.\n"
        "User: 1+2=\nAssistant: 3<|end_of_sentence|>"
        "User: 10-12=\nAssistant: -2<|end_of_sentence|>"
        "User: 7+7=\nAssistant: "
    )
    assert tok.apply_chat_template(CONVERSATION) == expected
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected[: -len("Assistant: ")]
    assert tok.apply_chat_template(CONVERSATION, tokenize=True) == tok.encode(expected)
    assert tok.chat_template == ERNIE_CHAT_TEMPLATE


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert {"tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(tmp_path))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == ERNIE_CHAT_TEMPLATE
    again = ErnieTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.special_tokens == tok.special_tokens
    assert again.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)


def test_chat_template_jinja_file_wins(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    )
    custom = ErnieTokenizer.from_pretrained(str(tmp_path))
    assert custom.apply_chat_template(CONVERSATION[1:3]) == "[user]1+2=[assistant]3"
    custom.save_pretrained(tmp_path / "again")  # the custom template travels in tokenizer_config.json
    assert (
        ErnieTokenizer.from_pretrained(str(tmp_path / "again")).apply_chat_template(CONVERSATION[1:3])
        == "[user]1+2=[assistant]3"
    )


def test_added_tokens_past_the_sentencepiece_vocab(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    base = tok.sp.get_piece_size()
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|IMAGE_PLACEHOLDER|>": base}))
    ext = ErnieTokenizer.from_pretrained(str(tmp_path))
    assert ext.vocab_size == base + 1
    ids = ext.encode("a<|IMAGE_PLACEHOLDER|>b")
    assert ids == tok.encode("a") + [base] + tok.encode("b")
    assert ext.decode(ids, skip_special_tokens=False) == "a<|IMAGE_PLACEHOLDER|>b"


def test_missing_tokenizer_model_is_a_checkpoint_error(tmp_path):
    shutil.copy(os.path.join(RESOURCE_DIR, "tokenizer_config.json"), tmp_path)
    with pytest.raises(CheckpointError) as err:
        ErnieTokenizer.from_pretrained(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "tokenizer.model" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="not found"):
        ErnieTokenizer.from_pretrained(str(tmp_path / "nope"))


@pytest.mark.parametrize("with_model_config", [False, True])
def test_transformers_autotokenizer_gives_same_ids(tok, tmp_path, with_model_config):
    transformers = pytest.importorskip("transformers")
    tok.save_pretrained(tmp_path)
    if with_model_config:  # a full checkpoint dir: transformers picks the class from model_type
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "ernie4_5"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), text
        assert hf(text)["input_ids"] == tok.encode(text, add_special_tokens=True), text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.cls_token_id, hf.sep_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
        tok.cls_token_id,
        tok.sep_token_id,
    )
    assert hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        CONVERSATION
    )


def test_hub_style_config_round_trips_without_growing(tok, tmp_path):
    """Hub configs carry extra role tokens (sys_start_token...) and AddedToken dicts."""
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.update(sys_start_token="<mask:4>", header_end_token="<mask:7>", cls_token={"content": "<|begin_of_sentence|>"})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    first = ErnieTokenizer.from_pretrained(str(tmp_path))
    first.save_pretrained(tmp_path / "b")
    second = ErnieTokenizer.from_pretrained(str(tmp_path / "b"))
    assert second.additional_special_tokens == first.additional_special_tokens
    assert second.cls_token == "<|begin_of_sentence|>"
    assert json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())["sys_start_token"] == "<mask:4>"


def test_numpy_ids_and_template_kwargs(tok):
    import numpy as np

    ids = np.array(tok.encode("1+2=3"), dtype=np.int64)
    assert tok.decode(ids) == "1+2=3"
    assert tok.convert_ids_to_tokens(ids[0]) == "1" and tok.convert_ids_to_tokens(ids)[:2] == ["1", "+"]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, cls_token="") == "User: hi\nAssistant: "
