"""Control attributes (docs/control.md): one rendering, deterministic attribute dropping that a rebuilt
(resumed) run repeats, every SFT reader carrying `control`, the follow checks and the bundled demo data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from erniekit.data.control import (
    CONTROL_RECORD_NAME,
    FOLLOW_CHECKS,
    MAX_RECORDED_VALUES,
    check_control,
    check_trained_control,
    control_system,
    count_controls,
    drop_control,
    drop_controls,
    follows,
    merge_records,
    parse_control_args,
    read_control_record,
    render_control,
    with_control,
    write_control_record,
)
from erniekit.data.encode import IGNORE_INDEX, encode_conversation
from erniekit.data.formats import Conversation, load_sft_examples
from erniekit.data.synthetic_control import make_control_records, number_words, write_control_dataset
from erniekit.errors import CheckpointError, DataError

ROOT = Path(__file__).resolve().parents[3]


def test_the_prefix_is_one_line_with_sorted_attributes():
    assert render_control({"style": "words", "length": "short"}) == "<control>length=short; style=words</control>"
    assert render_control({"length": "short", "style": "words"}) == render_control(
        {"style": "words", "length": "short"}
    )
    assert render_control({}) == ""
    assert control_system(None, {"a": "b"}) == "<control>a=b</control>"
    assert control_system("Be brief.", {"a": "b"}) == "<control>a=b</control>\nBe brief."
    assert control_system("Be brief.", {}) == "Be brief."


def test_with_control_puts_the_prefix_in_the_system_message():
    user = [{"role": "user", "content": "1+2="}]
    assert with_control(user, {"style": "words"}) == [
        {"role": "system", "content": "<control>style=words</control>"},
        *user,
    ]
    sys_msgs = [{"role": "system", "content": "S"}, *user]
    assert with_control(sys_msgs, {"style": "words"})[0] == {
        "role": "system",
        "content": "<control>style=words</control>\nS",
    }
    assert with_control(sys_msgs, {}) is sys_msgs
    assert sys_msgs[0]["content"] == "S"  # the caller's list is not changed


@pytest.mark.parametrize(
    "bad, what",
    [
        ("words", "must be an object"),
        ({"style": 3}, "control.style must be a non-empty string"),
        ({"style": ""}, "non-empty string"),
        ({"style": "a;b"}, "without ; = < >"),
        ({"style": "x" * 65}, "at most 64"),
        ({"1x": "a"}, "key '1x'"),
        ({"a b": "a"}, "key 'a b'"),
        ({f"k{i}": "v" for i in range(9)}, "at most 8"),
        ({"style": "a\u2028b"}, "or line breaks"),  # a Unicode line break splits the prefix line too
        ({"style": "a\x85b"}, "or line breaks"),
        ({"k" * 100_000: "a"}, "key 'kkkk"),
    ],
)
def test_bad_control_is_one_line_naming_where(bad, what):
    with pytest.raises(DataError, match="^f.jsonl:3: .*" + what.replace("(", r"\(")) as e:
        check_control(bad, "f.jsonl:3")
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_dropping_is_a_fixed_function_of_seed_index_and_key():
    control = {"style": "words", "length": "short"}
    assert drop_control(control, 0.0, 1, 5) == control and drop_control(control, 1.0, 1, 5) == {}
    runs = [[drop_control(control, 0.3, 42, i) for i in range(2000)] for _ in range(2)]
    assert runs[0] == runs[1]  # a rebuilt (resumed) run drops the same attributes
    assert runs[0] != [drop_control(control, 0.3, 43, i) for i in range(2000)]  # another seed, another draw
    kept = sum(len(c) for c in runs[0]) / (2 * 2000)
    assert kept == pytest.approx(0.7, abs=0.03)
    # each attribute is drawn on its own: both-kept, one-kept and none-kept all occur
    assert {len(c) for c in runs[0]} == {0, 1, 2}


def test_drop_controls_keeps_everything_else_and_the_order():
    convs = [Conversation(None, [(f"{i}+1=", str(i + 1))], [True], control={"style": "digits"}) for i in range(50)]
    dropped = drop_controls(convs, 0.5, 7)
    assert [c.turns for c in dropped] == [c.turns for c in convs]
    assert [c.control for c in dropped] == [drop_control({"style": "digits"}, 0.5, 7, i) for i in range(50)]
    assert 0 < sum(not c.control for c in dropped) < 50
    assert all(c.control == {"style": "digits"} for c in convs)  # the input is not changed


def test_parse_control_args():
    assert parse_control_args(["style=words", "length=short"]) == {"style": "words", "length": "short"}
    with pytest.raises(DataError, match="must be KEY=VALUE"):
        parse_control_args(["style"])
    with pytest.raises(DataError, match="twice"):
        parse_control_args(["style=a", "style=b"])


RECORDS = {
    "erniekit": {"src": ["1+2="], "tgt": ["three"]},
    "alpaca": {"instruction": "1+2=", "output": "three"},
    "messages": {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "three"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "1+2="}, {"from": "gpt", "value": "three"}]},
    "erniekit_vl": {"text_info": [{"text": "1+2=", "tag": "mask"}, {"text": "three", "tag": "no_mask"}]},
}


@pytest.mark.parametrize("fmt", sorted(RECORDS))
def test_every_sft_format_carries_control_into_the_rendered_prompt(fmt, tmp_path):
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({**RECORDS[fmt], "control": {"style": "words"}}) + "\n" + json.dumps(RECORDS[fmt]) + "\n"
    )
    with_ctl, without = load_sft_examples(str(path))
    assert with_ctl.control == {"style": "words"} and without.control == {}
    tok = default_tokenizer()
    ids, labels = encode_conversation(with_ctl, tok, 512)
    prompt = tok.decode([i for i, l in zip(ids, labels) if l == IGNORE_INDEX])
    assert "<control>style=words</control>" in prompt  # in the prompt, never a trained target
    assert "control" not in tok.decode([i for i, l in zip(ids, labels) if l != IGNORE_INDEX])
    plain = encode_conversation(without, tok, 512)[0]
    assert "control" not in tok.decode(plain)


def test_a_bad_control_in_a_file_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"src": "a", "tgt": "b"}) + "\n" + json.dumps({"src": "a", "tgt": "b", "control": ["x"]}) + "\n"
    )
    with pytest.raises(DataError, match=rf"^{path}:2: field 'control' must be an object"):
        load_sft_examples(str(path))


def test_a_llama_factory_dataset_carries_control(tmp_path):
    (tmp_path / "data.json").write_text(
        json.dumps([{"instruction": "1+2=", "output": "3", "control": {"style": "digits"}}])
    )
    (tmp_path / "dataset_info.json").write_text(json.dumps({"arith": {"file_name": "data.json"}}))
    (conv,) = load_sft_examples(f"{tmp_path}/dataset_info.json:arith")
    assert conv.control == {"style": "digits"}


def test_follow_checks():
    words, digits = FOLLOW_CHECKS[("style", "words")], FOLLOW_CHECKS[("style", "digits")]
    assert words("forty-three") and words("minus one hundred ninety-eight") and words("zero")
    assert not words("43") and not words("forty 3") and not words("hello")
    assert digits("43") and digits("-7") and not digits("forty-three") and not digits("4 3")
    assert follows({"style": "words", "length": "short"}, "nine") == {("style", "words"): True}


def test_number_words():
    cases = {0: "zero", 7: "seven", 13: "thirteen", 40: "forty", 43: "forty-three", 100: "one hundred"}
    cases.update({123: "one hundred twenty-three", 198: "one hundred ninety-eight", -37: "minus thirty-seven"})
    for n, text in cases.items():
        assert number_words(n) == text
        assert FOLLOW_CHECKS[("style", "words")](text)


def test_demo_data_asks_every_held_out_problem_in_both_styles():
    evals = make_control_records(30, 0, "eval")
    train = make_control_records(500, 0, "train")
    assert len(evals) == 60
    assert [r["control"]["style"] for r in evals] == ["digits", "words"] * 30
    assert all(evals[i]["src"] == evals[i + 1]["src"] for i in range(0, 60, 2))
    assert not {r["src"][0] for r in evals} & {r["src"][0] for r in train}
    styles = [r["control"]["style"] for r in train]
    assert 200 < styles.count("words") < 300
    for r in train:
        assert follows(r["control"], r["tgt"][0]) == {("style", r["control"]["style"]): True}


def test_the_bundled_demo_data_is_what_the_generator_writes(tmp_path):
    paths = write_control_dataset(str(tmp_path), 5000, 100, 0)
    bundled = ROOT / "examples" / "data" / "control"
    for split, path in paths.items():
        assert Path(path).read_bytes() == (bundled / f"{split}.jsonl").read_bytes(), split


# ---- the record of trained attributes (control_attributes.json) -----------------------------------
def test_the_record_counts_values_per_key_and_opens_a_key_past_the_bound():
    many = [{"topic": f"t{i:03d}"} for i in range(MAX_RECORDED_VALUES + 1)] + [{"topic": "t000"}]
    rec = count_controls([{"style": "words"}, {"style": "digits", "length": "short"}, {}, {"style": "words"}, *many])
    assert rec["records"] == 3 + len(many)
    assert rec["attributes"]["style"] == {"open": False, "values": {"digits": 1, "words": 2}}
    assert rec["attributes"]["length"] == {"open": False, "values": {"short": 1}}
    topic = rec["attributes"]["topic"]
    assert topic["open"] and len(topic["values"]) == MAX_RECORDED_VALUES and topic["values"]["t000"] == 2
    exactly = count_controls([{"k": f"v{i}"} for i in range(MAX_RECORDED_VALUES)])["attributes"]["k"]
    assert not exactly["open"] and len(exactly["values"]) == MAX_RECORDED_VALUES
    assert count_controls([{}, {}])["attributes"] == {}


def test_records_merge_by_adding_counts():
    a = count_controls([{"style": "words"}, {"style": "digits"}])
    b = count_controls([{"style": "words", "tone": "formal"}])
    m = merge_records(a, b)
    assert m["records"] == 3
    assert m["attributes"] == {
        "style": {"open": False, "values": {"digits": 1, "words": 2}},
        "tone": {"open": False, "values": {"formal": 1}},
    }
    assert merge_records(None, b) == merge_records(b, count_controls([])) == {**b, "version": 1}
    assert merge_records(None, count_controls([{}])) is None
    # more distinct values together than a record keeps: the key becomes open
    x = count_controls([{"k": f"a{i}"} for i in range(40)])
    y = count_controls([{"k": f"b{i}"} for i in range(40)])
    assert merge_records(x, y)["attributes"]["k"]["open"]


def test_a_record_is_written_read_back_and_a_stale_one_removed(tmp_path):
    rec = count_controls([{"style": "words"}])
    assert read_control_record(str(tmp_path)) is None and read_control_record("tiny-moe") is None
    write_control_record(str(tmp_path), rec)
    assert read_control_record(str(tmp_path)) == rec
    write_control_record(str(tmp_path), None)
    assert not (tmp_path / CONTROL_RECORD_NAME).exists()


@pytest.mark.parametrize(
    "text, what",
    [
        ("{", "invalid JSON"),
        ('{"version": 3, "attributes": {}}', "version 3 is not 1 or 2"),
        ('{"version": 1, "records": "5000", "attributes": {}}', "'records' must be the number of training records"),
        ('{"version": 1, "attributes": {"style": ["words"]}}', "attributes.style must be"),
        ('{"version": 1, "attributes": {"style": {"open": false, "values": {"w": "x"}}}}', "record count"),
    ],
)
def test_a_damaged_record_is_one_line(tmp_path, text, what):
    (tmp_path / CONTROL_RECORD_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=what) as e:
        read_control_record(str(tmp_path))
    assert "\n" not in str(e.value) and "delete it to skip the check" in str(e.value)


def test_untrained_attributes_and_closed_values_are_refused_with_a_did_you_mean():
    rec = count_controls([{"style": "words", "length": "short"}, {"style": "digits", "length": "long"}])
    rec = merge_records(rec, count_controls([{"topic": f"t{i}"} for i in range(MAX_RECORDED_VALUES + 1)]))
    check_trained_control({"style": "words", "length": "long"}, rec, "--control ")
    check_trained_control({"topic": "anything at all"}, rec, "--control ")  # an open key takes any value
    with pytest.raises(DataError) as e:
        check_trained_control({"stlye": "words"}, rec, "--control ", "m/control_attributes.json")
    assert str(e.value) == (
        "--control stlye=words: this model was not trained with the attribute 'stlye' (did you mean 'style'?); "
        "its attributes: length, style, topic (m/control_attributes.json; docs/control.md)"
    )
    with pytest.raises(DataError) as e:
        check_trained_control({"style": "wrods"}, rec, "control ")
    assert str(e.value) == (
        "control style=wrods: this model was trained on style = digits, words only (did you mean 'words'?) "
        "(docs/control.md)"
    )
    with pytest.raises(DataError, match="attribute 'zzz'; its attributes"):  # nothing close: no guess
        check_trained_control({"zzz": "words"}, rec, "")
    check_trained_control({"stlye": "words"}, None, "--control ")  # no record (a base model): no check
