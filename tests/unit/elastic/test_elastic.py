"""Elastic sub-models: layer rule, in-place elastic mode == exported sub-model, sampling, training
hook, export and eval CLIs, and one-line errors."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.elastic.submodels import (
    ElasticChoices,
    ElasticSpec,
    elastic,
    extract_submodel,
    layer_subset,
    sample_spec,
    submodel_config,
)
from erniekit.errors import ConfigError, ErniekitError
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset

ROOT = str(Path(__file__).resolve().parents[3])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic")
SMALL = [
    "model_overrides.hidden_size=64",
    "model_overrides.intermediate_size=128",
    "model_overrides.moe_intermediate_size=32",
    "per_device_train_batch_size=8",
    "max_seq_len=32",
    "learning_rate=3e-3",
    "logging_steps=1",
    "disable_tqdm=true",
    "eval_max_samples=8",
    "eval_max_new_tokens=4",
    f"train_dataset_path={DATA}/train.jsonl",
    f"eval_dataset_path={DATA}/eval.jsonl",
    "per_device_eval_batch_size=8",
    "elastic_depth=[2,3,4]",
    "elastic_experts=[4,8]",
    "elastic_top_k=[1,2]",
]


def test_layer_subset_keeps_first_and_last_evenly():
    assert layer_subset(4, None) == [0, 1, 2, 3] and layer_subset(4, 4) == [0, 1, 2, 3]
    assert layer_subset(4, 2) == [0, 3] and layer_subset(4, 3) == [0, 2, 3] and layer_subset(4, 1) == [0]
    assert layer_subset(18, 6) == [0, 3, 7, 10, 14, 17]
    for L in range(1, 20):
        for d in range(1, L + 1):
            keep = layer_subset(L, d)
            assert len(keep) == d and keep == sorted(set(keep)) and keep[0] == 0 and (d == 1 or keep[-1] == L - 1)


def _model(moe: bool) -> Ernie4_5ForCausalLM:
    paddle.seed(3)
    cfg = get_preset("tiny-moe" if moe else "tiny-dense").replace(
        hidden_size=32, intermediate_size=48, head_dim=8, moe_intermediate_size=16
    )
    m = Ernie4_5ForCausalLM(cfg)
    for b in m.moe_layers():  # a non-trivial correction bias must be sliced with the router
        b.gate.e_score_correction_bias.set_value(paddle.randn([1, cfg.moe_num_experts]) * 0.02)
    return m.eval()


@pytest.mark.parametrize(
    "moe,spec",
    [
        (False, ElasticSpec(2)),
        (False, ElasticSpec(3)),
        (True, ElasticSpec(2, 4, 1)),
        (True, ElasticSpec(3, 8, 1)),
        (True, ElasticSpec(None, 3, 2)),
        (True, ElasticSpec(1)),
        (True, ElasticSpec(4, 2, 2)),
    ],
)
def test_elastic_mode_equals_extracted_submodel(moe, spec):
    m = _model(moe)
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 1000, (2, 10)))
    full = m(ids).logits.numpy()
    with elastic(m, spec):
        want = m(ids).logits.numpy()
    np.testing.assert_allclose(m(ids).logits.numpy(), full, atol=0)  # the context restores the full model
    sub = extract_submodel(m, spec)
    c = sub.config
    assert c.num_hidden_layers == len(layer_subset(4, spec.depth))
    if moe:
        assert (c.moe_num_experts, c.moe_k) == (spec.experts or 8, spec.top_k or 2)
        # tiny-moe: layer 0 dense, the rest MoE; the kept layers keep their kind
        assert [c.is_moe_layer(j) for j in range(c.num_hidden_layers)] == [
            m.config.is_moe_layer(i) for i in layer_subset(4, spec.depth)
        ]
    np.testing.assert_allclose(sub(ids).logits.numpy(), want, atol=1e-5)


def test_modality_isolated_experts_are_cut_per_modality():
    paddle.seed(4)
    cfg = get_preset("tiny-moe").replace(
        hidden_size=32, intermediate_size=48, head_dim=8, moe_num_experts=[8, 4], moe_intermediate_size=[16, 8]
    )
    m = Ernie4_5ForCausalLM(cfg).eval()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 1000, (2, 10)))
    modality = paddle.to_tensor(np.random.RandomState(1).randint(0, 2, (2, 10)))
    spec = ElasticSpec(2, 3, 1)
    with elastic(m, spec):
        want = m(ids, token_type_ids=modality).logits.numpy()
    sub = extract_submodel(m, spec)
    assert sub.config.moe_num_experts == [3, 3]
    np.testing.assert_allclose(sub(ids, token_type_ids=modality).logits.numpy(), want, atol=1e-5)


def test_inexpressible_moe_pattern_is_a_clear_error():
    # MoE layers 1, 3, 5 of 6; depth 5 keeps [0, 1, 3, 4, 5]: dense, MoE, MoE, dense, MoE has no start/end/interval
    cfg = get_preset("tiny-moe").replace(num_hidden_layers=6, moe_layer_start_index=0, moe_layer_interval=2)
    errors = []
    for d in range(1, 7):
        keep = layer_subset(6, d)
        try:
            sub = submodel_config(cfg, ElasticSpec(d))
        except ErniekitError as e:
            assert "elastic.depth" in str(e) and "\n" not in str(e)
            errors.append(d)
            continue
        assert [sub.is_moe_layer(j) for j in range(d)] == [cfg.is_moe_layer(i) for i in keep]
    assert errors == [5]


def test_sampling_is_deterministic_and_respects_choices():
    ch = ElasticChoices([2, 3], [4, 8], [1], full_prob=0.25)
    a = [sample_spec(random.Random(42 + s), ch) for s in range(200)]
    assert a == [sample_spec(random.Random(42 + s), ch) for s in range(200)]
    full = sum(s.is_full for s in a)
    assert 25 < full < 80  # ~50 expected
    assert all(s.depth in (2, 3) and s.experts in (4, 8) and s.top_k == 1 for s in a if not s.is_full)
    assert {(s.depth, s.experts) for s in a if not s.is_full} == {(2, 4), (2, 8), (3, 4), (3, 8)}
    assert all(sample_spec(random.Random(s), ElasticChoices([2], full_prob=0.0)) == ElasticSpec(2) for s in range(9))


@pytest.mark.parametrize(
    "override,key",
    [
        ("elastic_depth=[0,2]", "elastic_depth"),
        ("elastic_experts=[a]", "elastic_experts"),
        ("elastic_top_k=[4]", "elastic_top_k"),
        ("elastic_full_prob=1.5", "elastic_full_prob"),
    ],
)
def test_bad_config_values_are_one_line_errors(override, key):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, SMALL + ["elastic_experts=[2,8]", override]))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_config_accepts_comma_strings():
    cfg = validate(load_config(None, SMALL + ["elastic_depth=4,2", "elastic_top_k=1"]))
    assert cfg.elastic_depth == [2, 4] and cfg.elastic_top_k == [1]


def test_model_dependent_ranges_fail_before_training(tmp_path):
    from erniekit.train.run import run_train

    for bad, key in (("elastic_depth=[2,7]", "elastic_depth"), ("elastic_experts=[16]", "elastic_experts")):
        cfg = validate(load_config(None, SMALL + [bad, "max_steps=1", f"output_dir={tmp_path / key}"]))
        with pytest.raises(ConfigError, match=key):
            run_train(cfg, log=lambda *_: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step elastic run (shared by the training, export and eval tests)."""
    from erniekit.train.run import run_train

    out = tmp_path_factory.mktemp("elastic") / "run"
    cfg = validate(load_config(None, SMALL + ["max_steps=6", "elastic_full_prob=0.2", f"output_dir={out}"]))
    run_train(cfg, log=lambda *_: None)
    return out


