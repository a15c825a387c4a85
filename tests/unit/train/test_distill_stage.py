"""stage: Distill (erniekit/train/stages/distill.py): its loss against a by-hand computation, the
on-policy steps and samples, the teacher's top-k cache, students of other shapes and LoRA, and the
refusals (tokenizer, config, parallel layouts)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "arithmetic"
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64}


def _save(path: Path, preset: str, seed: int, tokenizer=None, **overrides) -> str:
    from erniekit.models import registry

    paddle.seed(seed)
    model = registry.load_model(preset, {**SMALL, **overrides})
    registry.save_model(model, str(path), tokenizer=tokenizer or registry.family_of(preset).default_tokenizer())
    return str(path)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A random 2-layer MoE checkpoint: the teacher (its distributions are what the student learns)."""
    return _save(tmp_path_factory.mktemp("teacher") / "moe", "tiny-moe", seed=11)


def _cfg(tmp_path, teacher, *overrides):
    return validate(
        load_config(
            None,
            [
                "stage=Distill",
                f"teacher_name_or_path={teacher}",
                "model_name_or_path=tiny-dense",
                "model_overrides.num_hidden_layers=1",
                "model_overrides.hidden_size=64",
                "model_overrides.intermediate_size=128",
                f"train_dataset_path={DATA / 'train.jsonl'}",
                f"eval_dataset_path={DATA / 'eval.jsonl'}",
                "max_seq_len=32",
                "per_device_train_batch_size=8",
                "per_device_eval_batch_size=64",
                "learning_rate=3e-3",
                "lr_scheduler_type=constant",
                "max_steps=6",
                "logging_steps=1",
                "save_steps=100",
                "disable_tqdm=true",
                "eval_max_samples=8",
                "eval_max_new_tokens=4",
                "max_new_tokens=5",
                f"output_dir={tmp_path / 'out'}",
                *overrides,
            ],
        )
    )


def _stage(cfg, rows=None):
    """A prepared Distill stage on a fresh student, with the first 64 training rows."""
    from erniekit.train.run import load_model, load_tokenizer
    from erniekit.train.stages import get_stage

    paddle.seed(cfg.seed)
    model, tok = load_model(cfg), load_tokenizer(cfg)
    stage = get_stage(cfg.stage)
    rows = stage.build_train_rows(cfg, tok)[:64] if rows is None else rows
    stage.prepare(model, rows, None, cfg, tok)
    return stage, model, tok, rows


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _by_hand(s_logits, t_logits, labels, kind, beta, T, alpha) -> float:
    """alpha * T^2 * D + (1 - alpha) * CE, summed over trained positions, in float64 numpy."""
    total = 0.0
    B, S, _ = s_logits.shape
    for b in range(B):
        for t in range(S - 1):
            y = labels[b, t + 1]
            if y == -100:
                continue
            ls, lt = _log_softmax(s_logits[b, t] / T), _log_softmax(t_logits[b, t] / T)
            ps, pt = np.exp(ls), np.exp(lt)
            if kind == "forward_kl":
                d = (pt * (lt - ls)).sum()
            elif kind == "reverse_kl":
                d = (ps * (ls - lt)).sum()
            else:
                lm = np.log((1 - beta) * ps + beta * pt)
                d = beta * (pt * (lt - lm)).sum() + (1 - beta) * (ps * (ls - lm)).sum()
            ce = -_log_softmax(s_logits[b, t])[y]
            total += alpha * T * T * d + (1 - alpha) * ce
    return total


