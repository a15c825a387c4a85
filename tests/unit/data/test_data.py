"""Data: synthetic arithmetic, format readers and their errors, encoding, packing, padding."""

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from erniekit.data import (
    IGNORE_INDEX,
    Conversation,
    encode_conversation,
    encode_conversations,
    encode_pretrain,
    exact_match,
    load_pretrain_texts,
    load_sft_examples,
    make_arithmetic,
    pack,
    pad_batch,
    split_heldout,
    write_arithmetic_dataset,
)
from erniekit.data.synthetic import answer, is_heldout
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

ROOT = str(Path(__file__).resolve().parents[3])
BUNDLED = os.path.join(ROOT, "examples", "data", "arithmetic")


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _check_answer(problem: str, answer: str) -> bool:
    for op in "+-*":
        a, sep, b = problem.rstrip("=").partition(op)
        if sep and a:
            return int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    raise AssertionError(problem)


# ------------------------------------------------------------------ synthetic
def test_arithmetic_answers_are_right_and_deterministic():
    rows = make_arithmetic(500, seed=3, min_digits=1, max_digits=3, ops=("+", "-", "*"))
    assert rows == make_arithmetic(500, seed=3, min_digits=1, max_digits=3, ops=("+", "-", "*"))
    assert rows != make_arithmetic(500, seed=4, min_digits=1, max_digits=3, ops=("+", "-", "*"))
    assert all(_check_answer(r["src"][0], r["tgt"][0]) for r in rows)
    assert any(r["tgt"][0].startswith("-") for r in rows)  # negative results allowed
    assert {len(x) for r in rows for x in r["src"][0].rstrip("=").replace("-", "+").replace("*", "+").split("+")} == {
        1,
        2,
        3,
    }


def test_train_and_eval_problems_are_disjoint():
    train = make_arithmetic(3000, seed=0, split="train")
    evals = make_arithmetic(200, seed=1, split="eval", unique=True)
    assert not {r["src"][0] for r in train} & {r["src"][0] for r in evals}
    assert len({r["src"][0] for r in evals}) == 200
    tr, held = split_heldout(make_arithmetic(2000, seed=5))
    assert held and all(is_heldout(r["src"][0]) for r in held) and not any(is_heldout(r["src"][0]) for r in tr)


def test_write_dataset_and_bundled_dataset(tmp_path):
    paths = write_arithmetic_dataset(str(tmp_path), n_train=300, n_eval=50, seed=0)
    assert sorted(os.path.basename(p) for p in paths.values()) == [
        "dpo_eval.jsonl",
        "dpo_train.jsonl",
        "eval.jsonl",
        "pretrain.jsonl",
        "rl_prompts.jsonl",
        "train.jsonl",
    ]
    from erniekit.data.preference import load_preference_pairs

    pairs = load_preference_pairs(paths["dpo_train"])
    assert len(pairs) == 60 and all(p.chosen == answer(p.prompt) != p.rejected for p in pairs)
    held = load_preference_pairs(paths["dpo_eval"])
    assert {p.prompt for p in held} == {c["src"][0] for c in map(json.loads, open(paths["eval"]))}
    pre = load_pretrain_texts(paths["pretrain"])
    bare = [t.removeprefix("Q: ").replace("=\nA: ", "=") for t in pre]  # both pretraining formats
    assert len(pre) == 300 and all(_check_answer(*t.split("=")) for t in bare)
    assert sum(t.startswith("Q: ") for t in pre) == 150
    # the shipped copy: sizes, correctness, disjointness
    train = load_sft_examples(os.path.join(BUNDLED, "train.jsonl"))
    evals = load_sft_examples(os.path.join(BUNDLED, "eval.jsonl"))
    pretrain = load_pretrain_texts(os.path.join(BUNDLED, "pretrain.jsonl"))
    assert (len(train), len(evals), len(pretrain)) == (20000, 500, 20000)
    assert all(_check_answer(c.turns[0][0], c.turns[0][1]) for c in train + evals)
    eval_q = {c.turns[0][0] for c in evals}
    assert len(eval_q) == 500
    assert not eval_q & {c.turns[0][0] for c in train}
    assert not eval_q & {t.split("=")[0] + "=" for t in pretrain}
    # RL prompts: correct, distinct, neither held out nor in the SFT data
    from erniekit.rl.data import load_prompts

    rl = load_prompts(os.path.join(BUNDLED, "rl_prompts.jsonl"))
    rl_q = [p.prompt_text for p in rl]
    assert len(rl) == 4000 == len(set(rl_q)) and all(_check_answer(p.prompt_text, p.fields["answer"]) for p in rl)
    assert not set(rl_q) & (eval_q | {c.turns[0][0] for c in train})
    assert sum(os.path.getsize(os.path.join(BUNDLED, f)) for f in os.listdir(BUNDLED)) < 2_000_000


