"""RL stages end to end on tiny models: rollouts, routing replay, rewards, references, GRPO and PPO
learning a task with a known optimum, logging, resume, and bad input."""

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError, DataError
from erniekit.infer.generate import generate
from erniekit.infer.sampling import SamplingParams

ROOT = str(Path(__file__).resolve().parents[3])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic")
SMALL = [
    "model_overrides.num_hidden_layers=2",
    "model_overrides.hidden_size=64",
    "model_overrides.intermediate_size=128",
    "model_overrides.moe_intermediate_size=64",
    "max_seq_len=32",
    "logging_steps=1",
    "disable_tqdm=true",
    f"train_dataset_path={DATA}/train.jsonl",
    f"eval_dataset_path={DATA}/eval.jsonl",
    "eval_max_samples=16",
    "eval_max_new_tokens=4",
    "per_device_eval_batch_size=16",
    "num_generations=4",
    "per_device_train_batch_size=4",
    "max_new_tokens=4",
]
# a reward whose optimum is known: 1 when the first sampled token has an id below 512 (half the vocabulary)
LOW_HALF = textwrap.dedent("""
    def low_half(prompts, completions, completion_ids, **kwargs):
        return [1.0 if ids and ids[0] < 512 else 0.0 for ids in completion_ids]

    def needs_solution(prompts, completions, solution):
        return [0.0] * len(completions)

    def broken(prompts, completions, **kwargs):
        if any("7" in p for p in prompts):
            raise ValueError("cannot score this one")
        return [0.0] * len(completions)

    def plus_is_flat(prompts, completions, completion_ids, **kwargs):
        return [1.0 if "+" in p else float(ids[0] < 512) for p, ids in zip(prompts, completion_ids)]

    def not_a_number(prompts, completions, **kwargs):
        return ["high"] * len(completions)
""")


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(LOW_HALF)
    return str(path)


def _cfg(tmp_path, *overrides, stage="GRPO"):
    return validate(load_config(None, SMALL + [f"stage={stage}", f"output_dir={tmp_path}", *overrides]))


def _run(tmp_path, *overrides, stage="GRPO"):
    from erniekit.train.run import run_train

    logs: list[str] = []
    res = run_train(_cfg(tmp_path, *overrides, stage=stage), log=logs.append)
    return res, logs


def _scalars(path):
    with open(os.path.join(path, "vdl_log", "scalars.jsonl")) as f:
        return [json.loads(line) for line in f]


def _prepared_stage(tmp_path, *overrides, stage="GRPO"):
    """(model, stage, tokenizer) after the runner's setup, without training."""
    from erniekit.train.run import load_model, load_tokenizer
    from erniekit.train.stages import get_stage

    cfg = _cfg(tmp_path, *overrides, stage=stage)
    paddle.seed(cfg.seed)
    model, tok = load_model(cfg), load_tokenizer(cfg)
    st = get_stage(cfg.stage)
    rows = st.build_train_rows(cfg, tok)
    st.prepare(model, rows, st.build_eval_data(cfg, tok), cfg, tok)
    return model, st, tok, rows


# ---- rollout engine --------------------------------------------------------------------------
def test_rollout_layout_stops_and_greedy_match_generate(tmp_path):
    from erniekit.rl.rollout import repeat_prompts, rollout

    model, st, tok, _ = _prepared_stage(tmp_path)
    prompts = [st.prompt_ids[0], st.prompt_ids[1][:5], st.prompt_ids[2]]
    stop = st.stop_ids + [int(st.prompt_ids[0][3])]  # a frequent token, so some sequences stop early
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=stop)
    ro = rollout(model, prompts, params, tok.pad_token_id, record_routing=True)
    expected = generate(model, prompts, params, pad_id=tok.pad_token_id)
    assert ro.completions() == expected
    L = ro.prompt_len
    for i, p in enumerate(prompts):
        assert ro.input_ids[i, L - len(p) : L].tolist() == p and ro.attention_mask[i, : L - len(p)].sum() == 0
        n = int(ro.completion_mask[i].sum())
        assert ro.input_ids[i, L : L + n].tolist() == ro.completion_ids[i, :n].tolist()
        assert ro.stopped[i] == (ro.completion_ids[i, n - 1] in stop)
        assert len(expected[i]) == n - int(ro.stopped[i])
    assert len(ro.routing) == len(model.moe_layers()) and ro.routing[0].shape == (3, ro.input_ids.shape[1], 2)
    assert repeat_prompts([[1], [2]], 3) == [[1], [1], [1], [2], [2], [2]]