def test_training_logs_sampled_specs_and_saves_full_model(trained):
    rows = [json.loads(l) for l in open(trained / "vdl_log" / "scalars.jsonl")]
    specs = {
        r["step"]: (r["train/elastic_depth"], r["train/elastic_experts"], r["train/elastic_top_k"])
        for r in rows
        if "train/elastic_depth" in r
    }
    assert sorted(specs) == [1, 2, 3, 4, 5, 6]
    ch = ElasticChoices([2, 3, 4], [4, 8], [1, 2], 0.2)
    for step, got in specs.items():  # step s logs the spec sampled with seed + (s - 1)
        s = sample_spec(random.Random(42 + step - 1), ch).resolved(get_preset("tiny-moe"))
        assert got == (s.depth, s.experts, s.top_k)
    assert len(set(specs.values())) > 1
    m = from_pretrained(str(trained))
    assert m.config.num_hidden_layers == 4 and m.config.moe_num_experts == 8
    assert m.model.active_layers is None


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "erniekit", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_export_writes_submodel_with_equal_logits(trained, tmp_path):
    out = tmp_path / "sub"
    r = _cli("export", str(trained), "-o", str(out), "elastic.depth=2", "elastic.experts=4", "elastic.top_k=1")
    assert r.returncode == 0, r.stderr
    c = json.loads((out / "config.json").read_text())
    assert (c["num_hidden_layers"], c["moe_num_experts"], c["moe_k"]) == (2, 4, 1)
    full = from_pretrained(str(trained)).eval()
    ids = paddle.to_tensor(np.random.RandomState(1).randint(3, 1000, (2, 9)))
    with elastic(full, ElasticSpec(2, 4, 1)):
        want = full(ids).logits.numpy()
    np.testing.assert_allclose(from_pretrained(str(out))(ids).logits.numpy(), want, atol=1e-5)
    assert (out / "tokenizer.model").exists()
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    back = transformers.Ernie4_5_MoeForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(ids.numpy())).logits.numpy(), want, atol=1e-4)


