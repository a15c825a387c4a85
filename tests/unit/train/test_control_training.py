"""SFT with control attributes and the credibility loss (docs/control.md): dropped attributes are the
same whenever the rows are rebuilt, the credibility term is weight x mean BCE of the head over real
and sampled replies, a run saves the head and resumes exactly, the held-out lines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.data.control import CONTROL_RECORD_NAME, count_controls, read_control_record, write_control_record
from erniekit.data.formats import load_sft_examples
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, sequence_logits

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "control"
SMALL = [
    "model_overrides.num_hidden_layers=2",
    "model_overrides.hidden_size=64",
    "model_overrides.intermediate_size=128",
    "model_overrides.moe_intermediate_size=64",
    "per_device_train_batch_size=8",
    "max_seq_len=56",
    "learning_rate=3e-3",
    "logging_steps=1",
    "disable_tqdm=true",
    f"train_dataset_path={DATA}/train.jsonl",
    f"eval_dataset_path={DATA}/eval.jsonl",
    "per_device_eval_batch_size=64",
]


def _cfg(tmp_path, *overrides):
    return validate(load_config(None, SMALL + [f"output_dir={tmp_path}", *overrides]))


def test_dropped_attributes_are_the_same_when_the_rows_are_rebuilt(tmp_path):
    from erniekit.train.stages import get_stage

    tok = default_tokenizer()
    cfg = _cfg(tmp_path, "control_drop_prob=0.3")
    a, b = get_stage("SFT"), get_stage("SFT")
    rows_a, rows_b = a.build_train_rows(cfg, tok), b.build_train_rows(cfg, tok)
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(rows_a, rows_b))
    n = len(a.train_convs)
    without = sum(not c.control for c in a.train_convs)
    assert without / n == pytest.approx(0.3, abs=0.03)
    prefixed = sum("<control>" in tok.decode(r["input_ids"].tolist()) for r in rows_a)
    assert prefixed == n - without
    none = get_stage("SFT").build_train_rows(_cfg(tmp_path, "control_drop_prob=1.0"), tok)
    assert not any("<control>" in tok.decode(r["input_ids"].tolist()) for r in none[:200])


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.2))
    return m


def test_the_credibility_term_is_weight_times_mean_bce(tmp_path, model):
    from erniekit.train.credibility import BATCH_KEY, CredibilityTraining

    tok = default_tokenizer()
    cfg = _cfg(tmp_path, "credibility_loss_weight=0.25", "credibility_batch_size=6", "credibility_every=2")
    convs = load_sft_examples(cfg.train_dataset_path)[:40]
    ct = CredibilityTraining(cfg, model, tok, convs)
    ct.head.set_state_dict(
        {
            "weight": paddle.to_tensor(
                np.random.default_rng(0).normal(0, 1, (model.config.hidden_size, 1)).astype("float32")
            )
        }
    )
    micro = [{}, {}]
    ct.attach(model, micro, step=0, units=37)  # step 1 of every 2: no credibility
    assert BATCH_KEY not in micro[0]
    paddle.seed(5)
    ct.attach(model, micro, step=1, units=37)
    part = micro[0][BATCH_KEY]
    again = [{}]
    paddle.seed(5)
    ct.attach(model, again, step=1, units=37)  # the same step and seed: the same prompts and samples
    assert again[0][BATCH_KEY]["sequences"] == part["sequences"]
    other = [{}]
    ct.attach(model, other, step=3, units=37)
    assert other[0][BATCH_KEY]["sequences"][0] != part["sequences"][0]  # another step draws other prompts
    labels = part["labels"]
    assert labels.sum() == 6 and len(labels) > 6  # 6 real replies and their differing samples
    model.train()
    got = float(ct.loss_sum(model, micro[0]))
    z = sequence_logits(model, ct.head, part["sequences"], tok.pad_token_id).numpy().astype(np.float64)
    p = 1 / (1 + np.exp(-z))
    bce = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    assert got == pytest.approx(0.25 * 37 * bce, rel=1e-4)
    assert ct.metrics()["train/credibility_loss"] == pytest.approx(bce, rel=1e-4)
    assert ct.loss_sum(model, micro[1]) is None


def test_held_out_tool_dialogs_give_no_credibility_figures_not_an_error(tmp_path, model):
    from erniekit.train.credibility import CredibilityTraining

    cfg = _cfg(tmp_path, "credibility_loss_weight=0.5")
    ct = CredibilityTraining(cfg, model, default_tokenizer(), load_sft_examples(cfg.train_dataset_path)[:4])
    tool_dialogs = load_sft_examples(str(ROOT / "examples" / "data" / "tools" / "eval.jsonl"))[:3]
    assert ct.evaluate(model, tool_dialogs, max_samples=8) == {}  # was a ValueError at the first evaluation


def _scalars(path):
    with open(os.path.join(path, "vdl_log", "scalars.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_run_saves_the_head_resumes_exactly_and_prints_the_lines(tmp_path):
    from safetensors.numpy import load_file

    from erniekit.train.run import run_train

    common = ["max_steps=4", "save_steps=2", "save_total_limit=0", "credibility_loss_weight=0.5"]
    common += [
        "credibility_every=1",
        "credibility_batch_size=4",
        "credibility_max_new_tokens=6",
        "control_drop_prob=0.2",
    ]
    full = tmp_path / "full"
    logs: list[str] = []
    run_train(_cfg(full, *common, "eval_max_samples=16", "eval_max_new_tokens=6", "eval_steps=100"), log=logs.append)
    assert (full / CREDIBILITY_HEAD_NAME).exists() and (full / "checkpoint-2" / CREDIBILITY_HEAD_NAME).exists()
    # the attributes trained on, as the data had them (control_drop_prob 0.2 drops some from the prompts)
    want = count_controls(c.control for c in load_sft_examples(str(DATA / "train.jsonl")))
    assert set(want["attributes"]) == {"style"} and want["records"] == 5000
    assert read_control_record(str(full)) == want == read_control_record(str(full / "checkpoint-2"))
    assert any(line.startswith("held-out control following: style=digits ") and "style=words" in line for line in logs)
    assert any(line.startswith("held-out credibility AUC (real vs sampled replies): ") for line in logs)
    steps = {r["step"]: r for r in _scalars(full) if "train/loss" in r}
    assert all("train/credibility_loss" in steps[s] for s in (1, 2, 3, 4))
    # an interrupted run: checkpoint-2 alone; resuming replays steps 3 and 4, head included
    os.makedirs(tmp_path / "resumed")
    os.rename(full / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = tmp_path / "resumed"
    run_train(_cfg(resumed, *common, "do_eval=false", "resume_from_checkpoint=auto"), log=lambda *_: None)
    again = {r["step"]: r for r in _scalars(resumed) if "train/loss" in r}
    for s in (3, 4):
        for key in ("train/loss", "train/credibility_loss"):
            assert again[s][key] == pytest.approx(steps[s][key], rel=1e-5, abs=1e-6), (s, key)
    assert read_control_record(str(resumed)) == want  # rebuilt from the data, not added to the checkpoint's
    a, b = load_file(str(full / CREDIBILITY_HEAD_NAME)), load_file(str(resumed / CREDIBILITY_HEAD_NAME))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, err_msg=k)
    assert np.abs(a["weight"]).sum() > 0  # the head learned something


def test_control_eval_counts_replies_that_follow(monkeypatch):
    import erniekit.train.control_eval as ce

    tok = default_tokenizer()
    convs = load_sft_examples(str(DATA / "eval.jsonl"))[:10]  # 5 problems, digits then words
    replies = ["three", "7", "minus two", "12", "x"] * 2

    def scripted(model, prompts, params, pad_id=0, vocab=None):
        assert vocab == len(tok)  # a vocabulary padded past the tokenizer is cut to it
        return [tok.encode(replies.pop(0)) for _ in prompts]

    monkeypatch.setattr(ce, "generate", scripted)
    padded = SimpleNamespace(config=SimpleNamespace(vocab_size=len(tok) + 8))
    res = ce.control_generation_eval(padded, tok, convs, batch_size=4, max_new_tokens=4)
    sent = ["three", "7", "minus two", "12", "x"] * 2
    digits = [r for c, r in zip(convs, sent) if c.control["style"] == "digits"]
    words = [r for c, r in zip(convs, sent) if c.control["style"] == "words"]
    assert res["follow:style=digits"] == sum(r.lstrip("-").isdigit() for r in digits) / 5
    assert res["follow:style=words"] == sum(r in ("three", "minus two") for r in words) / 5
    assert res["exact_match"] == sum(r == c.turns[-1][1] for c, r in zip(convs, sent)) / 10
    lines = ce.held_out_lines(
        {**res, "credibility_auc": 0.9, "credibility_real_mean": 0.8, "credibility_generated_mean": 0.2}
    )
    assert lines[0] == (
        f"held-out control following: style=digits {res['follow:style=digits']:.3f}, "
        f"style=words {res['follow:style=words']:.3f}"
    )
    assert lines[1].startswith("held-out credibility AUC (real vs sampled replies): 0.900")
    assert ce.held_out_lines({"exact_match": 1.0}) == []


def _start_dir(path, record=None) -> str:
    """A directory model_name_or_path accepts (config.json), with `record` as its control_attributes.json."""
    path.mkdir()
    get_preset("tiny-moe").save_pretrained(str(path))
    write_control_record(str(path), record)
    return str(path)


def test_continued_training_adds_the_starting_models_record(tmp_path):
    from erniekit.train.stages import get_stage

    tok = default_tokenizer()
    learnt = count_controls([{"style": "words"}] * 3 + [{"tone": "formal"}])
    start = _start_dir(tmp_path / "start", learnt)
    stage = get_stage("SFT")
    stage.build_train_rows(_cfg(tmp_path / "out", f"model_name_or_path={start}", "control_drop_prob=0.5"), tok)
    data = count_controls(c.control for c in load_sft_examples(str(DATA / "train.jsonl")))
    rec = stage.control_record
    assert rec["records"] == data["records"] + 4
    assert rec["attributes"]["tone"] == {"open": False, "values": {"formal": 1}}  # kept from the start
    words, digits = (data["attributes"]["style"]["values"][v] for v in ("words", "digits"))
    assert rec["attributes"]["style"]["values"] == {"words": words + 3, "digits": digits}
    stage.prepare(None, [], None, _cfg(tmp_path / "out", f"model_name_or_path={start}"), tok)
    assert stage.control_record == rec  # not replaced by the starting model's alone
    # a run that does not train saves the model it was given, and that model's record with it
    idle = get_stage("SFT")
    idle.prepare(None, [], None, _cfg(tmp_path / "idle", f"model_name_or_path={start}", "do_train=false"), tok)
    assert idle.control_record == learnt
    # so does every other stage: DPO, RL or pretraining on a control model keeps what it learnt
    for name in ("pretrain", "DPO"):  # each stage's own prepare (DPO's skipped the base's)
        other = get_stage(name)
        other.prepare(None, [], None, _cfg(tmp_path / name, f"model_name_or_path={start}"), tok)
        assert other.control_record == learnt, name


def test_no_controls_means_no_record_and_a_stale_one_goes(tmp_path, monkeypatch):
    from erniekit.train.stages import get_stage

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"src": [f"{i}+1="], "tgt": [str(i + 1)]}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    out.mkdir()
    write_control_record(str(out), count_controls([{"style": "words"}]))  # an older run's
    stage = get_stage("SFT")
    stage.build_train_rows(_cfg(out, f"train_dataset_path={plain}"), default_tokenizer())
    cfg = _cfg(out, f"train_dataset_path={plain}")
    stage.prepare(None, [], None, cfg, default_tokenizer())
    assert stage.control_record is None and CONTROL_RECORD_NAME not in stage.checkpoint_tensors()
    from types import SimpleNamespace

    from erniekit.train import checkpointing, run

    monkeypatch.setattr(checkpointing, "save_model_or_adapter", lambda *a, **k: None)  # the weights: not this test's
    trainer = SimpleNamespace(model=None, runner=None, ema=None, tokenizer=default_tokenizer(), stage=stage, log=print)
    run._save_final(cfg, trainer)  # every stage's final save
    assert not (out / CONTROL_RECORD_NAME).exists()


def test_a_lora_checkpoint_carries_the_record(tmp_path):
    from erniekit.nn.lora import ADAPTER_CONFIG_NAME, LoraConfig, apply_lora
    from erniekit.train.checkpointing import save_checkpoint

    class _Opt:
        def state_dict(self):
            return {"__step__": paddle.to_tensor([2], dtype="int64")}

    paddle.seed(0)
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe"))
    apply_lora(m, LoraConfig(r=2))
    rec = count_controls([{"style": "words"}])
    path = tmp_path / "checkpoint-2"
    save_checkpoint(
        str(path), m, default_tokenizer(), _Opt(), {"global_step": 2}, extra_tensors={CONTROL_RECORD_NAME: rec}
    )
    assert (path / ADAPTER_CONFIG_NAME).exists() and read_control_record(str(path)) == rec


def test_held_out_controls_the_run_does_not_train_are_refused_before_training(tmp_path):
    from erniekit.errors import DataError
    from erniekit.train.stages import get_stage

    tok = default_tokenizer()
    bad = tmp_path / "eval.jsonl"
    bad.write_text(
        json.dumps({"src": ["1+2="], "tgt": ["3"], "control": {"style": "digits"}})
        + "\n"
        + json.dumps({"src": ["1+2="], "tgt": ["three"], "control": {"stlye": "words"}})
        + "\n"
    )
    cfg = _cfg(tmp_path, f"eval_dataset_path={bad}")
    stage = get_stage("SFT")
    stage.build_train_rows(cfg, tok)
    with pytest.raises(DataError) as e:
        stage.build_eval_data(cfg, tok)
    assert str(e.value).startswith(f"{bad}:2: control stlye=words: this model was not trained with the attribute")
    assert "did you mean 'style'?" in str(e.value) and "\n" not in str(e.value)
    assert get_stage("SFT").build_eval_data(cfg, tok) is not None  # no record (nothing trained yet): no check
    for loss_only in ("eval_generation=false", "eval_max_samples=1"):  # no following rate of record 2
        stage.build_eval_data(_cfg(tmp_path, f"eval_dataset_path={bad}", loss_only), tok)
    # an evaluation-only run checks against the model's own record
    start = _start_dir(tmp_path / "m", count_controls([{"style": "digits"}]))
    only_eval = _cfg(tmp_path, f"eval_dataset_path={bad}", f"model_name_or_path={start}", "do_train=false")
    with pytest.raises(DataError, match=f"{bad}:2: control stlye=words: .*{start}/{CONTROL_RECORD_NAME}"):
        get_stage("SFT").build_eval_data(only_eval, tok)


def test_a_conversation_left_with_nothing_to_train_adds_nothing_to_the_record(tmp_path):
    """truncation: truncate cuts a reply whose prompt fills max_seq_len: the conversation is dropped,
    so its attribute was never trained and chat must refuse it; the kept ones count."""
    from erniekit.train.stages import get_stage

    data = tmp_path / "cut.jsonl"
    short = [{"src": [f"{i}+1="], "tgt": [str(i + 1)], "control": {"style": "digits"}} for i in range(4)]
    long = {"src": ["1+" * 60 + "1="], "tgt": ["61"], "control": {"style": "roman"}}
    data.write_text("".join(json.dumps(r) + "\n" for r in [*short, long]))
    stage = get_stage("SFT")
    with pytest.warns(UserWarning, match="1 of 5 conversations dropped"):
        rows = stage.build_train_rows(
            _cfg(tmp_path / "o", f"train_dataset_path={data}", "truncation=truncate"), default_tokenizer()
        )
    assert len(rows) == 4
    assert stage.control_record == count_controls([{"style": "digits"}] * 4)
