"""encode_conversations when every example is dropped: one DataError naming the data and why (it
used to return nothing after two warnings, and the run failed later at `pad_batch: empty batch`)."""

from __future__ import annotations

import warnings

import pytest

from erniekit.data.encode import encode_conversation, encode_conversations
from erniekit.data.formats import Conversation
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

LONG = Conversation("You add numbers.", [("1+2=", "3")], [True], source="data/train.jsonl:1")
MASKED = Conversation(None, [("1+1=", "2")], [False], source="data/train.jsonl:2")


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _raised(*args, **kwargs) -> tuple[str, list[str]]:
    """(the DataError's text, the warnings issued before it)."""
    with warnings.catch_warnings(record=True) as caught, pytest.raises(DataError) as e:
        warnings.simplefilter("always")
        encode_conversations(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg, [str(w.message) for w in caught]


def _prompt_len(conv: Conversation, tok) -> int:
    labels = encode_conversation(conv, tok, 512)[1]
    return next(i for i, label in enumerate(labels) if label != -100)


def test_every_example_truncated_away_is_one_error(tok):
    limit = _prompt_len(LONG, tok)  # the cut keeps only the prompt
    msg, warned = _raised([LONG, LONG], tok, limit, "truncate", where="data/train.jsonl")
    assert msg == (
        f"data/train.jsonl: all 2 examples were dropped (2 with a prompt longer than max_seq_len={limit}); "
        "raise max_seq_len"
    )
    assert warned == []  # the error says it all


def test_every_label_zero_is_one_error_naming_the_files(tok):
    msg, _ = _raised([MASKED, MASKED], tok, 512)
    assert msg == (
        "data/train.jsonl: all 2 examples were dropped (2 with no trained reply (every label 0)); check the labels"
    )


def test_both_causes_are_counted(tok):
    limit = _prompt_len(LONG, tok)
    assert len(encode_conversation(MASKED, tok, 512)[0]) <= limit  # it fits: dropped for its label only
    msg, _ = _raised([LONG, MASKED, LONG], tok, limit, "truncate", where="eval.jsonl")
    assert msg == (
        f"eval.jsonl: all 3 examples were dropped (2 with a prompt longer than max_seq_len={limit}, 1 with no "
        "trained reply (every label 0)); raise max_seq_len or check the labels"
    )


def test_some_dropped_still_trains_on_the_rest(tok):
    ok = Conversation(None, [("1+1=", "2")], [True])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_conversations([MASKED, ok], tok, 512)
    assert len(out) == 1
    assert [str(w.message) for w in caught] == [
        "1 of 2 conversations dropped: no trained tokens left (truncated, or every label 0)"
    ]
