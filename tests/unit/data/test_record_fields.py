"""Record keys a format does not read: a misspelled field is an error naming file:line and the field
meant (it used to be dropped, changing what trains); other keys get one warning per file."""

from __future__ import annotations

import json
import warnings

import pytest

from erniekit.data.formats import _misspelled, load_pretrain_texts, load_sft_examples
from erniekit.data.preference import load_preference_pairs
from erniekit.errors import DataError


def _write(path, records) -> str:
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    return str(path)


def _err(fn, *args) -> str:
    with pytest.raises(DataError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _load(fn, *args):
    """(result, the warnings' texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "record, typo, meant",
    [
        ({"instruction": "Add", "inputs": "1+1", "output": "2"}, "inputs", "input"),  # trained on "Add" alone
        ({"src": ["1+1="], "tgt": ["2"], "lable": [0]}, "lable", "label"),  # trained the masked reply
        ({"src": ["1+1="], "tgt": ["2"], "sytem": "be terse"}, "sytem", "system"),  # dropped the system prompt
        ({"instruction": "Add", "output": "2", "System": "be terse"}, "System", "system"),
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "tool": "[]"},
            "tool",
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "contrl": {}},
            "contrl",
            "control",
        ),
    ],
)
def test_a_misspelled_sft_field_is_an_error_naming_the_field_meant(tmp_path, record, typo, meant):
    path = _write(tmp_path / "sft.jsonl", [record, record])
    assert _err(load_sft_examples, path) == f"{path}:1: unknown field '{typo}'; did you mean '{meant}'?"


def test_a_misspelled_field_is_caught_with_the_format_given(tmp_path):
    path = _write(tmp_path / "a.jsonl", [{"instruction": "Add", "output": "2"}, {"instruction": "Add", "ouput": "2"}])
    assert _err(load_sft_examples, path, "alpaca") == f"{path}:2: unknown field 'ouput'; did you mean 'output'?"


def test_other_keys_are_ignored_with_one_warning_per_file(tmp_path):
    a = _write(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Add", "input": "1+1", "output": "2", "id": 1, "meta": {"src": "x"}},
            {"instruction": "Sub", "input": "3-1", "output": "2", "id": 2, "source": "web"},
        ],
    )
    b = _write(tmp_path / "b.jsonl", [{"src": ["1+1="], "tgt": ["2"], "uid": "u"}])
    convs, texts = _load(load_sft_examples, f"{a},{b}")
    assert texts == [
        f"{a}: fields ['id', 'meta', 'source'] are not read by the alpaca format and are ignored",
        f"{b}: fields ['uid'] are not read by the erniekit format and are ignored",
    ]
    assert [c.turns for c in convs] == [[("Add\n1+1", "2")], [("Sub\n3-1", "2")], [("1+1=", "2")]]


def test_real_world_layouts_load_without_warnings(tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    files = {
        "alpaca": [  # LLaMA-Factory alpaca
            {"instruction": "Add", "input": "1+1", "output": "2", "system": "S", "history": [["a", "b"]]}
        ],
        "sharegpt": [
            {
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
                "system": "S",
                "tools": json.dumps([t["function"] for t in tools]),
            }
        ],
        "messages": [{"messages": msgs, "tools": tools}],
        "erniekit": [
            {"system": "S", "src": ["q1", "q2"], "tgt": ["a1", "a2"], "label": [0, 1], "control": {"tone": "x"}}
        ],
        "erniekit_vl": [
            {"image_info": [], "text_info": [{"text": "q", "tag": "mask"}, {"text": "a", "tag": "no_mask"}]}
        ],
    }
    for name, records in files.items():
        convs, texts = _load(load_sft_examples, _write(tmp_path / f"{name}.jsonl", records))
        assert len(convs) == len(records) and texts == [], name


def test_openai_messages_with_an_id_warn_about_the_id_only(tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = _write(tmp_path / "m.jsonl", [{"id": "chatcmpl-1", "messages": msgs}])
    convs, texts = _load(load_sft_examples, path)
    assert convs[0].turns == [("hi", "yo")]
    assert texts == [f"{path}: fields ['id'] are not read by the messages format and are ignored"]


def test_erniekit_is_system_takes_src0_as_the_system_prompt(tmp_path):
    """ERNIEKit's is_system: 1 (src[0] is the system prompt, tgt[0] its placeholder reply): read, not
    dropped (src[0] would train as a user turn, tgt[0] as a reply)."""
    rec = {"src": ["be terse", "1+1="], "tgt": ["ok", "2"], "label": [1, 0], "is_system": 1}
    path = _write(tmp_path / "s.jsonl", [rec, dict(rec, is_system=0)])
    (sys1, sys0), texts = _load(load_sft_examples, path)
    assert texts == []
    assert (sys1.system, sys1.turns, sys1.train_on) == ("be terse", [("1+1=", "2")], [False])
    assert (sys0.system, sys0.turns, sys0.train_on) == (None, [("be terse", "ok"), ("1+1=", "2")], [True, False])
    assert "'is_system' must be 0 or 1" in _err(
        load_sft_examples, _write(tmp_path / "b.jsonl", [dict(rec, is_system=2)])
    )
    both = _write(tmp_path / "c.jsonl", [dict(rec, system="S")])
    assert _err(load_sft_examples, both) == (
        f"{both}:1: 'system' and 'is_system': 1 both give a system prompt; keep one"
    )


def test_keys_that_name_something_else_are_not_typos(tmp_path):
    """A key holding a field as a word (prompt_id, input_ids, is_system) or beside the field itself is
    another column, warned about, not refused."""
    alpaca = _write(tmp_path / "a.jsonl", [{"instruction": "A", "output": "2", "input_ids": [1], "is_system": 1}])
    _, texts = _load(load_sft_examples, alpaca)
    assert texts == [f"{alpaca}: fields ['input_ids', 'is_system'] are not read by the alpaca format and are ignored"]
    both = _write(tmp_path / "b.jsonl", [{"instruction": "A", "input": "1", "inputs": "x", "output": "2"}])
    _, texts = _load(load_sft_examples, both)
    assert texts == [f"{both}: fields ['inputs'] are not read by the alpaca format and are ignored"]
    ufb = _write(  # UltraFeedback-style TRL prompt data
        tmp_path / "p.jsonl",
        [{"prompt": "1+1=", "prompt_id": "abc", "chosen": "2", "rejected": "3", "score_chosen": 9.0}],
    )
    pairs, texts = _load(load_preference_pairs, ufb)
    assert pairs[0].chosen == "2"
    assert texts == [f"{ufb}: fields ['prompt_id', 'score_chosen'] are not read by the prompt format and are ignored"]


@pytest.mark.parametrize(
    "record, typo, meant",
    [
        ({"src": ["1+1="], "tgt": [], "response": [["2"], ["3"]], "sort": [1, 0], "sytem": "S"}, "sytem", "system"),
        (
            {"src": ["1+1="], "tgt": [], "response": [["2"], ["3"]], "sort": [1, 0], "is_sytem": 1},
            "is_sytem",
            "is_system",
        ),
        ({"prompt": "1+1=", "chosen": "2", "rejected": "3", "systems": "S"}, "systems", "system"),
        ({"instruction": "Add", "inputs": "1+1", "chosen": "2", "rejected": "3"}, "inputs", "input"),
        ({"instruction": "Add", "chosen": "2", "rejected": "3", "histroy": [["a", "b"]]}, "histroy", "history"),
    ],
)
def test_a_misspelled_preference_field_is_an_error(tmp_path, record, typo, meant):
    path = _write(tmp_path / "dpo.jsonl", [record])
    assert _err(load_preference_pairs, path) == f"{path}:1: unknown field '{typo}'; did you mean '{meant}'?"


def test_preference_extra_keys_warn_once(tmp_path):
    rec = {"src": ["1+1="], "tgt": [], "response": [["2"], ["3"]], "sort": [1, 0]}
    path = _write(tmp_path / "dpo.jsonl", [dict(rec, id=1), dict(rec, id=2)])
    pairs, texts = _load(load_preference_pairs, path)
    assert len(pairs) == 2
    assert texts == [f"{path}: fields ['id'] are not read by the erniekit format and are ignored"]


def test_pretraining_text_fields(tmp_path):
    ok = _write(tmp_path / "pt.jsonl", [{"text": "doc one", "meta": {"url": "u"}}, {"text": "doc two", "id": 2}])
    texts, warned = _load(load_pretrain_texts, ok)
    assert texts == ["doc one", "doc two"]
    assert warned == [f"{ok}: fields ['id', 'meta'] are not read by the pretraining text format and are ignored"]
    typo = _write(tmp_path / "typo.jsonl", [{"txt": "doc"}])
    assert _err(load_pretrain_texts, typo) == f"{typo}:1: unknown field 'txt'; did you mean 'text'?"


def test_rl_prompt_fields_stay_reward_fields(tmp_path):
    """RL prompt data passes every other key to the reward functions: none is refused or warned about."""
    from erniekit.rl.data import load_prompts

    path = _write(tmp_path / "rl.jsonl", [{"prompt": "1+1=", "answer": "2", "prompt_id": 7, "answr": "x"}])
    prompts, texts = _load(load_prompts, path)
    assert texts == [] and prompts[0].fields == {"answer": "2", "prompt_id": 7, "answr": "x"}


def test_the_near_miss_search_runs_once_per_distinct_key_set(tmp_path):
    rec = {"instruction": "Add", "output": "2", "id": 0, "meta": "m"}
    path = _write(tmp_path / "many.jsonl", [dict(rec, id=i) for i in range(300)])
    before = _misspelled.cache_info()
    _load(load_sft_examples, path)
    after = _misspelled.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 299
