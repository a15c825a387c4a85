"""Training core: resume equivalence, accumulation, schedules, logs, checkpoints, stages, bad input."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from erniekit.config import load_config, validate
from erniekit.train.schedules import lr_at

ROOT = str(Path(__file__).resolve().parents[3])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic")

# a very small run: 2 layers, short sequences, few steps
SMALL = [
    "model_overrides.num_hidden_layers=2",
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


def _run(tmp_path, name, *overrides, expect_ok=True):
    from erniekit.train.run import run_train

    cfg = validate(load_config(None, SMALL + [f"output_dir={tmp_path / name}", *overrides]))
    logs: list[str] = []
    res = run_train(cfg, log=logs.append)
    return res, logs


def _scalars(path):
    with open(os.path.join(path, "vdl_log", "scalars.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(path):
    return {r["step"]: r["train/loss"] for r in _scalars(path) if "train/loss" in r}


def test_resume_matches_uninterrupted_run(tmp_path):
    _run(tmp_path, "full", "max_steps=6", "save_steps=3", "save_total_limit=0", "do_eval=false")
    full = _losses(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    # an interrupted run: only checkpoint-3 survives; resuming must replay steps 4..6 exactly
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    (tmp_path / "resumed" / "checkpoint-9.tmp").mkdir()  # a half-written save must be ignored
    _, logs = _run(tmp_path, "resumed", "max_steps=6", "save_steps=3", "resume_from_checkpoint=auto", "do_eval=false")
    assert any("resumed from" in line and "checkpoint-3" in line for line in logs)
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed[s] == pytest.approx(full[s], rel=1e-5, abs=1e-6)
    from safetensors.numpy import load_file

    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)


def test_gradient_accumulation_equals_big_batch(tmp_path):
    common = ["max_steps=3", "do_eval=false", "model_name_or_path=tiny-dense"]
    _run(tmp_path, "big", *common, "per_device_train_batch_size=8", "gradient_accumulation_steps=1")
    _run(tmp_path, "acc", *common, "per_device_train_batch_size=4", "gradient_accumulation_steps=2")
    big, acc = _losses(tmp_path / "big"), _losses(tmp_path / "acc")
    for s in (1, 2, 3):
        assert acc[s] == pytest.approx(big[s], rel=1e-4)


def test_run_writes_hf_checkpoint_logs_and_eval(tmp_path):
    res, logs = _run(tmp_path, "run", "max_steps=4", "save_steps=2", "eval_steps=2")
    out = tmp_path / "run"
    for f in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
        "run_config.yaml",
        "train_results.json",
    ):
        assert (out / f).exists(), f
    assert (out / "checkpoint-4" / "optimizer.safetensors").exists()
    assert not (out / "checkpoint-2").exists() or (out / "checkpoint-4").exists()
    rows = _scalars(out)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec"} <= set().union(*rows)
    assert any("eval/loss" in r for r in rows)
    assert res["eval"]["loss"] > 0 and math.isfinite(res["eval"]["perplexity"])
    from visualdl import LogReader

    vdl = [f for f in os.listdir(out / "vdl_log") if f.startswith("vdlrecords")]
    reader = LogReader(file_path=str(out / "vdl_log" / vdl[0]))
    losses = reader.get_data("scalar", "train/loss")
    assert [int(x.id) for x in losses] == [1, 2, 3, 4]
    # the saved model reloads in a fresh loader with the same config
    from erniekit.models.ernie4_5 import from_pretrained

    assert from_pretrained(str(out)).config.num_hidden_layers == 2


def test_loss_goes_down(tmp_path):
    _run(tmp_path, "down", "max_steps=30", "do_eval=false", "warmup_steps=3")
    losses = _losses(tmp_path / "down")
    assert np.mean([losses[s] for s in range(26, 31)]) < 0.6 * np.mean([losses[s] for s in range(1, 6)])


def test_pretrain_stage_packs_and_learns(tmp_path):
    _run(
        tmp_path,
        "pt",
        "stage=pretrain",
        f"train_dataset_path={DATA}/pretrain.jsonl",
        f"eval_dataset_path={DATA}/pretrain.jsonl",
        "max_steps=25",
        "max_seq_len=64",
        "eval_steps=100",
        "warmup_steps=2",
    )
    losses = _losses(tmp_path / "pt")
    assert losses[25] < 0.7 * losses[1]
    from erniekit.data.encode import encode_pretrain, pack
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    tok = default_tokenizer()
    docs = [encode_pretrain(t, tok) for t in ["1+2=3", "10-4=6", "7+7=14"]]
    rows = pack([(d, d) for d in docs], 64)
    assert len(rows) == 1 and rows[0]["segment_ids"].max() == 3


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_lr_schedules(kind):
    total, warm, peak, floor = 100, 10, 1.0, 0.1
    lrs = [lr_at(s, total, peak, kind, warm, floor, decay_ratio=0.2) for s in range(total)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup
    if kind == "constant":
        assert all(x == 1.0 for x in lrs[10:])
    elif kind == "wsd":
        assert all(x == 1.0 for x in lrs[10:80]) and lrs[-1] == pytest.approx(floor)
        assert lrs[90] == pytest.approx(1.0 + (floor - 1.0) * 11 / 20)
    elif kind == "cosine":
        s = 55
        assert lrs[s] == pytest.approx(floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90)))
    else:
        assert lrs[55] == pytest.approx(1.0 + (floor - 1.0) * 45 / 90)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never increases after warmup


def _cli(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize(
    "content,pattern",
    [
        ('{"src": ["1+1="], "tgt": ["2"]}\n{"src": ["1+2=", "tgt": ["3"]}\n', r"bad\.jsonl:2"),
        ("", r"no examples"),
        ('{"src": ["1+1="]}\n', r"bad\.jsonl:1.*tgt"),
        ('{"src": ["' + "1+1=" * 40 + '"], "tgt": ["2"]}\n', r"max_seq_len"),
    ],
)
def test_bad_data_is_one_line_error(tmp_path, content, pattern):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    r = _cli(
        tmp_path,
        f"train_dataset_path={bad}",
        "max_seq_len=32",
        f"output_dir={tmp_path / 'o'}",
        "max_steps=1",
        "do_eval=false",
    )
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), r.stderr
    import re

    assert re.search(pattern, err[0]), err[0]


def test_long_examples_truncate_with_warning(tmp_path):
    bad = tmp_path / "long.jsonl"
    bad.write_text('{"src": ["' + "1+1=" * 40 + '"], "tgt": ["2"]}\n{"src": ["1+1="], "tgt": ["2"]}\n')
    with pytest.warns(UserWarning, match="truncat"):
        _run(tmp_path, "trunc", f"train_dataset_path={bad}", "truncation=truncate", "max_steps=1", "do_eval=false")


def test_bad_checkpoint_dir_is_named(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    r = _cli(tmp_path, f"model_name_or_path={d}", "max_steps=1", f"output_dir={tmp_path / 'o'}")
    assert r.returncode == 2 and "config.json:1" in r.stderr, r.stderr


def test_sft_packing_gives_the_same_loss_as_separate_examples():
    """Packed rows (segment isolation + restarted positions) must not change any example's loss."""
    import paddle

    from erniekit.data.encode import encode_conversations, pack
    from erniekit.data.formats import load_sft_examples
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.train.batching import collate
    from erniekit.train.losses import count_target_tokens
    from erniekit.train.stages import get_stage

    STAGE = get_stage("SFT")

    tok = default_tokenizer()
    pairs = encode_conversations(load_sft_examples(f"{DATA}/eval.jsonl")[:12], tok, 32)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.2))
    model.eval()
    packed = pack(pairs, 128, pad_id=tok.pad_token_id)
    assert len(packed) < len(pairs) and max(r["segment_ids"].max() for r in packed) > 1
    rows = [{"input_ids": np.asarray(i), "labels": np.asarray(l)} for i, l in pairs]
    sep = collate(rows, tok.pad_token_id)
    pk = collate(packed, tok.pad_token_id)
    assert count_target_tokens(pk) == count_target_tokens(sep)
    a = float(STAGE.loss(model, sep).loss_sum)
    b = float(STAGE.loss(model, pk).loss_sum)
    assert b == pytest.approx(a, rel=1e-4)