def test_exact_match():
    assert exact_match(" 357\n", "357") and not exact_match("35", "357") and not exact_match("-2", "2")


# ------------------------------------------------------------------ formats
def test_erniekit_format(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"system": "S", "src": ["q1", "q2"], "tgt": ["a1", "a2"], "label": [0, 1]}),
            "",
            json.dumps({"src": "q", "tgt": "a"}),
        ],
    )
    convs = load_sft_examples(path)
    assert convs == [
        Conversation("S", [("q1", "a1"), ("q2", "a2")], [False, True]),
        Conversation(None, [("q", "a")], [True]),
    ]
    assert convs[1].source == f"{path}:3"


def test_alpaca_format_json_list_and_jsonl(tmp_path):
    recs = [
        {"instruction": "Add", "input": "1+2", "output": "3", "system": "S", "history": [["hi", "hello"]]},
        {"instruction": "Say hi", "output": "hi"},
    ]
    (tmp_path / "a.json").write_text(json.dumps(recs))
    _write(tmp_path / "a.jsonl", [json.dumps(r) for r in recs])
    for name in ("a.json", "a.jsonl"):
        convs = load_sft_examples(str(tmp_path / name), fmt="alpaca")
        assert convs[0] == Conversation("S", [("hi", "hello"), ("Add\n1+2", "3")], [True, True])
        assert convs[1] == Conversation(None, [("Say hi", "hi")], [True])


def test_messages_format(tmp_path):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    path = _write(tmp_path / "m.jsonl", [json.dumps({"messages": msgs}), json.dumps({"messages": msgs[1:3]})])
    convs = load_sft_examples(path)
    assert convs[0] == Conversation("S", [("u1", "a1"), ("u2", "a2")], [True, True])
    assert convs[0].messages() == msgs
    assert convs[1] == Conversation(None, [("u1", "a1")], [True])


def test_auto_detects_per_file_in_a_comma_list(tmp_path):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"src": ["q"], "tgt": ["a"]})])
    b = _write(tmp_path / "b.jsonl", [json.dumps({"instruction": "i", "output": "o"})])
    c = _write(
        tmp_path / "c.jsonl",
        [json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "m"}]})],
    )
    convs = load_sft_examples(f"{a}, {b},{c}")
    assert [c.turns for c in convs] == [[("q", "a")], [("i", "o")], [("u", "m")]]


def test_pretrain_texts_jsonl_and_txt(tmp_path):
    j = _write(tmp_path / "p.jsonl", [json.dumps({"text": "doc one\nsecond line"}), json.dumps({"text": "doc two"})])
    t = _write(tmp_path / "p.txt", ["first document", "", "second document  ", "   "])
    assert load_pretrain_texts(j) == ["doc one\nsecond line", "doc two"]
    assert load_pretrain_texts(t) == ["first document", "second document  "]
    assert load_pretrain_texts(f"{j},{t}") == ["doc one\nsecond line", "doc two", "first document", "second document  "]


