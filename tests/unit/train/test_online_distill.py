"""Online distillation (docs/online_distillation.md): the combined loss by hand, the teacher-assistant
chain, students learning every N steps, the teacher equal to its solo run, the auxiliary layer
dropped on save, resume exactness and the config refusals."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError

ROOT = str(Path(__file__).resolve().parents[3])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic")

SMALL = [
    "model_name_or_path=tiny-moe",
    "model_overrides.num_hidden_layers=3",
    "model_overrides.hidden_size=64",
    "model_overrides.intermediate_size=128",
    "model_overrides.moe_intermediate_size=64",
    "per_device_train_batch_size=8",
    "max_seq_len=32",
    "learning_rate=3e-3",
    "logging_steps=1",
    "disable_tqdm=true",
    "eval_generation=false",
    f"train_dataset_path={DATA}/train.jsonl",
    f"eval_dataset_path={DATA}/eval.jsonl",
    "per_device_eval_batch_size=64",
]
# a teacher assistant of 2 layers taught by the model, a 1-layer dense student of half the width
# taught by the assistant through an auxiliary layer (written before its teacher: order is derived)
STUDENTS = (
    "online_distill_students=[{name: small, num_hidden_layers: 1, hidden_size: 32, moe_num_experts: 0, "
    "teacher: ta, auxiliary_layer: true, auxiliary_weight: 0.5}, {name: ta, num_hidden_layers: 2}]"
)


def _cfg(tmp_path, *overrides):
    return validate(load_config(None, SMALL + [f"output_dir={tmp_path}", *overrides]))


def _run(tmp_path, name, *overrides):
    """A run of the test; the solo runs compared with online ones take the head's loss through the
    whole logits as online distillation does (fused_head_loss sums the weight's gradient in
    another order: the last bits differ, tests/unit/nn/test_linear_cross_entropy.py)."""
    from erniekit.train.run import run_train

    logs: list[str] = []
    res = run_train(_cfg(tmp_path / name, "fused_head_loss=false", *overrides), log=logs.append)
    return res, logs


def _scalars(path):
    with open(os.path.join(path, "vdl_log", "scalars.jsonl")) as f:
        return [json.loads(line) for line in f]


def _stage_and_batch(tmp_path, *overrides):
    import paddle

    from erniekit.train.online_distill import with_students
    from erniekit.train.run import load_model, load_tokenizer
    from erniekit.train.stages import get_stage

    cfg = _cfg(tmp_path, STUDENTS, *overrides)
    paddle.seed(cfg.seed)
    model, tok = load_model(cfg), load_tokenizer(cfg)
    stage = with_students(get_stage(cfg.stage), cfg)
    rows = stage.build_train_rows(cfg, tok)
    stage.prepare(model, rows, None, cfg, tok)
    return cfg, model, tok, stage, stage.collate(rows[:6], tok.pad_token_id)


def test_combined_loss_is_teacher_lm_plus_each_students_divergence_from_its_teacher(tmp_path):
    import paddle

    from erniekit.train.distill_losses import distill_loss_sum
    from erniekit.train.losses import causal_lm_loss_sum
    from erniekit.train.online_distill_aux import hidden_loss_sum
    from erniekit.train.stage import lm_loss, model_inputs

    cfg, model, _, stage, b = _stage_and_batch(
        tmp_path,
        "online_distill_loss=jsd",
        "online_distill_beta=0.3",
        "online_distill_temperature=2.0",
        "online_distill_alpha=0.7",
    )
    assert [s.name for s in stage.specs] == ["ta", "small"]  # the assistant runs before the student it teaches
    stage.step_batches(model, [b], 0)
    res = stage.loss(model, b)

    inputs = model_inputs(b)
    teacher = model(**inputs)
    ta = stage.students["ta"](**inputs)
    small = stage.students["small"](**inputs)

    def kd(s, t):  # 0.7 x the divergence from its teacher + 0.3 x its own loss on the labels
        div = distill_loss_sum(s.logits, b["labels"], t.logits, "jsd", 0.3, 2.0, b["segment_ids"])
        return 0.7 * div + 0.3 * causal_lm_loss_sum(s.logits, b["labels"], b["segment_ids"])

    aux_h = stage.aux["small"](stage.students["small"], small.hidden_states, inputs)
    by_hand = (
        lm_loss(model, b).loss_sum
        + kd(ta, teacher)
        + kd(small, ta)  # the student learns from the assistant, not from the model
        + 0.5 * hidden_loss_sum(aux_h, ta.hidden_states, b["labels"], b["segment_ids"])
    )
    np.testing.assert_allclose(float(res.loss_sum), float(by_hand), rtol=1e-6)
    div = lambda t: float(distill_loss_sum(small.logits, b["labels"], t.logits, "jsd", 0.3, 2.0, b["segment_ids"]))  # noqa: E731
    assert div(teacher) != pytest.approx(div(ta), rel=1e-2)
    assert stage.aux["small"].proj.weight.shape == [32, 64]  # the student's width -> the assistant's
    # the router losses of the model and of the MoE assistant; the dense student has none
    np.testing.assert_allclose(float(res.aux_loss), float(teacher.aux_loss) + float(ta.aux_loss), rtol=1e-6)

    # the model's gradient is its LM loss's alone: the students see detached logits
    res.loss_sum.backward()
    online = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.clear_gradient(set_to_zero=False)
    out = lm_loss(model, b)
    out.loss_sum.backward()
    assert len(online) > 10
    for n, p in model.named_parameters():
        if n in online:
            np.testing.assert_allclose(online[n], p.grad.numpy(), rtol=1e-5, atol=1e-8, err_msg=n)
    assert all(p.grad is not None for _, p in stage._named("small"))  # the student and its auxiliary layer learn
    paddle.seed(cfg.seed)


# the same chain with layer-wise hidden-state losses: the assistant's 2 layers learn the model's
# layers 0 and 2 (of 3), the 32-wide student's one layer the assistant's last through a learned map
HIDDEN_STUDENTS = (
    "online_distill_students=[{name: small, num_hidden_layers: 1, hidden_size: 32, moe_num_experts: 0, "
    "teacher: ta, hidden_weight: 0.5}, {name: ta, num_hidden_layers: 2, hidden_weight: 0.3}]"
)


def _normed(h):
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def _layer_loss(students, teachers, segment_ids, w=None):
    """Sum over real tokens of the mean over layer pairs of |n(h_s W) - n(h_t)|^2 / H, in numpy."""
    errs = []
    for hs, ht in zip(students, teachers):
        hs = hs.astype(np.float64) @ w.astype(np.float64) if w is not None else hs
        d = _normed(hs) - _normed(ht)
        errs.append((d * d).mean(-1))
    return float((np.mean(errs, 0) * (segment_ids > 0)).sum())


def test_hidden_state_losses_join_each_students_loss_and_leave_the_teacher_alone(tmp_path):
    from erniekit.train.distill_losses import distill_loss_sum
    from erniekit.train.hidden_distill import layer_outputs
    from erniekit.train.stage import lm_loss, model_inputs

    cfg, model, _, stage, b = _stage_and_batch(tmp_path, HIDDEN_STUDENTS)
    assert stage.hidden_maps == {"ta": [0, 2], "small": [1]}
    assert set(stage.hidden_proj) == {"small"} and stage.hidden_proj["small"].linear.weight.shape == [32, 64]
    stage.step_batches(model, [b], 0)
    res = stage.loss(model, b)

    inputs = model_inputs(b)
    with layer_outputs(model, [0, 2]) as t_h:
        teacher = model(**inputs)
    with layer_outputs(stage.students["ta"], [0, 1]) as ta_h:
        ta = stage.students["ta"](**inputs)
    with layer_outputs(stage.students["small"], [0]) as small_h:
        small = stage.students["small"](**inputs)
    seg = b["segment_ids"]
    kd = lambda s, t: distill_loss_sum(s.logits, b["labels"], t.logits, "forward_kl", 0.5, 1.0, seg)  # noqa: E731
    ta_hidden = _layer_loss([ta_h[0].numpy(), ta_h[1].numpy()], [t_h[0].numpy(), t_h[2].numpy()], seg)
    w = stage.hidden_proj["small"].linear.weight.numpy()
    small_hidden = _layer_loss([small_h[0].numpy()], [ta_h[1].numpy()], seg, w)
    by_hand = float(lm_loss(model, b).loss_sum + kd(ta, teacher) + kd(small, ta)) + 0.3 * ta_hidden + 0.5 * small_hidden
    np.testing.assert_allclose(float(res.loss_sum), by_hand, rtol=1e-5)
    assert res.metrics["ta_hidden"] == pytest.approx(ta_hidden, rel=1e-5)  # a sum: the runner divides

    res.loss_sum.backward()  # the model's gradient is still its LM loss's alone
    online = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.clear_gradient(set_to_zero=False)
    lm_loss(model, b).loss_sum.backward()
    for n, p in model.named_parameters():
        if n in online:
            np.testing.assert_allclose(online[n], p.grad.numpy(), rtol=1e-5, atol=1e-8, err_msg=n)
    named = dict(stage._named("small"))
    assert "students.small.hidden_projection.linear.weight" in named
    assert all(p.grad is not None for p in named.values())


def test_a_run_with_hidden_state_losses_resumes_exactly_and_saves_students_alone(tmp_path):
    common = [HIDDEN_STUDENTS, "max_steps=4", "save_steps=2", "save_total_limit=0", "do_eval=false"]
    _run(tmp_path, "full", *common)
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    _run(tmp_path, "resumed", *common, "resume_from_checkpoint=auto")
    full = {r["step"]: r for r in _scalars(tmp_path / "full") if "train/loss" in r}
    resumed = {r["step"]: r for r in _scalars(tmp_path / "resumed") if "train/loss" in r}
    assert full[4]["train/small_hidden"] < full[1]["train/small_hidden"]
    for s in (3, 4):
        for k in ("train/loss", "train/ta_hidden", "train/small_hidden"):
            assert resumed[s][k] == pytest.approx(full[s][k], rel=1e-5), (s, k)
    from safetensors.numpy import load_file

    names = load_file(str(tmp_path / "full" / "students" / "small" / "model.safetensors"))
    assert not any("hidden_projection" in n for n in names)


def test_idle_step_computes_no_student_and_groups_are_the_students(tmp_path):
    _, model, _, stage, b = _stage_and_batch(tmp_path, "online_distill_every=3")
    assert set(stage.grad_groups()) == {"ta", "small"}
    extra = {n for n, _ in stage.extra_named_parameters()}
    assert any(n.startswith("students.small.auxiliary.") for n in extra)
    assert [stage.idle_groups(s) for s in range(4)] == [set(), {"ta", "small"}, {"ta", "small"}, set()]
    stage.step_batches(model, [b], 1)
    res = stage.loss(model, b)
    assert set(res.metrics) == {"teacher_loss"}  # no student ran
    assert float(res.loss_sum) == pytest.approx(res.metrics["teacher_loss"], rel=1e-7)


def _student_tensors(ckpt):
    from safetensors.numpy import load_file

    return load_file(os.path.join(ckpt, "online_distill_students.safetensors"))


def test_students_learn_every_n_steps_and_the_teacher_is_its_solo_run(tmp_path):
    common = ["max_steps=4", "save_steps=1", "save_total_limit=0", "do_eval=false"]
    _run(tmp_path, "online", STUDENTS, "online_distill_every=2", *common)
    _run(tmp_path, "solo", *common)
    out = tmp_path / "online"
    steps = [_student_tensors(out / f"checkpoint-{s}") for s in (1, 2, 3, 4)]
    key = next(k for k in steps[0] if k.startswith("small/") and "embed_tokens" in k)
    aux = next(k for k in steps[0] if k.startswith("small/auxiliary/"))
    for k in (key, aux):  # steps 0 and 2 (0-based) learn; 1 and 3 leave the students as they were
        assert not np.array_equal(steps[1][k], steps[2][k])
        np.testing.assert_array_equal(steps[0][k], steps[1][k])
        np.testing.assert_array_equal(steps[2][k], steps[3][k])
    scalars = _scalars(out)
    by_step = {r["step"]: r for r in scalars if "train/loss" in r}
    assert "train/small/grad_norm" in by_step[1] and "train/small/grad_norm" not in by_step[2]
    assert "train/small_distill" in by_step[3] and "train/small_distill" not in by_step[4]

    # the model trains as it does alone: same weights, its loss the solo run's loss
    from safetensors.numpy import load_file

    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "solo" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)
    solo = {r["step"]: r["train/loss"] for r in _scalars(tmp_path / "solo") if "train/loss" in r}
    for s in (1, 2, 3, 4):
        assert by_step[s]["train/teacher_loss"] == pytest.approx(solo[s], rel=1e-6)
        assert by_step[s]["train/grad_norm"] == pytest.approx(
            next(r["train/grad_norm"] for r in _scalars(tmp_path / "solo") if r["step"] == s and "train/loss" in r),
            rel=1e-5,
        )


def test_saved_student_drops_the_auxiliary_layer_and_keeps_the_trained_logits(tmp_path):
    import paddle

    from erniekit.models.registry import load_model
    from erniekit.train.stage import model_inputs

    _, model, tok, stage, b = _stage_and_batch(tmp_path / "run")
    for p in stage.students["small"].parameters():  # moved away from the seeded start
        p.set_value(p + 0.01 * paddle.randn(p.shape))
    from erniekit.data.control import count_controls, read_control_record

    stage.control_record = count_controls([{"style": "words"}])  # the students learnt its prefixes too
    stage.save_final(str(tmp_path / "out"), tok)
    saved = tmp_path / "out" / "students" / "small"
    assert read_control_record(str(saved)) == stage.control_record
    from safetensors.numpy import load_file

    files = [f for f in os.listdir(saved) if f.endswith(".safetensors")]
    names = set().union(*(load_file(str(saved / f)).keys() for f in files))
    assert not any("auxiliary" in n for n in names)
    from erniekit.models.registry import model_state

    assert names == set(model_state(stage.students["small"]))  # the student's own tensors, no more
    loaded = load_model(str(saved))
    loaded.eval()
    trained = stage.students["small"]
    trained.eval()
    inputs = model_inputs(b)
    want = trained(**inputs)
    np.testing.assert_allclose(loaded(**inputs).logits.numpy(), want.logits.numpy(), rtol=0, atol=1e-6)
    # ... and the auxiliary path was a different function of the same hidden states (it only shaped training)
    aux = stage.aux["small"](trained, want.hidden_states, inputs)
    assert aux.shape[-1] == 64 != want.hidden_states.shape[-1]
    assert (saved / "config.json").is_file() and (saved / "tokenizer_config.json").exists()


def test_resume_restores_teacher_students_and_their_optimizer_state(tmp_path):
    common = [STUDENTS, "online_distill_every=2", "max_steps=5", "save_steps=2", "save_total_limit=0", "do_eval=false"]
    _run(tmp_path, "full", *common)
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    _, logs = _run(tmp_path, "resumed", *common, "resume_from_checkpoint=auto")
    assert any("resumed from" in line for line in logs)
    full = {r["step"]: r for r in _scalars(tmp_path / "full") if "train/loss" in r}
    resumed = {r["step"]: r for r in _scalars(tmp_path / "resumed") if "train/loss" in r}
    assert sorted(resumed) == [3, 4, 5]
    for s in (3, 4, 5):
        for k in ("train/loss", "train/teacher_loss", "train/ta_distill", "train/small_distill", "train/small_aux"):
            if k in full[s]:
                assert resumed[s][k] == pytest.approx(full[s][k], rel=1e-5, abs=1e-6), (s, k)
    assert "train/small_distill" in resumed[5]  # step 5 (0-based 4) is a learning step
    from safetensors.numpy import load_file

    for sub in ("", "students/ta/", "students/small/"):
        a = load_file(str(tmp_path / "full" / sub / "model.safetensors"))
        b = load_file(str(tmp_path / "resumed" / sub / "model.safetensors"))
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=sub + k)


@pytest.mark.parametrize(
    "students, message",
    [
        ("[{name: a, teacher: b}, {name: b, teacher: a}]", "teacher chain a -> b -> a is a cycle"),
        ("[{name: a, teacher: a}]", "teacher chain a -> a is a cycle"),
        ("[{name: a, teacher: nobody}]", "teacher 'nobody' is neither 'teacher'"),
        ("[{name: a}, {name: a}]", "used twice"),
        ("[{name: teacher}]", "taken by the main model"),
        ("[{num_hidden_layers: 0}]", "num_hidden_layers=0"),
        ("[{num_layers: 2}]", "unknown key 'num_layers'"),
        ("[{vocab_size: 512}]", "vocab_size=512 differs from the model's 1024"),
        ("[{moe_num_experts: 4, moe_k: 8}]", "moe_k=8"),
        ("[{name: 'a b'}]", "must be letters, digits"),
        ("[no-such-preset]", "neither a checkpoint directory nor a model preset"),
        ("[{auxiliary_weight: 0}]", "auxiliary_weight=0 must be a number > 0"),
        ("[{lr_ratio: 0}]", "lr_ratio=0 must be a number > 0"),
        ("[{lr_ratio: fast}]", "lr_ratio='fast' must be a number > 0"),
        ("[{hidden_weight: -1}]", "hidden_weight=-1 must be a number >= 0"),
        ("[{hidden_layer_map: [0]}]", "hidden_layer_map applies with hidden_weight > 0"),
        ("[{hidden_weight: 1, hidden_layer_map: first}]", "hidden_layer_map='first' must be a list"),
        (
            "[{num_hidden_layers: 2, hidden_weight: 1, hidden_layer_map: [0]}]",
            "hidden_layer_map=[0] must give one layer of its teacher 'teacher' .0 to 2. for each of its 2 layers",
        ),
        (
            "[{num_hidden_layers: 1, hidden_weight: 1, hidden_layer_map: [3]}]",
            "map=[3] must give one layer .* for each of its 1 layers",
        ),
        ("3", "must be a list of students"),
    ],
)
def test_bad_students_are_one_line_errors(tmp_path, students, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        _cfg(tmp_path, f"online_distill_students={students}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stage=DPO"], "applies to the pretrain and SFT stages, not DPO"),
        (["fine_tuning=LoRA"], "trains full models"),
        (["loss_token_balance=true"], "set loss_token_balance=false"),
        (["nproc_per_node=2", "tensor_parallel_degree=2"], "plain data parallelism"),
        (["nproc_per_node=2", "sharding=stage1"], "plain data parallelism"),
        (["elastic_depth=[1, 2]"], "elastic sub-models"),
        (
            ["fp8=true", "fp8_block_size=32", "online_distill_students=[{moe_intermediate_size: 48}]"],
            "fp8_block_size=32 does not divide moe_intermediate_size=48",
        ),
        (["online_distill_every=0"], "online_distill_every=0"),
        (["online_distill_temperature=0"], "online_distill_temperature=0"),
        (["online_distill_loss=kl"], "online_distill_loss='kl' is not supported"),
        (["online_distill_alpha=1.5"], "online_distill_alpha=1.5"),
    ],
)
def test_refused_settings(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        _cfg(tmp_path, "online_distill_students=[{num_hidden_layers: 1}]", *overrides)
    assert "\n" not in str(e.value)


def test_two_data_parallel_processes_validate(tmp_path):
    cfg = _cfg(tmp_path, "online_distill_students=[{num_hidden_layers: 1}]", "nproc_per_node=2")
    assert cfg.online_distill_students == [{"num_hidden_layers": 1}]


def test_a_student_on_labels_only_is_its_solo_run(tmp_path):
    """online_distill_alpha=0: the student's loss is its own LM loss, its clipping its own, its start
    the seeded one: it must train exactly as a solo run of its shape (all but the divergence checked)."""
    common = ["max_steps=4", "do_eval=false", "save_steps=100"]
    _run(
        tmp_path,
        "online",
        "online_distill_students=[{name: s, num_hidden_layers: 1}]",
        "online_distill_alpha=0",
        *common,
    )
    _run(tmp_path, "solo", "model_overrides.num_hidden_layers=1", *common)
    from safetensors.numpy import load_file

    a = load_file(str(tmp_path / "online" / "students" / "s" / "model.safetensors"))
    b = load_file(str(tmp_path / "solo" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)
    solo = {r["step"]: r["train/loss"] for r in _scalars(tmp_path / "solo") if "train/loss" in r}
    online = {r["step"]: r for r in _scalars(tmp_path / "online") if "train/loss" in r}
    for s in solo:
        assert online[s]["train/s_lm"] == pytest.approx(solo[s], rel=1e-6)


def test_a_students_lr_ratio_scales_its_learning_rate_and_not_the_teachers(tmp_path):
    """lr_ratio: 4 on a labels-only student at the run's learning rate 1e-3 is a solo run at 4e-3
    (weights to 1e-6), and the teacher stays its own solo run at 1e-3: the ratio reaches the
    student's parameters only, at every step of the schedule."""
    common = ["max_steps=4", "do_eval=false", "save_steps=100", "warmup_steps=2"]
    _run(
        tmp_path,
        "online",
        "online_distill_students=[{name: s, num_hidden_layers: 1, lr_ratio: 4}]",
        "online_distill_alpha=0",
        "learning_rate=1e-3",
        "min_lr=1e-4",
        *common,
    )
    _run(tmp_path, "solo", "model_overrides.num_hidden_layers=1", "learning_rate=4e-3", "min_lr=4e-4", *common)
    _run(tmp_path, "teacher", "learning_rate=1e-3", "min_lr=1e-4", *common)
    from safetensors.numpy import load_file

    for online, solo in (("online/students/s", "solo"), ("online", "teacher")):
        a = load_file(str(tmp_path / online / "model.safetensors"))
        b = load_file(str(tmp_path / solo / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=f"{online}: {k}")


def test_students_learn_labels_only_until_the_start_step(tmp_path):
    """online_distill_start=2: steps 0 and 1 train each student on the labels alone (its solo run's loss,
    no divergence term), from step 2 on the soft labels count with their weight."""
    common = ["max_steps=4", "do_eval=false", "save_steps=100"]
    _run(
        tmp_path,
        "online",
        "online_distill_students=[{name: s, num_hidden_layers: 1}]",
        "online_distill_alpha=0.5",
        "online_distill_start=2",
        *common,
    )
    _run(tmp_path, "solo", "model_overrides.num_hidden_layers=1", *common)
    solo = {r["step"]: r["train/loss"] for r in _scalars(tmp_path / "solo") if "train/loss" in r}
    online = {r["step"]: r for r in _scalars(tmp_path / "online") if "train/loss" in r}
    for s in (1, 2):  # logged after the update of 0-based step s - 1
        assert online[s]["train/s_lm"] == pytest.approx(solo[s], rel=1e-6)
        assert "train/s_distill" not in online[s]
    for s in (3, 4):
        assert online[s]["train/s_distill"] > 0
    assert online[4]["train/s_lm"] != pytest.approx(solo[4], rel=1e-6)  # the soft labels changed its path