@pytest.mark.parametrize(
    "kind,beta,T,alpha",
    [("forward_kl", 0.5, 1.0, 1.0), ("reverse_kl", 0.5, 2.0, 0.7), ("jsd", 0.3, 1.5, 0.4), ("jsd", 0.5, 1.0, 0.0)],
)
def test_loss_is_the_divergence_and_hard_label_mix_computed_by_hand(tmp_path, teacher, kind, beta, T, alpha):
    cfg = _cfg(
        tmp_path,
        teacher,
        f"distill_loss={kind}",
        f"distill_beta={beta}",
        f"distill_temperature={T}",
        f"distill_alpha={alpha}",
        "model_name_or_path=tiny-moe",  # a MoE student: its router loss comes out as aux_loss
        "model_overrides.num_hidden_layers=2",
        "model_overrides.moe_intermediate_size=64",
    )
    stage, model, tok, rows = _stage(cfg)
    batch = stage.collate(rows[:6], tok.pad_token_id)
    out = stage.loss(model, batch)
    with paddle.no_grad():
        s = model(input_ids=paddle.to_tensor(batch["input_ids"])).logits.numpy()
        t = stage.teacher(input_ids=paddle.to_tensor(batch["input_ids"])).logits.numpy()
    want = _by_hand(s, t, batch["labels"], kind, beta, T, alpha)
    assert float(out.loss_sum) == pytest.approx(want, rel=1e-5)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    assert out.metrics["hard_loss"] == pytest.approx(_by_hand(s, t, batch["labels"], kind, beta, T, 0.0), rel=1e-5)
    out.loss_sum.backward()  # the gradient reaches the student, never the frozen teacher
    assert any(p.grad is not None for p in model.parameters())
    assert all(p.grad is None and p.stop_gradient for p in stage.teacher.parameters())


def _normed(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def test_hidden_state_loss_adds_its_weighted_sum_over_real_tokens(tmp_path, teacher):
    """forward KL plus weight x the sum over real tokens of |n(h_s) - n(h_t)|^2 / H, student layer 0
    against the teacher's last layer (the default map for 1 layer of 2)."""
    from erniekit.train.hidden_distill import layer_outputs

    cfg = _cfg(tmp_path, teacher, "distill_hidden_weight=0.5")
    stage, model, tok, rows = _stage(cfg)
    assert stage.hidden_map == [1] and stage.hidden_proj is None and stage.extra_named_parameters() == []
    batch = stage.collate(rows[:6], tok.pad_token_id)
    out = stage.loss(model, batch)
    ids = paddle.to_tensor(batch["input_ids"])
    with paddle.no_grad(), layer_outputs(model, [0]) as s_h, layer_outputs(stage.teacher, [1]) as t_h:
        s = model(input_ids=ids).logits.numpy()
        t = stage.teacher(input_ids=ids).logits.numpy()
    d = _normed(s_h[0].numpy()) - _normed(t_h[1].numpy())
    per_token = (d * d).mean(-1)[batch["segment_ids"] > 0]
    kd = _by_hand(s, t, batch["labels"], "forward_kl", 0.5, 1.0, 1.0)
    assert out.metrics["hidden_loss"] == pytest.approx(per_token.sum(), rel=1e-5)  # the runner divides, as the loss
    assert float(out.loss_sum) == pytest.approx(kd + 0.5 * per_token.sum(), rel=1e-5)
    out.loss_sum.backward()
    assert all(p.grad is None for p in stage.teacher.parameters())
    # the held-out figures report it too, per trained token
    from erniekit.train.losses import count_target_tokens

    ev = stage._eval_passes(model, rows[:6], cfg, tok.pad_token_id)
    assert ev["hidden_loss"] == pytest.approx(per_token.sum() / count_target_tokens(batch), rel=1e-4)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_the_hidden_state_term_reaches_the_students_layers(tmp_path, teacher, recompute):
    """The term's gradient is the gradient with it minus the one without, through the hooked outputs
    (recomputed layers included): non-zero in the layer's own weights, zero in the final norm (the
    captured outputs are taken before it)."""
    extra = [f"recompute_granularity={recompute}", "recompute=true"] if recompute else []

    def grads(weight):
        cfg = _cfg(tmp_path / str(weight), teacher, f"distill_hidden_weight={weight}", *extra)
        stage, model, tok, rows = _stage(cfg)
        stage.loss(model, stage.collate(rows[:6], tok.pad_token_id)).loss_sum.backward()
        return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}

    with_term, without = grads(2.0), grads(0.0)
    layer = [n for n in with_term if n.startswith("model.layers.0.")]
    assert layer and max(float(np.abs(with_term[n] - without[n]).max()) for n in layer) > 1e-6
    np.testing.assert_allclose(with_term["model.norm.weight"], without["model.norm.weight"], rtol=1e-6, atol=1e-9)