def _err(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_input_errors(tmp_path):
    good = json.dumps({"src": ["q"], "tgt": ["a"]})
    bad_json = _write(tmp_path / "bad.jsonl", [good, '{"src": ["q"], "tgt": '])
    assert f"{bad_json}:2: invalid JSON" in _err(load_sft_examples, bad_json)
    # nesting and integers Python's decoder cannot hold were a RecursionError / ValueError traceback
    for line, why in (("[" * 100_000, "nested too deeply"), ('{"src": [1' + "0" * 5000 + "]}", "digits")):
        deep = _write(tmp_path / "deep.jsonl", [good, line])
        assert f"{deep}:2: invalid JSON" in _err(load_sft_examples, deep) and why in _err(load_sft_examples, deep)
    as_list = tmp_path / "list.json"
    as_list.write_text("[" * 100_000)
    assert "invalid JSON (arrays or objects nested too deeply" in _err(load_sft_examples, str(as_list))
    share = _write(
        tmp_path / "share.jsonl",
        [
            json.dumps(
                {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "[" * 100_000}]}
            )
        ],
    )
    assert "function_call value is not JSON (arrays or objects nested" in _err(load_sft_examples, share)

    missing = _write(tmp_path / "missing.jsonl", [good, json.dumps({"src": ["q"]})])
    assert f"{missing}:2: field 'tgt' missing" in _err(load_sft_examples, missing)

    typed = _write(tmp_path / "typed.jsonl", [json.dumps({"src": ["q"], "tgt": [3]})])
    assert f"{typed}:1: field 'tgt'" in _err(load_sft_examples, typed)

    mismatch = _write(tmp_path / "mm.jsonl", [json.dumps({"src": ["q1", "q2"], "tgt": ["a"]})])
    msg = _err(load_sft_examples, mismatch)
    assert f"{mismatch}:1" in msg and "2 turns" in msg and "1" in msg

    label = _write(tmp_path / "label.jsonl", [json.dumps({"src": ["q"], "tgt": ["a"], "label": [1, 0]})])
    assert "field 'label'" in _err(load_sft_examples, label)

    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    assert f"{empty}: no examples" in _err(load_sft_examples, empty)
    assert f"{empty}: no examples" in _err(load_pretrain_texts, empty)

    nowhere = str(tmp_path / "nowhere.jsonl")
    msg = _err(load_sft_examples, nowhere)
    assert nowhere in msg and "not found" in msg and "check" in msg

    assert "unknown data format 'sharegpt4'" in _err(load_sft_examples, bad_json, fmt="sharegpt4")

    roles = _write(
        tmp_path / "roles.jsonl",
        [json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "v"}]})],
    )
    assert f"{roles}:1: field 'messages'" in _err(load_sft_examples, roles)

    unknown = _write(tmp_path / "unknown.jsonl", [json.dumps({"question": "q", "answer": "a"})])
    assert "cannot tell the data format" in _err(load_sft_examples, unknown)

    notext = _write(tmp_path / "notext.jsonl", [json.dumps({"content": "x"})])
    assert f"{notext}:1: field 'text' missing" in _err(load_pretrain_texts, notext)


# ------------------------------------------------------------------ encoding
CONV = Conversation("You add numbers.", [("1+2=", "3"), ("10-12=", "-2"), ("5+5=", "10")], [True, False, True])


def test_sequence_is_the_chat_template_and_labels_mask_prompts(tok):
    ids, labels = encode_conversation(CONV, tok, max_seq_len=512)
    assert len(ids) == len(labels)
    rendered = tok.apply_chat_template(CONV.messages(), add_generation_prompt=False)
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    # trained spans: replies 0 and 2 plus their sep token; reply 1 has label 0
    spans, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == i
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    assert [tok.decode(s, skip_special_tokens=False) for s in spans] == ["3" + tok.sep_token, "10" + tok.sep_token]
    # the prompt tokens are exactly what inference encodes for the same history
    prompt = tok.apply_chat_template(CONV.messages()[:2], add_generation_prompt=True)
    assert ids[: len(tok.encode(prompt))] == tok.encode(prompt)
    assert labels[: len(tok.encode(prompt))] == [IGNORE_INDEX] * len(tok.encode(prompt))