@pytest.mark.parametrize(
    "args,words",
    [
        (["elastic.dept=2"], "elastic.depth=N"),
        (["elastic.depth=x"], "not an integer"),
        (["elastic.depth=9"], "1..4"),
        (["elastic.experts=1"], "moe_k=2"),
        (["elastic.experts=4", "elastic.top_k=5"], "1..4"),
    ],
)
def test_export_bad_elastic_settings_are_one_line(trained, tmp_path, capsys, args, words):
    from erniekit.cli import main

    assert main(["export", str(trained), "-o", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_eval_elastic_prints_table(trained, tmp_path, capsys):
    from erniekit.cli import main

    assert (
        main(
            [
                "eval",
                str(trained),
                "--elastic",
                "--depths",
                "2,4",
                "--experts",
                "4",
                "--top-k",
                "1",
                "--max-samples",
                "4",
                "--batch-size",
                "4",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:3] == ["depth", "experts", "top_k"])
    rows = [l.split() for l in lines[header + 1 :] if l.strip() and not l.startswith("table:")]
    assert [r[:3] for r in rows] == [["4", "8", "2"], ["4", "4", "1"], ["2", "4", "1"]]
    table = json.loads((tmp_path / "elastic_table.json").read_text())
    assert table["samples"] == 4 and len(table["rows"]) == 3
    full, small = table["rows"][0], table["rows"][-1]
    assert small["total_params"] < full["total_params"] and small["active_params"] < small["total_params"]
    assert all(0 <= row["exact_match"] <= 1 and row["decode_tokens_per_s"] > 0 for row in table["rows"])


def test_eval_elastic_defaults_to_run_choices(trained):
    from erniekit.elastic.report import run_choices, specs_for

    ch = run_choices(str(trained))
    assert ch == {"depth": [2, 3, 4], "experts": [4, 8], "top_k": [1, 2]}
    specs = specs_for(get_preset("tiny-moe"), ch["depth"], ch["experts"], ch["top_k"])
    assert specs[0] == ElasticSpec(4, 8, 2) and len(specs) == 12


def test_resume_replays_the_same_submodels(tmp_path):
    from erniekit.train.run import run_train

    def run(name, *extra):
        cfg = validate(
            load_config(
                None,
                SMALL
                + [
                    "max_steps=4",
                    "save_steps=2",
                    "save_total_limit=0",
                    "do_eval=false",
                    "elastic_full_prob=0",
                    f"output_dir={tmp_path / name}",
                    *extra,
                ],
            )
        )
        run_train(cfg, log=lambda *_: None)
        rows = [json.loads(l) for l in open(tmp_path / name / "vdl_log" / "scalars.jsonl")]
        return {r["step"]: (r["train/loss"], r["train/elastic_depth"], r["train/elastic_experts"]) for r in rows}

    full = run("full")
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = run("resumed", "resume_from_checkpoint=auto")
    assert sorted(resumed) == [3, 4]
    for s in (3, 4):
        assert resumed[s][1:] == full[s][1:]
        assert resumed[s][0] == pytest.approx(full[s][0], rel=1e-5)


# ---- sandwich rule with in-place distillation ---------------------------------------------------
def test_distill_loss_is_weighted_kl_with_cross_entropy_gradient():
    from erniekit.train.losses import distill_loss_sum

    rng = np.random.RandomState(0)
    B, S, V = 2, 6, 7
    s_np, t_np = rng.randn(B, S, V).astype("float32"), rng.randn(B, S, V).astype("float32") * 2
    labels = rng.randint(0, V, (B, S)).astype("int64")
    labels[0, :2] = -100
    seg = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0]])
    labels[1, 4:] = -100

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(t_np.astype(np.float64)), softmax(s_np.astype(np.float64))
    kl = (p * (np.log(p) - np.log(q))).sum(-1)  # [B, S]
    for balance in (False, True):
        w = np.zeros((B, S))
        for b in range(B):
            trained = [t for t in range(S - 1) if labels[b, t + 1] != -100 and seg[b, t] == seg[b, t + 1]]
            for t in trained:  # token balance: 1 / (trained targets of the position's document)
                n_doc = sum(seg[b, u] == seg[b, t] for u in trained)
                w[b, t] = 1.0 / n_doc if balance else 1.0
        student = paddle.to_tensor(s_np, stop_gradient=False)
        teacher = paddle.to_tensor(t_np, stop_gradient=False)
        got = distill_loss_sum(student, teacher, labels, seg, token_balance=balance)
        np.testing.assert_allclose(float(got), (w * kl).sum(), rtol=1e-5)
        got.backward()
        np.testing.assert_allclose(student.grad.numpy(), (q - p) * w[..., None], atol=1e-6)
        assert teacher.grad is None  # the full model is the teacher: no gradient through it


