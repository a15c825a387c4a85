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


def test_ids_between_the_pieces_and_a_later_added_token_have_no_text(tok, tmp_path):
    """An added token 40 ids past the sentencepiece pieces leaves a gap of ids naming nothing: a
    model may still emit one; it decodes to no text (as transformers' tokenizers do) instead of
    sentencepiece's IndexError, and its token string is empty (the server lists every id's)."""
    tok.save_pretrained(tmp_path)
    base = tok.sp.get_piece_size()
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<extra>": base + 40}))
    ext = ErnieTokenizer.from_pretrained(str(tmp_path))
    assert len(ext) == base + 41
    ids = tok.encode("ab") + [base + 3] + tok.encode(" c") + [base + 40]
    assert ext.decode(ids, skip_special_tokens=False) == tok.decode(tok.encode("ab") + tok.encode(" c")) + "<extra>"
    texts = ext.convert_ids_to_tokens(range(len(ext)))
    assert texts[base + 3] == "" and texts[base + 40] == "<extra>" and texts[5] == tok.convert_ids_to_tokens(5)
    with pytest.raises(DataError, match="outside the vocabulary"):
        ext.decode([base + 41])


def test_missing_tokenizer_model_is_a_checkpoint_error(tmp_path):
    shutil.copy(os.path.join(RESOURCE_DIR, "tokenizer_config.json"), tmp_path)
    with pytest.raises(CheckpointError) as err:
        ErnieTokenizer.from_pretrained(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "tokenizer.model" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="not found"):
        ErnieTokenizer.from_pretrained(str(tmp_path / "nope"))


def _patched_copy(tmp_path, name: str, data) -> str:
    """The shipped tokenizer with one file replaced (bytes) or tokenizer_config.json keys patched (dict)."""
    d = tmp_path / "tok"
    shutil.copytree(RESOURCE_DIR, d)
    if isinstance(data, dict):
        cfg = json.loads((d / name).read_text()) if (d / name).exists() else {}
        (d / name).write_text(json.dumps({**cfg, **data}))
    else:
        (d / name).write_bytes(data)
    return str(d)


@pytest.mark.parametrize(
    "name,data,words",
    [
        ("tokenizer.model", b"", "no pieces"),
        ("special_tokens_map.json", {"additional_special_tokens": "abc"}, "additional_special_tokens must be a list"),
        ("tokenizer_config.json", {"added_tokens_decoder": [1, 2]}, "added_tokens_decoder must be an object"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"-5": {"content": "<z>"}}}, "has id '-5'"),
        (  # encode would give 10 for "<z>", decode 10 "<mask:4>"
            "tokenizer_config.json",
            {"added_tokens_decoder": {"10": {"content": "<z>"}}},
            "already belongs to '<mask:4>'",
        ),
        ("added_tokens.json", b'{"<a>": 5000, "<b>": 5000}', "already belongs to '<a>'"),
        ("added_tokens.json", b'{"<a>": "x"}', "has id 'x'"),
        ("tokenizer_config.json", {"eos_token": 5}, "eos_token must be a token string"),
        ("tokenizer_config.json", {"eos_token": "<nope>"}, "not in the vocabulary"),
        ("tokenizer_config.json", {"add_bos_token": "false"}, "add_bos_token must be true or false"),
        ("tokenizer_config.json", {"chat_template": 5}, "chat_template must be a string"),
        ("tokenizer_config.json", {"chat_template": "{% for %}"}, "does not compile"),
        ("chat_template.jinja", b"\xff{{ x }}", "not UTF-8"),
    ],
)
def test_broken_tokenizer_files_are_one_line_errors_at_load(tmp_path, name, data, words):
    """Each used to load silently wrong (a string split into one-character special tokens, colliding
    ids, add_bos_token "false" read as true, eos id None) or fail later with a bare traceback."""
    path = _patched_copy(tmp_path, name, data)
    with pytest.raises(CheckpointError, match=words) as err:
        ErnieTokenizer.from_pretrained(path)
    assert "\n" not in str(err.value) and path in str(err.value)


@pytest.mark.parametrize(
    "template,words",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "template lines"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", "template lines"),
        ("{{ 'x' * 3000000000 }}", "too large"),
        ("{{ 7 ** 100000000 }}", "too large"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        # what builds a string or list whose size the template chooses, checked before it is built
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "a ~ b is too large",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "a \\+ b is too large",
        ),
        ("{{ 'x' | center(3000000000) }}", "center"),
        ("{{ 'a\nb' | indent(3000000000) }}", "indent"),
        ("{{ ('x' * 1000) | replace('x', 'y' * 1000000) }}", "replace"),
        ("{{ range(100000) | join('x' * 10000) }}", "join"),
        ("{{ [1] | batch(3000000000, 'x') | list }}", "batch"),
        ("{{ '%3000000000s' | format('x') }}", "format width"),
        ("{{ '%3000000000s' % 'x' }}", "format width"),
    ],
)
def test_hostile_chat_template_is_bounded_and_one_line(tmp_path, monkeypatch, template, words):
    """A checkpoint's template runs in the sandbox with a line and size budget: nested range() loops
    ran for hours, `'x' * 3e9` took 9 GB while compiling, Python errors escaped as tracebacks."""
    import erniekit.models.ernie4_5.tokenizer as tk

    monkeypatch.setattr(tk, "MAX_TEMPLATE_LINES", 20_000, raising=False)  # the default (2M) takes ~1 s to reach
    path = _patched_copy(tmp_path, "tokenizer_config.json", {"chat_template": template})
    tok = ErnieTokenizer.from_pretrained(path)
    with pytest.raises(DataError, match=words) as err:
        tok.apply_chat_template(CONVERSATION)
    assert "\n" not in str(err.value) and "tokenizer_config.json" in str(err.value)


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
