"""LLaMA-Factory's dataset_info.json: names, columns, tags and ranking mapped onto our readers,
with the one-line errors of our other formats (file, line, the key to fix)."""

import json

import pytest

from erniekit.config.checks import _check_paths, normalise
from erniekit.config.schema import TrainConfig
from erniekit.data.formats import Conversation, load_pretrain_texts, load_sft_examples
from erniekit.data.preference import PreferencePair, load_preference_pairs
from erniekit.errors import ConfigError, DataError


def _write(d, info: dict, files: dict[str, list]) -> str:
    (d / "dataset_info.json").write_text(json.dumps(info))
    for name, records in files.items():
        (d / name).write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(d / "dataset_info.json")


def _same(got: list, want: list) -> None:
    assert [(c.system, c.turns, c.train_on, c.messages()) for c in got] == [
        (c.system, c.turns, c.train_on, c.messages()) for c in want
    ]


def test_alpaca_with_renamed_columns(tmp_path):
    records = [
        {"q": "Add", "ctx": "2 and 3", "a": "5", "sys": "Be brief.", "past": [["hi", "hello"]]},
        {"q": "Say yes", "a": "yes"},
    ]
    info = _write(
        tmp_path,
        {
            "arith": {
                "file_name": "arith.jsonl",
                "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys", "history": "past"},
            }
        },
        {"arith.jsonl": records},
    )
    got = load_sft_examples(f"{info}:arith")
    want = [
        Conversation("Be brief.", [("hi", "hello"), ("Add\n2 and 3", "5")], [True, True]),
        Conversation(None, [("Say yes", "yes")], [True]),
    ]
    _same(got, want)
    assert got[0].source == f"{tmp_path / 'arith.jsonl'}:1"


def test_default_columns_and_dataset_dir_key(tmp_path):
    _write(
        tmp_path,
        {"a": {"file_name": "a.json"}, "b": {"file_name": "b.json"}},
        {
            "a.json": [{"instruction": "x", "output": "y"}],
            "b.json": [{"instruction": "u", "input": "v", "output": "w"}],
        },
    )
    cfg = normalise(TrainConfig(dataset_dir=str(tmp_path), train_dataset_path="a, b", eval_dataset_path="b"))
    info = str(tmp_path / "dataset_info.json")
    assert cfg.train_dataset_path == f"{info}:a,{info}:b" and cfg.eval_dataset_path == f"{info}:b"
    assert normalise(cfg).train_dataset_path == cfg.train_dataset_path  # a saved, resolved config reads the same
    _same(
        load_sft_examples(cfg.train_dataset_path),
        [Conversation(None, [("x", "y")], [True]), Conversation(None, [("u\nv", "w")], [True])],
    )


def test_sharegpt_with_custom_tags_and_tools(tmp_path):
    tools = json.dumps([{"name": "calc", "description": "math", "parameters": {"type": "object", "properties": {}}}])
    custom = [
        {
            "dialog": [
                {"speaker": "sys", "text": "You add."},
                {"speaker": "me", "text": "2+3?"},
                {"speaker": "call", "text": json.dumps({"name": "calc", "arguments": {"e": "2+3"}})},
                {"speaker": "result", "text": "5"},
                {"speaker": "bot", "text": "It is 5."},
            ],
            "fns": tools,
        }
    ]
    standard = [
        {
            "conversations": [
                {"from": "human", "value": "2+3?"},
                {"from": "function_call", "value": json.dumps({"name": "calc", "arguments": {"e": "2+3"}})},
                {"from": "observation", "value": "5"},
                {"from": "gpt", "value": "It is 5."},
            ],
            "system": "You add.",
            "tools": tools,
        }
    ]
    openai = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    tags = {
        "role_tag": "speaker",
        "content_tag": "text",
        "user_tag": "me",
        "assistant_tag": "bot",
        "function_tag": "call",
        "observation_tag": "result",
        "system_tag": "sys",
    }
    info = _write(
        tmp_path,
        {
            "tools": {
                "file_name": "custom.jsonl",
                "formatting": "sharegpt",
                "columns": {"messages": "dialog", "tools": "fns"},
                "tags": tags,
            },
            "oai": {
                "file_name": "oai.jsonl",
                "formatting": "sharegpt",
                "columns": {"messages": "messages"},
                "tags": {
                    "role_tag": "role",
                    "content_tag": "content",
                    "user_tag": "user",
                    "assistant_tag": "assistant",
                    "system_tag": "system",
                },
            },
        },
        {"custom.jsonl": custom, "oai.jsonl": openai, "standard.jsonl": standard},
    )
    got = load_sft_examples(f"{info}:tools")
    _same(got, load_sft_examples(str(tmp_path / "standard.jsonl")))
    assert got[0].tools and got[0].system == "You add."
    _same(load_sft_examples(f"{info}:oai"), [Conversation(None, [("hi", "hello")], [True])])