def test_rollout_samples_each_group_independently(tmp_path):
    from erniekit.rl.rollout import repeat_prompts, rollout

    model, st, tok, _ = _prepared_stage(tmp_path)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=st.stop_ids)
    ro = rollout(model, repeat_prompts([st.prompt_ids[0]], 8), params, tok.pad_token_id)
    assert len({tuple(c) for c in ro.completions()}) > 1  # a random tiny model: 8 samples differ


def test_a_vocabulary_padded_past_the_tokenizer_never_reaches_the_rewards(tmp_path):
    """vocab_size 8192 for a 1024-token tokenizer: most of a random head's mass is on padding ids,
    which no reward can decode (DataError before the rollouts were cut to the tokenizer's ids)."""
    model, st, tok, _ = _prepared_stage(tmp_path, "model_overrides.vocab_size=8192", "temperature=1.0")
    assert model.config.vocab_size == 8192 > len(tok)
    batch = _rollout_batch(st, model)
    real = batch["attention_mask"] > 0
    assert batch["input_ids"][real].max() < len(tok)
    cfg = _cfg(tmp_path, "model_overrides.vocab_size=8192")
    res = st.evaluate(model, tok, st.build_eval_data(cfg, tok), cfg)  # greedy completions, decoded
    assert np.isfinite(res["reward"])


# ---- routing replay --------------------------------------------------------------------------
def _rollout_batch(st, model):
    return st._make_batch(model, st.collate([{"prompt_index": np.array(i)} for i in range(4)], 0))


def test_routing_recorded_in_rollout_matches_training_forward_and_replay_forces_it(tmp_path):
    from erniekit.routing.replay import changed_counts

    model, st, tok, _ = _prepared_stage(tmp_path, "beta=0")
    batch = _rollout_batch(st, model)
    assert "routing" in batch and batch["routing_mask"].sum() > 0
    # same weights: the training forward routes every recorded token exactly as the rollout did
    st.forward(model, batch, force_routing=False)
    changed, total = changed_counts(model)
    assert total == int(batch["routing_mask"].sum()) * len(model.moe_layers()) and changed == 0
    base = st.score(model, batch).logp
    # move the routers: without replay some tokens change experts and the log-probs move ...
    with paddle.no_grad():
        for layer in model.moe_layers():
            layer.gate.weight.set_value(layer.gate.weight + paddle.randn(layer.gate.weight.shape) * 2.0)
    st.forward(model, batch, force_routing=False)
    changed, total = changed_counts(model)
    assert changed > 0
    # ... with replay every recorded token goes to its recorded experts
    st.forward(model, batch, force_routing=True)
    m = batch["routing_mask"].reshape(-1) > 0
    for layer, rec in zip(model.moe_layers(), batch["routing"]):
        used = np.sort(layer.last_topk_idx.numpy(), -1)[m]
        np.testing.assert_array_equal(used, np.sort(rec.reshape(-1, rec.shape[-1]), -1)[m])
    assert changed_counts(model)[0] == changed  # what would have changed is still reported
    st.cfg = type(st.cfg)(**{**st.cfg.__dict__, "routing_replay": True})
    replayed = st.score(model, batch).logp
    assert not np.allclose(replayed, base)  # gate weights still come from the (moved) routers


# ---- reference model -------------------------------------------------------------------------
def test_full_reference_is_a_frozen_copy_and_lora_reference_disables_adapters(tmp_path):
    model, st, tok, _ = _prepared_stage(tmp_path / "full", "beta=0.1")
    batch = _rollout_batch(st, model)
    before = st.reference_logps(model, batch)
    with paddle.no_grad():
        for p in model.parameters():
            p.set_value(p + 0.05)
    np.testing.assert_allclose(st.reference_logps(model, batch), before, rtol=1e-6)
    assert not np.allclose(st.score(model, batch).logp, before)

    model, st, tok, _ = _prepared_stage(tmp_path / "lora", "beta=0.1", "fine_tuning=LoRA", "lora_rank=4")
    assert st.reference == "adapters-disabled"
    batch = _rollout_batch(st, model)
    from erniekit.nn.lora import lora_layers

    with paddle.no_grad():
        for _, layer in lora_layers(model):
            for p in layer.lora_b_params():
                p.set_value(paddle.randn(p.shape) * 0.5)
    ref = st.reference_logps(model, batch)
    with paddle.no_grad():
        for _, layer in lora_layers(model):
            for p in layer.lora_b_params():
                p.set_value(paddle.zeros(p.shape))
    np.testing.assert_allclose(st.score(model, batch).logp, ref, rtol=1e-5, atol=1e-6)  # B = 0: the base model