def test_a_narrower_students_resume_without_its_hidden_map_is_refused(tmp_path, teacher):
    cfg = _cfg(tmp_path, teacher, "distill_hidden_weight=1", "model_overrides.hidden_size=32")
    stage, *_ = _stage(cfg)
    with pytest.raises(ConfigError, match="no hidden_projection.safetensors"):
        stage.load_checkpoint_tensors(str(tmp_path))


def test_a_hidden_layer_map_of_the_wrong_length_is_refused_at_prepare(tmp_path, teacher):
    with pytest.raises(ConfigError, match=r"distill_hidden_layer_map=\[0, 1\]: needs 1 teacher layers"):
        _stage(_cfg(tmp_path, teacher, "distill_hidden_weight=1", "distill_hidden_layer_map=[0,1]"))


def test_a_narrower_student_trains_its_hidden_map_and_resumes_it_exactly(tmp_path, teacher):
    """hidden 32 against the teacher's 64: a learned [32, 64] map (trained, saved in each checkpoint
    beside the student, never in it) and a resumed run that continues with it bit for bit."""
    from erniekit.train.run import run_train

    common = [
        "distill_hidden_weight=1",
        "model_overrides.hidden_size=32",
        "model_overrides.num_attention_heads=2",
        "model_overrides.num_key_value_heads=1",
        "save_steps=3",
        "save_total_limit=0",
        "do_eval=false",
    ]
    run_train(_cfg(tmp_path / "a", teacher, *common), log=lambda s: None)
    out = tmp_path / "a" / "out"
    full = {r["step"]: r for r in _scalars(out) if "train/loss" in r}
    assert full[6]["train/hidden_loss"] < full[1]["train/hidden_loss"]
    assert (out / "checkpoint-3" / "hidden_projection.safetensors").is_file()
    from safetensors.numpy import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert not any("hidden_projection" in k for k in saved) and saved["model.embed_tokens.weight"].shape[1] == 32
    os.makedirs(tmp_path / "b" / "out")
    os.rename(out / "checkpoint-3", tmp_path / "b" / "out" / "checkpoint-3")
    run_train(_cfg(tmp_path / "b", teacher, *common, "resume_from_checkpoint=auto"), log=lambda s: None)
    resumed = {r["step"]: r for r in _scalars(tmp_path / "b" / "out") if "train/loss" in r}
    for s in (4, 5, 6):
        assert resumed[s]["train/loss"] == pytest.approx(full[s]["train/loss"], rel=1e-5)
        assert resumed[s]["train/hidden_loss"] == pytest.approx(full[s]["train/hidden_loss"], rel=1e-5)


def test_on_policy_steps_are_a_seeded_fraction():
    from erniekit.train.stages.distill import on_policy_step

    draws = [on_policy_step(42, s, 0.3) for s in range(2000)]
    assert draws == [on_policy_step(42, s, 0.3) for s in range(2000)]  # a pure function of (seed, step)
    assert 0.27 < np.mean(draws) < 0.33
    assert draws != [on_policy_step(43, s, 0.3) for s in range(2000)]
    assert not any(on_policy_step(42, s, 0.0) for s in range(50)) and all(on_policy_step(42, s, 1.0) for s in range(50))


def test_on_policy_batches_are_the_students_own_samples_and_deterministic(tmp_path, teacher):
    from erniekit.infer.sampling import SamplingParams
    from erniekit.infer.stops import turn_end_ids
    from erniekit.rl.rollout import rollout
    from erniekit.train.stages.distill import prompts_of

    cfg = _cfg(tmp_path, teacher, "on_policy_ratio=1.0", "temperature=1.0")
    stage, model, tok, rows = _stage(cfg)
    data = stage.collate(rows[:8], tok.pad_token_id)
    assert stage.step_batches(model, [data], 0)[0] is not data and stage.on_policy

    paddle.seed(5)
    a = stage.sampled_batch(model, data)
    paddle.seed(5)
    b = stage.sampled_batch(model, data)
    for key in ("input_ids", "labels", "segment_ids"):
        np.testing.assert_array_equal(a[key], b[key])
    assert (a["row_index"] == -1).all()  # never looked up in a top-k cache

    # the rows: each data prompt, then what the student samples from it (the trained part)
    prompts = prompts_of(data)
    paddle.seed(5)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=turn_end_ids(tok))
    ro = rollout(model, prompts, params, tok.pad_token_id)
    for i, p in enumerate(prompts):
        reply = ro.completion_ids[i, : int(ro.completion_mask[i].sum())]
        n = len(p) + len(reply)
        np.testing.assert_array_equal(a["input_ids"][i, :n], np.concatenate([p, reply]))
        assert (a["labels"][i, : len(p)] == -100).all()
        np.testing.assert_array_equal(a["labels"][i, len(p) : n], reply)
        assert (a["segment_ids"][i, n:] == 0).all()
    # another student samples other replies: the samples are the model's, not the data's
    other = _stage(_cfg(tmp_path, teacher, "on_policy_ratio=1.0", "seed=7"), rows)[1]
    paddle.seed(5)
    c = stage.sampled_batch(other, data)
    assert not np.array_equal(a["input_ids"], c["input_ids"])