def test_ranking_data_for_dpo(tmp_path):
    alpaca = [{"question": "2+3?", "good": "5", "bad": "6", "sys": "Math."}]
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "2+3?"},
            ],
            "chosen": {"from": "gpt", "value": "5"},
            "rejected": {"from": "gpt", "value": "6"},
            "system": "Math.",
        }
    ]
    info = _write(
        tmp_path,
        {
            "pa": {
                "file_name": "pa.jsonl",
                "ranking": True,
                "columns": {"prompt": "question", "chosen": "good", "rejected": "bad", "system": "sys"},
            },
            "ps": {
                "file_name": "ps.jsonl",
                "formatting": "sharegpt",
                "ranking": True,
                "columns": {
                    "messages": "conversations",
                    "chosen": "chosen",
                    "rejected": "rejected",
                    "system": "system",
                },
            },
        },
        {"pa.jsonl": alpaca, "ps.jsonl": sharegpt},
    )
    assert load_preference_pairs(f"{info}:pa") == [PreferencePair("Math.", [], "2+3?", "5", "6")]
    assert load_preference_pairs(f"{info}:ps") == [PreferencePair("Math.", [("hi", "hello")], "2+3?", "5", "6")]
    with pytest.raises(DataError, match="ranking: true .*stage DPO"):
        load_sft_examples(f"{info}:pa")
    sft_dir = tmp_path / "sft"
    sft_dir.mkdir()
    info2 = _write(sft_dir, {"s": {"file_name": "s.jsonl"}}, {"s.jsonl": [{"instruction": "a", "output": "b"}]})
    with pytest.raises(DataError, match="no ranking: true"):
        load_preference_pairs(f"{info2}:s")


def test_unknown_name(tmp_path):
    info = _write(
        tmp_path, {"alpaca_en_demo": {"file_name": "a.json"}}, {"a.json": [{"instruction": "x", "output": "y"}]}
    )
    with pytest.raises(DataError) as e:
        load_sft_examples(f"{info}:alpaca_en_dem")
    assert str(e.value) == f"{info}: no dataset named 'alpaca_en_dem'; did you mean 'alpaca_en_demo'?"
    with pytest.raises(ConfigError, match="train_dataset_path: .*no dataset named 'nope'"):
        _check_paths(normalise(TrainConfig(dataset_dir=str(tmp_path), train_dataset_path="nope")))


def test_missing_file(tmp_path):
    info = _write(tmp_path, {"gone": {"file_name": "gone.json"}}, {})
    with pytest.raises(DataError, match=r"dataset 'gone': file_name gone.json not found .*; fix file_name"):
        load_sft_examples(f"{info}:gone")
    with pytest.raises(DataError, match="dataset_info.json: not found"):
        load_sft_examples(f"{tmp_path / 'elsewhere' / 'dataset_info.json'}:gone")


def test_bad_column(tmp_path):
    records = [{"instruction": "x", "answer": "y"}, {"instruction": "u", "output": "w"}]
    info = _write(
        tmp_path,
        {
            "typo": {"file_name": "d.jsonl", "columns": {"prompt": "instruction", "response": "output"}},
            "opt": {
                "file_name": "d2.jsonl",
                "columns": {"prompt": "instruction", "response": "output", "system": "sytem"},
            },
            "key": {"file_name": "d2.jsonl", "columns": {"promt": "instruction"}},
        },
        {"d.jsonl": records, "d2.jsonl": records[1:]},
    )
    with pytest.raises(DataError) as e:
        load_sft_examples(f"{info}:typo")
    assert str(e.value) == (
        f"{tmp_path / 'd.jsonl'}:1: columns.response of dataset 'typo' names key 'output', which this record lacks; "
        f"fix columns.response in {info} or the record"
    )
    with pytest.raises(DataError, match="columns.system of dataset 'opt' names key 'sytem', which no record has"):
        load_sft_examples(f"{info}:opt")
    with pytest.raises(DataError, match="columns.promt is not a LLaMA-Factory column; did you mean 'prompt'"):
        load_sft_examples(f"{info}:key")


def test_network_entries_and_unsupported_keys_are_refused(tmp_path):
    info = _write(
        tmp_path,
        {
            "hub": {"hf_hub_url": "llamafactory/alpaca_en", "file_name": "x.json"},
            "ms": {"ms_hub_url": "llamafactory/alpaca_en"},
            "script": {"script_url": "my_script"},
            "img": {"file_name": "x.json", "columns": {"prompt": "p", "response": "r", "images": "imgs"}},
        },
        {"x.json": [{"instruction": "x", "output": "y"}]},
    )
    for name, key in (("hub", "hf_hub_url"), ("ms", "ms_hub_url"), ("script", "script_url")):
        with pytest.raises(DataError, match=f"dataset '{name}': {key}=.* network; erniekit reads local files only"):
            load_sft_examples(f"{info}:{name}")
    with pytest.raises(DataError, match="columns.images: multimodal"):
        load_sft_examples(f"{info}:img")


def test_pretraining_reads_the_prompt_column(tmp_path):
    info = _write(
        tmp_path, {"pt": {"file_name": "pt.jsonl", "columns": {"prompt": "text"}}}, {"pt.jsonl": [{"text": "doc one"}]}
    )
    assert load_pretrain_texts(f"{info}:pt") == ["doc one"]