def test_lora_training_trains_only_adapters_and_resumes(tmp_path):
    """fine_tuning=LoRA from a full checkpoint: base frozen, PEFT adapter saved, exact resume, chat loads it."""
    _run(tmp_path, "base", "max_steps=2", "do_eval=false", "model_name_or_path=tiny-dense")
    base = str(tmp_path / "base")
    lora = [
        "fine_tuning=LoRA",
        f"model_name_or_path={base}",
        "lora_rank=4",
        "learning_rate=1e-2",
        "do_eval=false",
        "lora_plus_scale=4",
        "max_steps=4",
        "save_steps=2",
        "save_total_limit=0",
    ]
    res, logs = _run(tmp_path, "lora", *lora)
    out = tmp_path / "lora"
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()  # the base is not copied
    assert any("trainable" in line for line in logs)
    full = _losses(out)
    os.makedirs(tmp_path / "lora2")
    os.rename(out / "checkpoint-2", tmp_path / "lora2" / "checkpoint-2")
    _run(tmp_path, "lora2", *lora, "resume_from_checkpoint=auto")
    resumed = _losses(tmp_path / "lora2")
    for s in (3, 4):
        assert resumed[s] == pytest.approx(full[s], rel=1e-5)
    # the adapter changes the model, and chat's loader merges it onto the base
    import paddle

    from erniekit.models.ernie4_5 import from_pretrained
    from erniekit.models.registry import load_model_or_adapter

    ids = paddle.to_tensor([[3, 281, 971, 949, 958]])
    merged = load_model_or_adapter(str(out))
    plain = from_pretrained(base)
    assert not np.allclose(merged(ids).logits.numpy(), plain(ids).logits.numpy(), atol=1e-4)