def test_smaller_specs_leave_out_the_full_model():
    from erniekit.elastic.submodels import smaller_specs

    c = get_preset("tiny-moe")  # 4 layers, 8 experts, top-2
    got = smaller_specs(c, ElasticChoices([2, 4], [8], [1, 2]))
    assert got == [ElasticSpec(2, 8, 1), ElasticSpec(2, 8, 2), ElasticSpec(4, 8, 1)]
    assert smaller_specs(c, ElasticChoices([4], [8], [2])) == []


def test_elastic_settings_given_twice_or_pasted_huge_are_one_short_line():
    """`elastic.depth=2 elastic.depth=3` used to export depth 3 silently; a 5000-digit value was
    echoed whole into the error."""
    from erniekit.elastic.submodels import parse_settings

    assert parse_settings(["elastic.depth=2", "elastic.top_k=1"]) == ElasticSpec(depth=2, top_k=1)
    with pytest.raises(ErniekitError, match=r"elastic\.depth is given twice \(2 before\)"):
        parse_settings(["elastic.depth=2", "elastic.depth=3"])
    with pytest.raises(ErniekitError, match="not an integer") as e:
        parse_settings(["elastic.depth=" + "9" * 5000])
    assert len(str(e.value)) < 150 and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override,words",
    [
        ("elastic_distill_weight=0.5", "needs elastic_sandwich"),
        ("elastic_distill_weight=2", "elastic_distill_weight"),
        ("stage=DPO", "LM stages"),
    ],
)
def test_sandwich_config_errors(override, words):
    with pytest.raises(ConfigError, match=words) as e:
        extra = [] if "distill" in override else ["elastic_sandwich=true"]
        validate(load_config(None, SMALL + extra + [override]))
    assert "\n" not in str(e.value)


def test_sandwich_needs_a_smaller_choice(tmp_path):
    from erniekit.train.run import run_train

    cfg = validate(
        load_config(
            None,
            SMALL
            + [
                "elastic_depth=[4]",
                "elastic_experts=[8]",
                "elastic_top_k=[2]",
                "elastic_sandwich=true",
                "max_steps=1",
                f"output_dir={tmp_path}",
            ],
        )
    )
    with pytest.raises(ConfigError, match="add a smaller value"):
        run_train(cfg, log=lambda *_: None)