def test_too_long_error_and_truncate_warning(tok):
    n = len(encode_conversation(CONV, tok, 512)[0])
    msg = _err(encode_conversations, [CONV, CONV], tok, n - 1)
    assert "example 0" in msg and str(n) in msg and f"max_seq_len={n - 1}" in msg and "truncation" in msg
    assert "example 3" in _err(encode_conversation, CONV, tok, n - 1, index=3)

    short = Conversation(None, [("1+1=", "2")], [True])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_conversations([CONV, short, CONV], tok, n - 1, truncation="truncate")
    texts = [str(w.message) for w in caught]
    assert texts == [f"2 of 3 conversations truncated to max_seq_len={n - 1}"]
    assert [len(x[0]) for x in out] == [n - 1, len(encode_conversation(short, tok, 512)[0]), n - 1]

    # cut inside the first prompt: nothing trained is left, so it is dropped and counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        limit = len(encode_conversation(short, tok, 512)[0])  # shorter than CONV's first prompt
        out = encode_conversations([CONV, short], tok, limit, truncation="truncate")
    assert len(out) == 1 and len(out[0][0]) == limit
    assert [str(w.message) for w in caught] == [
        f"1 of 2 conversations truncated to max_seq_len={limit}",
        "1 of 2 conversations dropped: no trained tokens left (truncated, or every label 0)",
    ]


def test_encode_pretrain_ends_with_eos_without_bos(tok):
    ids = encode_pretrain("12+3=15", tok)
    assert ids[-1] == tok.eos_token_id and ids[0] != tok.bos_token_id
    assert tok.decode(ids) == "12+3=15"


# ------------------------------------------------------------------ packing / padding
def test_pack_keeps_tokens_restarts_positions_and_separates_segments():
    rng = np.random.default_rng(0)
    seqs = [(list(rng.integers(5, 100, n)), list(rng.integers(5, 100, n))) for n in (5, 3, 7, 2, 8, 1)]
    seqs.append(list(range(5, 25)))  # bare ids, longer than a row -> chunked
    rows = pack(seqs, max_seq_len=8, pad_id=0)
    assert all(r[k].shape == (8,) and r[k].dtype == np.int64 for r in rows for k in r)
    real = np.concatenate([r["input_ids"][r["segment_ids"] > 0] for r in rows])
    expected = np.concatenate([np.asarray(s[0] if isinstance(s, tuple) else s) for s in seqs])
    assert np.array_equal(real, expected)  # every token kept, in order
    docs = []
    for r in rows:
        seg, pos = r["segment_ids"], r["position_ids"]
        n = int((seg > 0).sum())
        assert (seg[n:] == 0).all() and (r["input_ids"][n:] == 0).all() and (r["labels"][n:] == IGNORE_INDEX).all()
        assert (seg[:n] > 0).all() and (np.diff(seg[:n]) >= 0).all() and seg[0] == 1  # 1, 2, 3... in order
        for s in np.unique(seg[:n]):
            where = seg == s
            assert np.array_equal(pos[where], np.arange(where.sum()))  # positions restart per document
            docs.append(r["labels"][where])
            assert r["labels"][where][0] == IGNORE_INDEX  # no prediction across a document boundary
    assert [len(d) for d in docs] == [5, 3, 7, 2, 8, 1, 8, 8, 4]
    assert len(rows) == 8  # next-fit, in order: [5,3] [7] [2] [8] [1] [8] [8] [4]
    assert np.array_equal(docs[0][1:], seqs[0][1][1:])