# ---- learning a task with a known optimum ---------------------------------------------------
def test_grpo_reaches_the_known_optimum(tmp_path, reward_file):
    res, logs = _run(
        tmp_path,
        "max_new_tokens=1",
        f"reward_funcs=[{reward_file}:low_half]",
        "beta=0",
        "max_steps=40",
        "learning_rate=1e-2",
        "lr_scheduler_type=constant",
        "num_generations=8",
        "per_device_train_batch_size=8",
        "do_eval=false",
        "save_steps=1000",
    )
    rewards = [r["train/reward"] for r in _scalars(tmp_path)]
    assert np.mean(rewards[:3]) < 0.75  # a random policy: about half
    assert np.mean(rewards[-5:]) >= 0.95, rewards  # the optimum is 1.0 (measured: 1.0 from step 25)


def test_ppo_increases_reward_with_a_value_head_and_resumes_exactly(tmp_path, reward_file):
    common = [
        "max_new_tokens=1",
        f"reward_funcs=[{reward_file}:low_half]",
        "beta=0.02",
        "learning_rate=1e-2",
        "lr_scheduler_type=constant",
        "num_generations=1",
        "per_device_train_batch_size=32",
        "do_eval=false",
        "vf_coef=0.5",
        "save_total_limit=0",
    ]
    _run(tmp_path / "full", *common, "max_steps=30", "save_steps=15", stage="PPO")
    sc = _scalars(tmp_path / "full")
    rewards = [r["train/reward"] for r in sc]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.25, rewards
    assert all("train/value_loss" in r and "train/kl" in r for r in sc)
    assert os.path.isfile(tmp_path / "full" / "checkpoint-15" / "value_head.safetensors")
    # resume at step 15: rollouts, value head and optimizer state continue exactly
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint-15", tmp_path / "resumed" / "checkpoint-15")
    _run(tmp_path / "resumed", *common, "max_steps=30", "save_steps=15", "resume_from_checkpoint=auto", stage="PPO")
    full = {r["step"]: r for r in sc}
    for r in _scalars(tmp_path / "resumed"):
        assert r["train/reward"] == pytest.approx(full[r["step"]]["train/reward"])
        assert r["train/loss"] == pytest.approx(full[r["step"]]["train/loss"], rel=1e-4, abs=1e-6)