@pytest.mark.parametrize("layout, fused", [("fused", True), ("per_expert", False)])
def test_lora_peft_layout_key_chooses_how_moe_adapters_are_saved(tmp_path, layout, fused):
    """lora_peft_layout reaches the saved adapter: PEFT's target_parameters on the fused experts
    (transformers >= 5) or a module per expert (older)."""
    import json

    _run(
        tmp_path,
        "a",
        "fine_tuning=LoRA",
        "model_name_or_path=tiny-moe",
        "lora_rank=2",
        "do_eval=false",
        "max_steps=1",
        f"lora_peft_layout={layout}",
    )
    from safetensors import safe_open

    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert bool(cfg.get("target_parameters")) == fused
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "numpy") as f:
        per_expert = any(".experts.0." in k for k in f.keys())
    assert per_expert != fused


def test_dpo_stage_runs_and_improves_preferences(tmp_path):
    _run(tmp_path, "sft", "max_steps=30", "do_eval=false", "warmup_steps=3")
    res, _ = _run(
        tmp_path,
        "dpo",
        "stage=DPO",
        f"model_name_or_path={tmp_path / 'sft'}",
        f"train_dataset_path={DATA}/dpo_train.jsonl",
        f"eval_dataset_path={DATA}/dpo_eval.jsonl",
        "max_steps=8",
        "eval_steps=100",
        "learning_rate=1e-3",
        "beta=0.1",
    )
    rows = _scalars(tmp_path / "dpo")
    assert {
        "train/rewards/chosen",
        "train/rewards/rejected",
        "train/rewards/margins",
        "train/rewards/accuracies",
    } <= set().union(*rows)
    ev = res["eval"]
    assert ev["reward_margin"] > 0 and ev["reward_accuracy"] > 0.5  # moved towards the chosen answers
    losses = _losses(tmp_path / "dpo")
    assert losses[1] == pytest.approx(np.log(2), abs=1e-3)  # policy == reference at the start


