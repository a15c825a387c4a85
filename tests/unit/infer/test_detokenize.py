"""TextStream: the pieces it emits, joined with what is pending, are exactly tokenizer.decode of
all ids, for any ids (byte-fallback pieces of multi-byte characters, special tokens, spaces), and
a piece never ends inside a character."""

from __future__ import annotations

import random

import pytest

from erniekit.infer.detokenize import TextStream
from erniekit.models.ernie4_5.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _stream(tok, ids):
    ts, pieces = TextStream(tok), []
    for i in ids:
        pieces.append(ts.push(i))
    return ts, pieces


def test_random_ids_stream_to_the_whole_decode(tok):
    rng = random.Random(0)
    text = "Größe 中文 テスト 12+34=46, émigré 🙂 tab\tand  two  spaces\n"
    natural = tok.encode(text * 3)
    specials = sorted(tok.all_special_ids)
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        else:  # real text, cut anywhere, with special tokens dropped in
            ids = natural[rng.randrange(len(natural)) :][: rng.randrange(1, 80)]
            for _ in range(rng.randrange(3)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        ts, pieces = _stream(tok, ids)
        whole = tok.decode(ids)
        assert "".join(pieces) + ts.pending == whole == ts.text(), ids
        assert not any(p.endswith("\ufffd") for p in pieces), ids


def test_a_multibyte_character_is_held_until_complete_and_last_reads_the_tail(tok):
    ids = tok.encode("ab 中")
    ts, pieces = _stream(tok, ids)
    assert "".join(pieces) == "ab 中" and ts.pending == ""
    assert ts.last(2) == " 中" and ts.last(100) == "ab 中" and ts.last(0) == ""
    byte_ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "中".encode()]
    if all(0 <= i < tok.vocab_size for i in byte_ids):  # the tokenizer has byte fallback
        ts = TextStream(tok)
        assert [ts.push(i) for i in byte_ids] == ["", "", "中"]


def test_each_push_decodes_a_window_not_the_whole_reply(tok):
    """The cost of a token does not grow with the reply: every decode sees a few tokens."""
    seen = []

    class Counting:
        def decode(self, ids):
            seen.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 50)
    ts = TextStream(Counting())
    for i in ids:
        ts.push(i)
    assert ts.text() == tok.decode(ids) and len(ids) > 400
    assert max(seen) <= 8, max(seen)