def test_on_policy_samples_choose_among_the_tokenizers_ids(tmp_path, teacher, monkeypatch):
    """The student's rollouts are cut to the ids its tokenizer writes (a vocabulary padded past it
    would otherwise train on ids no text stands for)."""
    import erniekit.rl.rollout as rl

    stage, model, tok, rows = _stage(_cfg(tmp_path, teacher, "on_policy_ratio=1.0", "temperature=1.0"))
    asked, real = [], rl.rollout
    monkeypatch.setattr(rl, "rollout", lambda *a, **k: (asked.append(k.get("vocab")), real(*a, **k))[1])
    stage.sampled_batch(model, stage.collate(rows[:4], tok.pad_token_id))
    assert asked == [len(tok)]


def _scalars(out):
    return [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]


def test_an_on_policy_run_resumes_exactly(tmp_path, teacher):
    from erniekit.train.run import run_train

    common = ["on_policy_ratio=0.5", "save_steps=3", "save_total_limit=0", "do_eval=false"]
    run_train(_cfg(tmp_path / "a", teacher, *common), log=lambda s: None)
    full = {r["step"]: r for r in _scalars(tmp_path / "a" / "out") if "train/loss" in r}
    kinds = [full[s]["train/on_policy"] for s in sorted(full)]
    assert 0 < sum(kinds) < 6, kinds  # both kinds of step within the 6
    os.makedirs(tmp_path / "b" / "out")
    os.rename(tmp_path / "a" / "out" / "checkpoint-3", tmp_path / "b" / "out" / "checkpoint-3")
    run_train(_cfg(tmp_path / "b", teacher, *common, "resume_from_checkpoint=auto"), log=lambda s: None)
    resumed = {r["step"]: r for r in _scalars(tmp_path / "b" / "out") if "train/loss" in r}
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed[s]["train/on_policy"] == full[s]["train/on_policy"]
        assert resumed[s]["train/loss"] == pytest.approx(full[s]["train/loss"], rel=1e-5)


def test_topk_cache_is_written_once_reused_and_refused_when_stale(tmp_path, teacher):
    cache = tmp_path / "cache"
    vocab = 1024
    live, model, tok, rows = _stage(_cfg(tmp_path, teacher))
    batch = live.collate(rows[5:13], tok.pad_token_id)
    want = float(live.loss(model, batch).loss_sum)

    # k = the vocabulary: exact, so the cached loss equals the live teacher's
    built, model2, _, _ = _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={cache}", f"teacher_topk={vocab}"), rows)
    assert built.teacher is None  # built, then the teacher leaves memory (no on-policy steps)
    manifest = json.load(open(cache / "manifest.json"))
    assert manifest["fingerprint"]["k"] == vocab and manifest["fingerprint"]["num_rows"] == 64
    stamp = os.stat(cache / "ids.npy").st_mtime_ns
    got = float(built.loss(model2, batch).loss_sum)
    assert got == pytest.approx(want, rel=1e-5)

    time.sleep(0.01)
    reused = _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={cache}", f"teacher_topk={vocab}"), rows)[0]
    assert os.stat(cache / "ids.npy").st_mtime_ns == stamp and reused.cache is not None
    np.testing.assert_array_equal(reused.cache.batch(np.array([3, 1])).ids, built.cache.batch(np.array([3, 1])).ids)

    # a small k: the teacher's 8 most likely tokens and one bucket for the rest; merging tokens can
    # only lose divergence (KL of a coarsening <= KL), so it is below the exact loss, never above
    small = _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={tmp_path / 'k8'}", "teacher_topk=8"), rows)[0]
    approx = float(small.loss(model2, batch).loss_sum)
    assert 0 < approx < want

    # stale: other rows, another temperature, a retrained (touched) teacher
    with pytest.raises(ConfigError, match="teacher_topk_cache: .* is stale .*built for another rows"):
        _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={cache}", f"teacher_topk={vocab}"), rows[:32])
    with pytest.raises(ConfigError, match="built for another temperature"):
        _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={cache}", f"teacher_topk={vocab}", "distill_temperature=2"))
    os.utime(os.path.join(teacher, "model.safetensors"))
    with pytest.raises(ConfigError, match="built for another teacher_files"):
        _stage(_cfg(tmp_path, teacher, f"teacher_topk_cache={cache}", f"teacher_topk={vocab}"), rows)