def test_sandwich_step_gradient_is_full_plus_distilled_submodel(tmp_path):
    """One sandwich step's gradient = d/dθ [CE_full + (1-w) CE_sub + w KL(full || sub)] / tokens,
    the sub-model being the step's draw; reference built from elastic() and an explicit KL."""
    import paddle.nn.functional as F

    from erniekit.train.loop import Trainer
    from erniekit.train.losses import count_target_tokens
    from erniekit.train.run import load_model, load_tokenizer
    from erniekit.train.stages import get_stage

    w = 0.6
    cfg = validate(
        load_config(
            None,
            SMALL
            + [
                "elastic_sandwich=true",
                f"elastic_distill_weight={w}",
                "model_overrides.router_aux_loss_coef=0",
                "max_grad_norm=0",
                "max_steps=1",
                "do_eval=false",
                f"output_dir={tmp_path}",
            ],
        )
    )
    paddle.seed(cfg.seed)
    model, tok, stage = load_model(cfg), load_tokenizer(cfg), get_stage(cfg.stage)
    with paddle.no_grad():  # peaked logits, so full and sub-model disagree measurably (KL ~ 1e-1, not 1e-5)
        model.model.norm.weight.set_value(model.model.norm.weight * 30)
    stage.prepare(model, None, None, cfg, tok)
    trainer = Trainer(cfg, model, tok, stage, stage.build_train_rows(cfg, tok)[:64], log=lambda *_: None)
    got: dict[str, np.ndarray] = {}
    trainer.optimizer.step = lambda grads=None: got.update(
        {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    )
    metrics = trainer.train_step()
    full, sub = trainer.elastic.specs(0)
    assert full.is_full and not sub.is_full
    assert metrics["train/elastic_depth"] == sub.resolved(model.config).depth

    batch = trainer.batches.get(0)
    n = count_target_tokens(batch)
    logits = model(paddle.to_tensor(batch["input_ids"])).logits
    with elastic(model, sub):
        sub_logits = model(paddle.to_tensor(batch["input_ids"])).logits
    tgt = np.where(batch["labels"][:, 1:] == -100, -100, batch["labels"][:, 1:])
    mask = paddle.to_tensor((tgt != -100).astype("float32"))
    V = logits.shape[-1]

    def ce(lg):
        return F.cross_entropy(
            lg[:, :-1].reshape([-1, V]), paddle.to_tensor(tgt.reshape(-1, 1)), ignore_index=-100, reduction="sum"
        )

    p_log = F.log_softmax(logits.detach()[:, :-1], -1)
    kl = ((p_log.exp() * (p_log - F.log_softmax(sub_logits[:, :-1], -1))).sum(-1) * mask).sum()
    (ce(logits) / n + ((1 - w) * ce(sub_logits) + w * kl) / n).backward()
    want = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-6, err_msg=name)
    assert float(kl) / n > 1e-3 and metrics["train/elastic_kl"] == pytest.approx(float(kl) / n, rel=1e-3)
    assert metrics["train/loss"] == pytest.approx(float(ce(logits)) / n, rel=1e-5)
    assert metrics["train/elastic_loss"] == pytest.approx(float(ce(sub_logits)) / n, rel=1e-5)
    assert model.model.active_layers is None  # back to the full model after the step


@pytest.mark.parametrize(
    "text,words",
    [
        ("elastic_depth: abc\n", "elastic_depth='abc' is not a list of integers"),  # was a TypeError traceback
        ("elastic_experts: [4, x]\n", "is not a list of integers"),
        (": [\n", "run_config.yaml:1: cannot read the run's config"),  # was a yaml traceback
        ("- 1\n", "expected a mapping"),
    ],
)
def test_eval_elastic_broken_run_config_is_one_line(tmp_path, text, words):
    from erniekit.elastic.report import run_choices

    (tmp_path / "run_config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=words) as err:
        run_choices(str(tmp_path))
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_eval_elastic_expert_count_below_every_top_k_is_an_error():
    """--experts 1 with the model's moe_k=2 printed the full model only, without a word."""
    from erniekit.elastic.report import specs_for

    with pytest.raises(ConfigError, match="--experts 1 is below every top-k \\(2\\).*add --top-k 1"):
        specs_for(get_preset("tiny-moe"), [], [1, 4], [])
    assert ElasticSpec(4, 1, 1) in specs_for(get_preset("tiny-moe"), [], [1, 4], [1, 2])