def test_grpo_logs_every_figure_and_reuses_rollouts_over_iterations(tmp_path):
    res, logs = _run(
        tmp_path,
        "max_steps=4",
        "num_iterations=2",
        "beta=0.05",
        "reward_funcs=[accuracy,format]",
        "reward_weights=[1,0.5]",
        "learning_rate=1e-2",
        "routing_replay=true",
        "eval_steps=1000",
    )
    sc = _scalars(tmp_path)
    train = [r for r in sc if "train/loss" in r]
    for key in (
        "train/reward",
        "train/reward_std",
        "train/rewards/accuracy/mean",
        "train/rewards/format/std",
        "train/kl",
        "train/entropy",
        "train/clip_fraction",
        "train/completion_length",
        "train/routing_changed_fraction",
        "train/zero_std_group_fraction",
    ):
        assert all(key in r for r in train), key
    # steps 1-2 share one rollout batch, 3-4 the next: identical rollout figures within a pair
    assert train[0]["train/completion_length"] == train[1]["train/completion_length"]
    assert train[0]["train/entropy"] != train[1]["train/entropy"]  # the policy moved in between
    assert train[1]["train/ratio"] != pytest.approx(1.0, abs=1e-7)  # second iteration: importance ratios
    assert train[0]["train/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert any("reward" in line for line in logs if line.startswith("step"))
    assert "exact_match" in res["eval"] and "reward/format" in res["eval"]


# ---- bad input -------------------------------------------------------------------------------
def test_grpo_needs_two_generations():
    with pytest.raises(ConfigError, match="num_generations"):
        validate(load_config(None, ["stage=GRPO", "num_generations=1"]))
    validate(load_config(None, ["stage=PPO", "num_generations=1"]))  # PPO does not compare samples


def test_reward_module_that_cannot_be_imported(tmp_path):
    with pytest.raises(ConfigError, match="no_such_pkg.rewards"):
        _prepared_stage(tmp_path, "reward_funcs=[no_such_pkg.rewards:score]")
    with pytest.raises(ConfigError, match="unknown_fn"):
        _prepared_stage(tmp_path, "reward_funcs=[erniekit.rl.rewards:unknown_fn]")


def test_prompt_dataset_without_the_field_a_reward_needs(tmp_path, reward_file):
    with pytest.raises(DataError, match=r"train.jsonl:1: reward function .*needs_solution needs field 'solution'"):
        _prepared_stage(tmp_path, f"reward_funcs=[{reward_file}:needs_solution]")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(DataError, match=r"prompts.jsonl:2: reward function accuracy needs field 'answer'"):
        _prepared_stage(tmp_path, f"train_dataset_path={data}", "do_eval=false", "eval_dataset_path=null")


def test_reward_that_raises_or_returns_a_non_number_names_function_and_sample(tmp_path, reward_file):
    model, st, tok, _ = _prepared_stage(tmp_path, f"reward_funcs=[{reward_file}:broken]")
    with pytest.raises(
        DataError,
        match=r"reward function .*:broken raised ValueError: cannot score this one on sample \d+ \(prompt '.*7",
    ):
        for i in range(0, 200, 4):  # until a batch has a prompt with a 7
            st._make_batch(model, st.collate([{"prompt_index": np.array(j)} for j in range(i, i + 4)], 0))
    model, st, tok, _ = _prepared_stage(tmp_path, f"reward_funcs=[{reward_file}:not_a_number]")
    with pytest.raises(DataError, match=r"not_a_number returned 'high' for sample 0 \(prompt"):
        _rollout_batch(st, model)


def test_prompt_formats(tmp_path):
    from erniekit.rl.data import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            [
                '{"prompt": "3+4=", "answer": "7", "difficulty": 1}',
                '{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, '
                '{"role": "assistant", "content": "hello"}, {"role": "user", "content": "5-1="}], "answer": "4"}',
                '{"src": ["9+1="], "tgt": ["10"]}',
            ]
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"p.jsonl:3: field 'prompt'"):
        load_prompts(str(f))  # formats are detected per file: a src/tgt line in a prompt file is an error
    f.write_text(
        '{"prompt": "3+4=", "answer": "7", "difficulty": 1}\n'
        '{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, '
        '{"role": "assistant", "content": "hello"}, {"role": "user", "content": "5-1="}], "answer": "4"}\n'
    )
    a, b = load_prompts(str(f))
    assert a.prompt_text == "3+4=" and a.fields == {"answer": "7", "difficulty": 1}
    assert (
        b.conv.system == "be brief" and b.conv.turns == [("hi", "hello"), ("5-1=", "")] and b.fields == {"answer": "4"}
    )
    g = tmp_path / "e.jsonl"
    g.write_text('{"src": ["9+1="], "tgt": ["10"], "level": 2}\n')
    (c,) = load_prompts(str(g))
    assert c.prompt_text == "9+1=" and c.fields == {"answer": "10", "level": 2}
    f.write_text('{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n')
    with pytest.raises(DataError, match="end with a user turn"):
        load_prompts(str(f))