def test_a_dense_student_of_fewer_layers_learns_from_a_moe_teacher_and_saves_a_normal_checkpoint(tmp_path, teacher):
    from erniekit.models import registry
    from erniekit.train.run import run_train

    cfg = _cfg(tmp_path, teacher, "max_steps=12", "eval_steps=100")
    res = run_train(cfg, log=lambda s: None)
    kd = [r["train/distill_loss"] for r in _scalars(tmp_path / "out") if "train/distill_loss" in r]
    assert len(kd) == 12 and np.mean(kd[-3:]) < 0.7 * np.mean(kd[:3]), kd
    ev = res["eval"]
    assert {"loss", "exact_match", "distill_loss", "teacher_agreement", "teacher_exact_match"} <= set(ev)
    student = registry.load_model(str(tmp_path / "out"))  # what chat and export load
    assert student.config.num_hidden_layers == 1 and student.config.model_type == "ernie4_5"
    assert registry.model_config(teacher).model_type == "ernie4_5_moe"


def test_a_lora_student_trains_its_adapters_only(tmp_path, teacher):
    from erniekit.train.run import run_train

    base = _save(tmp_path / "base", "tiny-dense", seed=3, num_hidden_layers=1)
    cfg = _cfg(
        tmp_path, teacher, f"model_name_or_path={base}", "fine_tuning=LoRA", "learning_rate=1e-2", "do_eval=false"
    )
    run_train(cfg, log=lambda s: None)
    kd = [r["train/distill_loss"] for r in _scalars(tmp_path / "out") if "train/distill_loss" in r]
    assert kd[-1] < kd[0], kd
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    from safetensors.numpy import load_file

    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from erniekit.models import registry

    thinking = registry.family_of("tiny-moe").default_tokenizer().with_thinking_template()
    other = _save(tmp_path / "other_tok", "tiny-moe", seed=1, tokenizer=thinking)
    with pytest.raises(ConfigError, match=r"another tokenizer than the student \(\d+ tokens against the teacher's"):
        _stage(_cfg(tmp_path, other))
    bigger = _save(tmp_path / "other_vocab", "tiny-moe", seed=1, vocab_size=2048)
    with pytest.raises(ConfigError, match="vocab_size=2048, the student 1024; set model_overrides.vocab_size"):
        _stage(_cfg(tmp_path, bigger))