def test_packed_documents_equal_pack_and_long_text_encodes_in_pieces(tok, monkeypatch, tmp_path):
    """Pretraining rows are built on demand from one int32 array (PackedDocuments), in memory or
    memory-mapped from a token store: the same rows as pack(); a long document is tokenized in pieces
    cut before a space, with the same ids."""
    import erniekit.data.encode as enc
    from erniekit.data.token_store import open_or_build

    rng = np.random.default_rng(1)
    for case, (L, shortest) in enumerate([(1, 1), (3, 1), (8, 1), (8, 0), (64, 0), (5, 5)]):
        docs = [rng.integers(0, 100, rng.integers(shortest, 30)) for _ in range(25)]  # 0: empty documents too
        store = open_or_build(str(tmp_path / f"s{case}"), {"case": case}, docs.copy)
        want = pack([(d, d) for d in docs], L, pad_id=7)
        for got in (
            enc.PackedDocuments(docs, L, pad_id=7),
            enc.PackedDocuments.from_arrays(store.tokens, store.doc_offsets, L, pad_id=7),
        ):
            assert len(got) == len(want) and len(got[:]) == len(want)
            for w, g in zip(want, got[:]):
                assert all(np.array_equal(w[k], g[k]) and g[k].dtype == np.int64 for k in w)
            assert np.array_equal(got[-1]["input_ids"], want[-1]["input_ids"])
    assert isinstance(store.tokens, np.memmap) and len(enc.PackedDocuments([], 4)) == 0
    text = " ".join(["12+34=46 hello world"] * 300)
    monkeypatch.setattr(enc, "PRETRAIN_PIECE_CHARS", 100)
    assert enc.encode_pretrain_array(text, tok).tolist() == encode_pretrain(text, tok)


def test_pad_batch(tok):
    batch = pad_batch([([7, 8, 9], [-100, 8, 9]), ([5], [5])], pad_id=tok.pad_token_id)
    assert batch["input_ids"].tolist() == [[7, 8, 9], [5, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 8, 9], [5, -100, -100]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert all(v.dtype == np.int64 for v in batch.values())
    assert pad_batch([[1, 2]], max_len=4)["input_ids"].shape == (1, 4)


def test_json_extension_holding_json_lines(tmp_path):
    path = _write(
        tmp_path / "lines.json",
        [json.dumps({"src": ["q1"], "tgt": ["a1"]}), json.dumps({"src": ["q2"], "tgt": ["a2"]})],
    )
    assert [c.turns for c in load_sft_examples(path)] == [[("q1", "a1")], [("q2", "a2")]]
    single = tmp_path / "one.json"
    single.write_text(json.dumps({"instruction": "i", "output": "o"}, indent=2))
    assert load_sft_examples(str(single))[0].turns == [("i", "o")]


def test_value_sampling_draws_problems_as_the_held_out_partition_holds_them():
    """The embedded default trains on operands uniform over 0..99: two-digit pairs are 81% of the
    problem space and of the held-out split, so they must be ~81% of training, not the 25% that
    digit-count sampling gives (which spent a quarter of the steps on 200 one-digit problems)."""

    def two_digit_share(rows):
        pairs = [r["src"][0].rstrip("=").replace("-", "+", 1).split("+") for r in rows]
        return sum(len(a) == 2 and len(b) == 2 for a, b in pairs) / len(rows)

    by_value = make_arithmetic(4000, seed=0, split="train", sampling="value")
    by_digits = make_arithmetic(4000, seed=0, split="train", sampling="digits")
    assert abs(two_digit_share(by_value) - 0.81) < 0.03
    assert abs(two_digit_share(by_digits) - 0.25) < 0.03
    assert all(_check_answer(r["src"][0], r["tgt"][0]) for r in by_value)
    with pytest.raises(DataError, match="sampling='uniform'"):
        make_arithmetic(1, seed=0, sampling="uniform")


def test_bundled_dataset_is_what_the_tool_writes(tmp_path):
    """examples/data/arithmetic is reproducible from tools/make_arithmetic.py's defaults."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_arithmetic.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in os.listdir(BUNDLED):
        assert (tmp_path / name).read_bytes() == open(os.path.join(BUNDLED, name), "rb").read(), name
