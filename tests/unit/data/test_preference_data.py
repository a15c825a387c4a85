"""Preference data: each reader, each bad-input error (with file:line), pair encoding."""

import json
import warnings

import pytest

from erniekit.data.encode import IGNORE_INDEX
from erniekit.data.preference import (
    PreferencePair,
    encode_preference_pair,
    encode_preference_pairs,
    load_preference_pairs,
)
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _write(path, records):
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records) + "\n",
        encoding="utf-8",
    )
    return str(path)


def _err(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


ERNIE = {
    "system": "You add numbers.",
    "src": ["1+1=", "2+3="],
    "tgt": ["2"],
    "response": [["5"], ["6"]],
    "sort": [1, 0],
}


# ------------------------------------------------------------------ readers
def test_erniekit_format_and_sort_semantics(tmp_path):
    path = _write(
        tmp_path / "dpo.jsonl",
        [
            ERNIE,
            dict(ERNIE, sort=[0, 1]),  # the SECOND response is chosen
            dict(ERNIE, sort=[0.25, 0.75]),
            {"src": "7+1=", "tgt": [], "response": ["8", "9"], "sort": [3, -1]},  # bare strings, single turn
            {"src": ["sys prompt", "4+4="], "tgt": ["ok"], "response": [["8"], ["7"]], "sort": [1, 0], "is_system": 1},
        ],
    )
    pairs = load_preference_pairs(path)
    assert pairs[0] == PreferencePair("You add numbers.", [("1+1=", "2")], "2+3=", "5", "6", f"{path}:1")
    assert pairs[0].source == f"{path}:1"
    assert (pairs[1].chosen, pairs[1].rejected) == ("6", "5")
    assert (pairs[2].chosen, pairs[2].rejected) == ("6", "5")
    assert pairs[3] == PreferencePair(None, [], "7+1=", "8", "9")
    assert pairs[4] == PreferencePair("sys prompt", [], "4+4=", "8", "7")
    assert load_preference_pairs(path, fmt="erniekit") == pairs


def test_prompt_messages_and_alpaca_formats(tmp_path):
    prompt = _write(
        tmp_path / "prompt.jsonl",
        [
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
            {
                "prompt": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ],
                "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": "no"}],
            },
        ],
    )
    assert load_preference_pairs(prompt) == [
        PreferencePair(None, [], "2+2=", "4", "5"),
        PreferencePair("S", [("a", "b")], "c", "yes", "no"),
    ]
    messages = _write(
        tmp_path / "messages.jsonl",
        [
            {
                "messages": [{"role": "user", "content": "1+2="}],
                "chosen": "3",
                "rejected": {"role": "assistant", "content": "4"},
            },
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                    {"role": "user", "content": "z"},
                ],
                "chosen": "good",
                "rejected": "bad",
            },
        ],
    )
    assert load_preference_pairs(messages) == [
        PreferencePair(None, [], "1+2=", "3", "4"),
        PreferencePair("S", [("x", "y")], "z", "good", "bad"),
    ]
    alpaca = tmp_path / "alpaca.json"  # a JSON list
    alpaca.write_text(
        json.dumps(
            [
                {
                    "instruction": "Add",
                    "input": "1+2",
                    "chosen": "3",
                    "rejected": "4",
                    "system": "S",
                    "history": [["h", "i"]],
                },
                {"question": "2*3=", "chosen": "6", "rejected": "5"},
            ]
        ),
        encoding="utf-8",
    )
    assert load_preference_pairs(str(alpaca)) == [
        PreferencePair("S", [("h", "i")], "Add\n1+2", "3", "4"),
        PreferencePair(None, [], "2*3=", "6", "5"),
    ]
    both = load_preference_pairs(f"{prompt},{messages}")  # comma list, detected per file
    assert len(both) == 4 and both[2].source == f"{messages}:1"


def test_bad_input_errors(tmp_path):
    good = json.dumps(ERNIE)
    cases = {
        "malformed JSON": ([good, '{"src": ["q"], '], 2, "invalid JSON"),
        "missing chosen": ([{"prompt": "p", "rejected": "r"}], 1, "field 'chosen' missing"),
        "missing rejected": (
            [{"prompt": "p", "chosen": "c"}, {"prompt": "p", "chosen": "c"}],
            1,
            "field 'rejected' missing",
        ),
        "identical (prompt)": ([{"prompt": "p", "chosen": "same", "rejected": "same"}], 1, "identical"),
        "identical (erniekit)": ([good, dict(ERNIE, response=[["5"], ["5"]])], 2, "identical"),
        "empty reply": ([{"prompt": "p", "chosen": "  ", "rejected": "r"}], 1, "chosen reply is empty"),
        "sort too long": ([dict(ERNIE, sort=[1, 0, 2])], 1, "field 'sort'"),
        "sort equal ranks": ([dict(ERNIE, sort=[1, 1])], 1, "field 'sort' must be two different numbers"),
        "sort non-numeric": ([dict(ERNIE, sort=["1", "0"])], 1, "field 'sort'"),
        "sort bool": ([dict(ERNIE, sort=[True, False])], 1, "field 'sort'"),
        "sort missing": ([{k: v for k, v in ERNIE.items() if k != "sort"}], 1, "field 'sort' must be"),
        "response one entry": ([dict(ERNIE, response=[["5"]], sort=[1])], 1, "field 'response' has 1 entries"),
        "multi-turn response": (
            [dict(ERNIE, response=[["5", "q", "a"], ["6"]])],
            1,
            "multi-turn responses are not supported",
        ),
        "src/tgt equal": ([dict(ERNIE, tgt=["2", "5"])], 1, "'src' has 2 turns and 'tgt' 2"),
        "src/tgt short": ([dict(ERNIE, src=["q1", "q2", "q3"])], 1, "len(src) == len(tgt) + 1"),
        "messages end with assistant": (
            [
                {
                    "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
                    "chosen": "c",
                    "rejected": "r",
                }
            ],
            1,
            "field 'messages' roles",
        ),
        "not an object": ([good, "[1, 2]"], 2, "expected a JSON object"),
        "unknown keys": ([{"query": "q", "answer": "a"}], 1, "cannot tell the preference format"),
    }
    for i, (name, (lines, line, text)) in enumerate(cases.items()):
        path = _write(tmp_path / f"bad{i}.jsonl", lines)
        msg = _err(load_preference_pairs, path)
        assert f"{path}:{line}" in msg and text in msg, (name, msg)

    empty = _write(tmp_path / "empty.jsonl", ["", "   "])
    assert f"{empty}: no preference examples" in _err(load_preference_pairs, empty)
    assert "unknown preference data format 'kto'" in _err(load_preference_pairs, empty, fmt="kto")
    missing = str(tmp_path / "nowhere.jsonl")
    assert "not found" in _err(load_preference_pairs, missing)


