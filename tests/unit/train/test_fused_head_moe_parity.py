"""fused_head_loss on an MoE model: the chunked head gives the loss the plain forward's logits give
(checked against a hand computation: token cross entropy over the label tokens plus the Switch
load-balancing loss of the router), the same router loss and the same gradients; one training step
logs the same loss and gradient norm with it on and off, for tiny-moe (tied, and untied as the
embedded default) and tiny-dense, with and without gradient accumulation. (FP8 experts are left out:
an FP8 gradient tile rounds the head's last-bit differences into whole FP8 steps, 1e-5 of the
embedded default's first gradient norm with e5m2 tiles; tests/e2e/test_fast_paths.py.)"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.nn import linear_cross_entropy
from erniekit.nn.moe import MoEBlock
from erniekit.train.batching import collate
from erniekit.train.losses import count_target_tokens
from erniekit.train.stage import lm_loss

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"


def _moe_model(tied: bool = True):
    c = dataclasses.replace(get_preset("tiny-moe"), num_hidden_layers=2, tie_word_embeddings=tied)
    assert c.is_moe_layer(1) and c.router_aux_loss_coef > 0
    paddle.seed(0)
    return Ernie4_5ForCausalLM(c).train()


def _batch(vocab: int) -> dict:
    rng = np.random.default_rng(3)
    rows = []
    for n in (21, 30, 14, 27):
        ids = rng.integers(3, vocab, n)
        labels = ids.copy()
        labels[: n // 2] = -100  # a prompt
        rows.append({"input_ids": ids, "labels": labels})
    return collate(rows, pad_id=0)


def _step_loss_and_grads(model, batch, fused: bool):
    """The loss the loop backpropagates for one micro-batch (runners/local.py: the summed LM loss over
    the label tokens, plus the weighted router losses) and every parameter's gradient."""
    model.clear_gradients(set_to_zero=False)
    res = lm_loss(model, batch, fused_head=fused)
    assert (res.logits is None) == fused  # each side really took its own path
    assert res.aux_loss is not None, "no router loss on this path"
    (res.loss_sum / count_target_tokens(batch) + res.aux_loss).backward()
    grads = {n: p.grad.numpy().astype(np.float64) for n, p in model.named_parameters() if p.grad is not None}
    return float(res.loss_sum), float(res.aux_loss), grads


def _by_hand(model, batch) -> tuple[float, float]:
    """(summed token cross entropy, weighted router loss) in float64 numpy from the plain forward:
    logits of position t score labels[t + 1]; router: softmax gate, top-k of probs + correction
    bias, aux = E * sum_e f_e * P_e over the batch's tokens."""
    seen = []
    moes = [l.mlp for l in model.model.layers if isinstance(l.mlp, MoEBlock)]
    hooks = [m.register_forward_pre_hook(lambda layer, inp: seen.append(inp[0].numpy())) for m in moes]
    with paddle.no_grad():
        logits = model(paddle.to_tensor(batch["input_ids"])).logits.numpy().astype(np.float64)
    for h in hooks:
        h.remove()
    lg, lab = logits[:, :-1], batch["labels"][:, 1:]
    m = lab != -100
    top = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - top).sum(-1)) + top[..., 0]
    nll = lse - np.take_along_axis(lg, np.where(m, lab, 0)[..., None], -1)[..., 0]
    c = model.config
    aux = 0.0
    for x, moe in zip(seen, moes):
        z = x.reshape(-1, x.shape[-1]).astype(np.float64) @ moe.gate.weight.numpy().astype(np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        chosen = np.argsort(-(p + moe.gate.e_score_correction_bias.numpy()[0]), -1)[:, : c.moe_k]
        f = np.bincount(chosen.reshape(-1), minlength=c.moe_num_experts) / chosen.size
        aux += c.router_aux_loss_coef * c.moe_num_experts * float((f * p.mean(0)).sum())
    return float(nll[m].sum()), aux


@pytest.mark.parametrize("tied", [True, False])
def test_moe_fused_head_gives_the_hand_computed_loss_and_the_whole_logits_gradients(tied):
    model = _moe_model(tied)
    batch = _batch(model.config.vocab_size)
    ce_hand, aux_hand = _by_hand(model, batch)
    whole, aux_whole, g_whole = _step_loss_and_grads(model, batch, fused=False)
    fused, aux_fused, g_fused = _step_loss_and_grads(model, batch, fused=True)
    assert whole == pytest.approx(ce_hand, rel=1e-6) and fused == pytest.approx(ce_hand, rel=1e-6)
    assert aux_whole == pytest.approx(aux_hand, rel=1e-6) and aux_fused == pytest.approx(aux_hand, rel=1e-6)
    assert g_fused.keys() == g_whole.keys()
    router_and_experts = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"}
    assert router_and_experts <= g_whole.keys()  # the router loss reaches the gate, the LM loss the experts
    norm = lambda g: np.sqrt(sum((v**2).sum() for v in g.values()))  # noqa: E731
    assert norm(g_fused) == pytest.approx(norm(g_whole), rel=1e-6)
    for n in g_whole:
        np.testing.assert_allclose(g_fused[n], g_whole[n], rtol=1e-4, atol=1e-7, err_msg=n)


def _one_step(tmp_path, name: str, *overrides) -> tuple[dict, int]:
    """Step 1's logged scalars of an in-process run, and how many times the chunked head ran."""
    from erniekit.config import load_config, validate
    from erniekit.train.run import run_train

    calls, real = [], linear_cross_entropy.linear_cross_entropy

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    keys = [
        "model_overrides.num_hidden_layers=2",
        f"train_dataset_path={DATA}",
        "max_seq_len=32",
        "per_device_train_batch_size=4",
        "max_steps=1",
        "logging_steps=1",
        "do_eval=false",
        "save_steps=1000",
        "disable_tqdm=true",
        f"output_dir={tmp_path / name}",
    ]
    cfg = validate(load_config(None, keys + list(overrides)))
    mp = pytest.MonkeyPatch()
    mp.setattr(linear_cross_entropy, "linear_cross_entropy", counting)
    try:
        run_train(cfg, log=lambda *a, **k: None)
    finally:
        mp.undo()
    with open(os.path.join(cfg.output_dir, "vdl_log", "scalars.jsonl")) as f:
        rows = [json.loads(line) for line in f if "train/loss" in line]
    return rows[0], len(calls)


@pytest.mark.parametrize(
    "model,extra",
    [
        ("tiny-moe", ["gradient_accumulation_steps=2"]),
        ("tiny-moe", ["model_overrides.tie_word_embeddings=false"]),  # the embedded default's own head
        ("tiny-dense", ["gradient_accumulation_steps=2"]),
    ],
)
def test_one_training_step_logs_the_same_loss_and_grad_norm_with_the_fused_head_on_and_off(tmp_path, model, extra):
    on, chunked = _one_step(tmp_path, "on", f"model_name_or_path={model}", "fused_head_loss=true", *extra)
    off, whole = _one_step(tmp_path, "off", f"model_name_or_path={model}", "fused_head_loss=false", *extra)
    assert chunked > 0 and whole == 0  # the two runs took different paths
    assert on["train/loss"] == pytest.approx(off["train/loss"], rel=1e-6)
    assert on["train/grad_norm"] == pytest.approx(off["train/grad_norm"], rel=1e-6)
    assert on.get("train/router_loss", 0.0) == pytest.approx(off.get("train/router_loss", 0.0), rel=1e-6)
    assert ("train/router_loss" in on) == (model == "tiny-moe")