def test_prompt_system_fields_and_misspelled_format_keys(tmp_path):
    """A top-level system beside a messages prompt was dropped; a misspelled format key ('sytem')
    became a reward field and lost what it meant. Other keys stay reward fields."""
    from erniekit.rl.data import load_prompts

    f = tmp_path / "p.jsonl"
    user = '[{"role": "user", "content": "1+1="}]'
    f.write_text(f'{{"prompt": {user}, "system": "in words", "answer": "two"}}\n')
    (a,) = load_prompts(str(f))
    assert a.conv.system == "in words" and a.fields == {"answer": "two"}
    twice = '[{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]'
    f.write_text(f'{{"prompt": {twice}, "system": "in words", "answer": "two"}}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: system prompt given twice"):
        load_prompts(str(f))
    for rec in (
        '{"prompt": "1+1=", "sytem": "in words", "answer": "2"}',
        '{"src": ["1+1="], "tgt": ["2"], "sytem": "x"}',
    ):
        f.write_text(rec + "\n")
        with pytest.raises(DataError, match=r"p.jsonl:1: unknown field 'sytem'; did you mean 'system'\?"):
            load_prompts(str(f))
    f.write_text('{"prompt": "1+1=", "answer": "2", "solutions": ["2"], "level": 1}\n')
    assert load_prompts(str(f))[0].fields == {"answer": "2", "solutions": ["2"], "level": 1}


def test_prompt_control_is_rendered_in_every_format(tmp_path):
    """A prompt record's control was passed to the rewards only: the policy never saw it."""
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.rl.data import load_prompts
    from erniekit.train.rl_stage import prompt_ids

    tok, f = default_tokenizer(), tmp_path / "p.jsonl"
    for rec in (
        '{"prompt": "1+1=", "control": {"style": "words"}}',
        '{"src": ["1+1="], "tgt": ["2"], "control": {"style": "words"}}',
    ):
        f.write_text(rec + "\n")
        (a,) = load_prompts(str(f))
        assert "<control>style=words</control>" in tok.decode(prompt_ids(a.conv, tok), skip_special_tokens=False)
        assert a.fields["control"] == {"style": "words"}
    f.write_text('{"prompt": "1+1=", "control": {"style": ""}}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: control.style must be a non-empty string"):
        load_prompts(str(f))
    f.write_text('{"prompt": "1+1=", "contrl": {"style": "words"}}\n')
    with pytest.raises(DataError, match=r"unknown field 'contrl'; did you mean 'control'\?"):
        load_prompts(str(f))


def test_zero_variance_groups_are_filtered_from_the_loss(tmp_path, reward_file):
    model, st, tok, _ = _prepared_stage(
        tmp_path,
        "filter_zero_std_groups=true",
        "beta=0",
        f"reward_funcs=[{reward_file}:plus_is_flat]",
        "max_new_tokens=1",
    )
    batch = _rollout_batch(st, model)
    groups = batch["rewards"].reshape(-1, 4)
    flat = np.repeat(groups.std(1) == 0, 4)
    assert flat.any() and (~flat).any()  # '+' prompts always get 1: their groups carry no signal
    np.testing.assert_array_equal(batch["loss_mask"].sum(1) == 0, flat)
    np.testing.assert_array_equal(batch["completion_mask"].sum(1) > 0, np.ones(16, bool))
    assert st.normalizer(batch) == int((~flat).sum())  # one completion token per unfiltered sample


def test_grpo_with_lora_trains_adapters_against_the_base(tmp_path):
    res, _ = _run(
        tmp_path, "fine_tuning=LoRA", "lora_rank=4", "beta=0.1", "max_steps=3", "learning_rate=1e-2", "do_eval=false"
    )
    sc = [r for r in _scalars(tmp_path) if "train/loss" in r]
    assert sc[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start at zero: policy = reference
    assert sc[-1]["train/kl"] > 0  # the adapters moved the policy away from the base
    assert os.path.isfile(tmp_path / "adapter_config.json") and os.path.isfile(tmp_path / "adapter_model.safetensors")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["temperature=0"], "temperature"),
        (["reward_weights=[1, 2]"], "reward_weights has 2 values for 1 reward_funcs"),
        (["reward_funcs=[]"], "reward_funcs"),
        (["elastic_depth=[2]"], "elastic_"),
        (["max_new_tokens=512"], "max_new_tokens"),
        (["epsilon=1.5"], "epsilon"),
        (["stop_token_ids=[x]"], "stop_token_ids"),
    ],
)
def test_rl_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["stage=GRPO", *overrides]))


def test_beta_zero_is_valid_for_rl_only():
    cfg = validate(load_config(None, ["stage=grpo", "beta=0", "reward_funcs=accuracy,format", "reward_weights=1,0.5"]))
    assert (cfg.stage, cfg.reward_funcs, cfg.reward_weights) == ("GRPO", ["accuracy", "format"], [1.0, 0.5])
    with pytest.raises(ConfigError, match="beta"):
        validate(load_config(None, ["stage=DPO", "beta=0"]))


def test_stop_token_ids_past_the_vocabulary_are_refused_before_the_first_step(tmp_path):
    """An id the model cannot sample never stops a rollout: it ran to max_new_tokens, silently."""
    from erniekit.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"stop_token_ids=\[5, 5000\]: 5000 is not a token of this model \(vocab_size="
    ):
        _run(tmp_path / "stops", "max_steps=1", "stop_token_ids=[5, 5000]")
    assert not os.path.exists(tmp_path / "stops" / "checkpoint-1")