def test_diverging_run_stops_with_one_line_error(tmp_path):
    """Weights far outside float32's comfortable range overflow in the first forward: the nan is
    caught at that step (learning_rate=1e30 used to do this; it is refused up front now)."""
    r = _cli(
        tmp_path,
        *SMALL,
        "model_overrides.initializer_range=1e30",
        "max_grad_norm=0",
        "max_steps=5",
        "do_eval=false",
        f"output_dir={tmp_path / 'o'}",
    )
    assert r.returncode == 2, r.stderr[-500:]
    assert "gradient norm is nan" in r.stderr and r.stderr.count("\n") == 1, r.stderr[-500:]


def test_sigterm_ends_the_run_with_a_checkpoint_and_it_resumes(tmp_path):
    """The WebUI's stop button: SIGTERM ends the run after its step with checkpoint-N and the
    model; resume_from_checkpoint=auto continues from N."""
    import signal
    import time

    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        "examples/configs/tiny/pretrain.yaml",
        f"output_dir={out}",
        "max_steps=500",
        "logging_steps=1",
        "save_steps=1000",
        "disable_tqdm=true",
        "max_seq_len=64",
        "model_overrides.num_hidden_layers=2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scalars = out / "vdl_log" / "scalars.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not scalars.exists() or len(scalars.read_text().splitlines()) < 3):
        time.sleep(0.1)
    assert (out / ".erniekit-run.lock").read_text() == str(p.pid)  # held while it runs
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 143, stdout[-2000:]  # 128 + SIGTERM: stopped, not finished
    m = re.search(r"stopping at step (\d+)/500 on SIGTERM: writing checkpoint-(\d+)", stdout)
    assert m and m[1] == m[2], stdout[-2000:]
    n = int(m[1])
    # the last line says the saved model is the stopped step's, not a finished run's
    assert f"saved model (Hugging Face layout) of step {n} of 500 (stopped early; " in stdout, stdout[-2000:]
    assert (out / f"checkpoint-{n}" / "optimizer.safetensors").exists() and (out / "model.safetensors").exists()
    assert json.loads((out / "train_results.json").read_text())["stopped_at_step"] == n
    assert not (out / ".erniekit-run.lock").exists()
    r = subprocess.run(
        [*args[:5], f"output_dir={out}", f"max_steps={n + 2}", *args[7:], "resume_from_checkpoint=auto"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in scalars.read_text().splitlines()]
    assert steps[-2:] == [n + 1, n + 2]


def test_a_second_run_into_a_busy_output_dir_is_refused(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / ".erniekit-run.lock").write_text(str(os.getpid()))  # a live holder: this test process
    args = [
        sys.executable,
        "-m",
        "erniekit",
        "train",
        "examples/configs/tiny/pretrain.yaml",
        f"output_dir={out}",
        "max_steps=2",
        "disable_tqdm=true",
        "max_seq_len=64",
    ]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: output_dir={out} is in use by a running training job (pid {os.getpid()}); choose another "
        "output_dir or stop that job first"
    )
    (out / ".erniekit-run.lock").write_text("999999999")  # a holder that is gone: taken over
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_stop_while_the_run_starts_exits_128_plus_the_signal_in_one_line(tmp_path, monkeypatch, capsys):
    """A stop that ends the wait for the other clusters (cross_cluster_id with no cluster 1 to come)
    is a stop, as after a step: exit 143, one line saying nothing was saved, not `error: ...` and 2."""
    import socket

    from erniekit.cli import main
    from erniekit.distributed.cross_cluster.launch import KEY_ENV
    from erniekit.utils import run_control

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        peers = [f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b)]
    monkeypatch.setenv(KEY_ENV, "k" * 40)
    monkeypatch.setattr(run_control, "stop_signal", lambda: 15)  # a SIGTERM pending from the start
    out = tmp_path / "o"
    args = [*SMALL, "max_steps=4", "do_eval=false", f"output_dir={out}", "cross_cluster_id=0"]
    rc = main(["train", *args, f"cross_cluster_peers=[{','.join(peers)}]", "cross_cluster_timeout_s=60"])
    cap = capsys.readouterr()
    assert rc == 143, cap.out[-1000:] + cap.err[-1000:]
    assert "erniekit: stopped on SIGTERM before the first step; nothing was saved" in cap.out
    assert "error" not in cap.err, cap.err[-1000:]
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()
    assert not (out / ".erniekit-run.lock").exists()