def test_vocabulary_mismatch_names_the_first_differing_id():
    from erniekit.train.stages.distill import vocabulary_mismatch

    class Tok:
        def __init__(self, names):
            self.names = names
            self.vocab_size = len(names)

        def convert_ids_to_tokens(self, ids):
            return [self.names[i] for i in ids]

    assert vocabulary_mismatch(Tok(["a", "b", "c"]), Tok(["a", "b", "c"])) is None
    assert vocabulary_mismatch(Tok(["a", "b", "c"]), Tok(["a", "x", "c"])) == (
        "1 ids name other tokens (id 1: 'b' against the teacher's 'x')"
    )
    assert "3 tokens against the teacher's 2" in vocabulary_mismatch(Tok(["a", "b", "c"]), Tok(["a", "b"]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["teacher_name_or_path=null"], "stage Distill needs teacher_name_or_path"),
        (["teacher_name_or_path={tmp}/nowhere"], "nowhere does not exist .*train it first, or point"),
        (["teacher_name_or_path={tmp}"], "has no config.json; give a full checkpoint"),
        (["stage=SFT"], "teacher_name_or_path=.* applies to stage Distill, not stage SFT"),
        (["distill_beta=1.5"], "distill_beta=1.5 is invalid"),
        (["distill_temperature=0"], "distill_temperature=0.0 is invalid"),
        (["distill_alpha=-0.1"], "distill_alpha=-0.1 is invalid"),
        (["on_policy_ratio=2"], "on_policy_ratio=2.0 is invalid"),
        (["on_policy_ratio=0.5", "max_new_tokens=32"], "max_new_tokens=32 is invalid: it must be < max_seq_len"),
        (["on_policy_ratio=0.5", "temperature=0"], "temperature=0.0 is invalid"),
        (["teacher_topk=0"], "teacher_topk=0 is invalid"),
        (["distill_loss=tvd"], "distill_loss='tvd' is not supported; set distill_loss to one of: forward_kl"),
        (["packing=true"], "packing applies to the .* stages, not Distill"),
        (["loss_token_balance=true"], "loss_token_balance applies to the .* stages, not Distill"),
        # layouts that split the student read the teacher's cache (tests/e2e/test_distill_layouts.py)
        (["nproc_per_node=2", "tensor_parallel_degree=2"], "with tp=2 reads the teacher from its top-k cache"),
        (
            ["nproc_per_node=2", "pipeline_parallel_degree=2", "eval_generation=false"],
            "with pp=2 reads the teacher from its top-k cache",
        ),
        (["nproc_per_node=2", "sharding=stage1"], "with sharding=2 sharding stage1 reads the teacher"),
        (["nproc_per_node=2", "model_name_or_path=tiny-moe", "expert_parallel_degree=2"], "ep=2 reads the teacher"),
        (["nproc_per_node=2", "distributed_mode=ps", "do_eval=false"], "with distributed_mode=ps reads the teacher"),
        (["elastic_depth=[1]"], "elastic_\\* sub-model training applies to"),
        (["distill_hidden_weight=-1"], "distill_hidden_weight=-1.0 is invalid"),
        (["distill_hidden_layer_map=[0]"], "distill_hidden_layer_map applies with distill_hidden_weight > 0"),
        (
            ["distill_hidden_weight=1", "teacher_topk_cache={tmp}/cache"],
            "the hidden-state loss reads the teacher's layer outputs, which its top-k cache does not hold",
        ),
        (["distill_hidden_weight=1", "distill_hidden_layer_map=[5]"], "5 is not a layer of the teacher .* has 2"),
        (
            ["distill_hidden_weight=1", "distill_hidden_layer_map=[]"],
            "distill_hidden_layer_map=\\[\\] gives no teacher",
        ),
        (
            ["nproc_per_node=2", "tensor_parallel_degree=2", "distill_hidden_weight=1"],
            "runs in one process or plain data parallelism, not tp=2",
        ),
        (
            ["stage=SFT", "teacher_name_or_path=null", "distill_hidden_weight=1"],
            "distill_hidden_weight=1.0 applies to stage Distill, not stage SFT",
        ),
    ],
)
def test_config_refusals_are_one_line(tmp_path, teacher, overrides, message):
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    with pytest.raises(ConfigError, match=message) as e:
        _cfg(tmp_path, teacher, *overrides)
    assert "\n" not in str(e.value)


def test_a_missing_teacher_that_a_shipped_config_writes_names_that_config(tmp_path, teacher, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no output/tiny-sft here: the embedded default has not run
    sft = ROOT / "examples" / "configs" / "tiny" / "sft.yaml"
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, teacher, "teacher_name_or_path=./output/tiny-sft/")
    assert (
        f"./output/tiny-sft/ does not exist (relative paths start at {tmp_path}); run `erniekit train {sft}` first"
        in (str(e.value))
    )
    from erniekit.config.checks import _config_writing

    monkeypatch.chdir(ROOT)
    assert _config_writing("output/tiny-sft") == os.path.join("examples", "configs", "tiny", "sft.yaml")