# ------------------------------------------------------------------ encoding
PAIR = PreferencePair("You add numbers.", [("1+1=", "2"), ("3+4=", "7")], "20+22=", "42", "forty-two, I think")


def _trained(ids, labels):
    out = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert out == [lab for lab in labels if lab != IGNORE_INDEX]  # labels are the ids, unshifted
    return out


def test_chosen_and_rejected_share_the_prompt_and_train_on_the_reply(tok):
    enc = encode_preference_pair(PAIR, tok, max_seq_len=256)
    n = enc["prompt_len"]
    assert enc["chosen_ids"][:n] == enc["rejected_ids"][:n] and n > 0
    assert enc["chosen_labels"][:n] == [IGNORE_INDEX] * n == enc["rejected_labels"][:n]
    assert enc["chosen_ids"][n:] != enc["rejected_ids"][n:]
    # every token after the prompt is trained and decodes to the reply + its sep token
    for side, reply in (("chosen", PAIR.chosen), ("rejected", PAIR.rejected)):
        ids, labels = enc[f"{side}_ids"], enc[f"{side}_labels"]
        assert all(lab != IGNORE_INDEX for lab in labels[n:])
        assert tok.decode(_trained(ids, labels), skip_special_tokens=False) == reply + tok.sep_token
        # the whole sequence is the chat-template rendering, as in SFT and chat
        msgs = PAIR.conversation(reply).messages()
        assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert not enc["truncated"]

    # single turn: the prompt ids are exactly what inference encodes
    single = PreferencePair(None, [], "2+2=", "4", "5")
    enc = encode_preference_pair(single, tok, 64)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=True)
    assert enc["chosen_ids"][: enc["prompt_len"]] == prompt == enc["rejected_ids"][: enc["prompt_len"]]


def test_erniekit_sort_decides_which_sequence_is_chosen(tmp_path, tok):
    path = _write(tmp_path / "s.jsonl", [dict(ERNIE, sort=[0, 1])])
    enc = encode_preference_pair(load_preference_pairs(path)[0], tok, 128)
    assert tok.decode(_trained(enc["chosen_ids"], enc["chosen_labels"])) == "6"
    assert tok.decode(_trained(enc["rejected_ids"], enc["rejected_labels"])) == "5"


def test_too_long_error_and_left_truncation(tok):
    full = encode_preference_pair(PAIR, tok, 256)
    n = full["prompt_len"]
    longest = max(len(full["chosen_ids"]), len(full["rejected_ids"]))
    msg = _err(encode_preference_pair, PAIR, tok, longest - 1, index=4)
    assert (
        "preference pair 4" in msg
        and str(longest) in msg
        and f"max_seq_len={longest - 1}" in msg
        and "truncation" in msg
    )

    cut = encode_preference_pair(PAIR, tok, longest - 5, truncation="truncate")
    assert cut["truncated"] and cut["prompt_len"] == n - 5
    for side in ("chosen", "rejected"):
        assert cut[f"{side}_ids"] == full[f"{side}_ids"][5:]  # prompt lost its 5 oldest tokens, reply intact
        assert cut[f"{side}_labels"] == full[f"{side}_labels"][5:]
        assert len(cut[f"{side}_ids"]) <= longest - 5
    assert cut["chosen_ids"][: n - 5] == cut["rejected_ids"][: n - 5]

    # too small even for the reply: one prompt token is kept and the replies are cut on the right
    tiny = encode_preference_pair(PAIR, tok, 3, truncation="truncate")
    assert tiny["prompt_len"] == 1 and all(len(tiny[f"{s}_ids"]) == 3 for s in ("chosen", "rejected"))
    assert tiny["chosen_ids"][0] == tiny["rejected_ids"][0] == full["chosen_ids"][n - 1]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_preference_pairs(
            [PAIR, PreferencePair(None, [], "1=", "1", "2"), PAIR], tok, longest - 5, truncation="truncate"
        )
    assert [str(w.message) for w in caught] == [f"2 of 3 preference pairs truncated to max_seq_len={longest - 5}"]
    assert [e["truncated"] for e in out] == [True, False, True]
    assert "truncation='cut'" in _err(encode_preference_pair, PAIR, tok, 64, truncation="cut")
