"""VL-SFT's losses on a batch of real pictures (the synthetic shapes, encoded as training encodes
them), not hand-built modality ids: the token-balanced loss against a per-example mean NLL written
out in numpy, and each MoE layer's router losses against their formulas on the modality ids the
batch's own tokens give (image tokens and their start / end to the vision experts): the
load-balancing loss per modality over its own tokens and experts, the orthogonal loss over both
routers. And the text model's recompute and FP8 experts on the same batch."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from erniekit.data.synthetic_vl import synthetic_conversations
from erniekit.data.vl import encode_vl_conversation
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration, moe_modality
from erniekit.models.ernie4_5_vl.processor import ImageSettings
from erniekit.models.registry import model_config
from erniekit.train.stages.vl_sft import vl_loss

AUX, ORTHO = 0.1, 0.5


def _batch(cfg, n: int = 3) -> dict:
    settings = ImageSettings(min_pixels=56 * 56, max_pixels=84 * 84)  # examples/configs/tiny/vl_sft.yaml's
    rows = [
        encode_vl_conversation(c, default_tokenizer(), cfg, settings, 256)
        for c in synthetic_conversations(f"synthetic:shapes/train?n={n}")
    ]
    width = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": np.zeros((n, width), np.int64),
        "labels": np.full((n, width), -100, np.int64),
        "segment_ids": np.zeros((n, width), np.int64),
        "images": np.empty(n, dtype=object),
    }
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        batch["input_ids"][i, :k] = r["input_ids"]
        batch["labels"][i, :k] = r["labels"]
        batch["segment_ids"][i, :k] = 1
        batch["images"][i] = r["images"]
    return batch


@pytest.fixture(scope="module")
def run():
    paddle.seed(3)
    cfg = model_config("tiny-vl").replace(
        router_aux_loss_coef=AUX, router_orthogonal_loss_coef=ORTHO, initializer_range=0.2
    )
    model = Ernie4_5_VLForConditionalGeneration(cfg)
    model.train()
    batch = _batch(cfg)
    out = vl_loss(model, batch, token_balance=True)
    return cfg, model, batch, out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_token_balanced_loss_is_the_sum_of_each_examples_mean_nll(run):
    _, _, batch, out = run
    logp = _log_softmax(out.logits.numpy())
    want = 0.0
    for i in range(len(batch["labels"])):
        labels = batch["labels"][i]
        t = np.nonzero(labels[1:] != -100)[0]  # position t predicts labels[t + 1]
        assert 0 < len(t) < (batch["segment_ids"][i] == 1).sum() / 4  # few text targets among image tokens
        want += -logp[i, t, labels[t + 1]].mean()
    np.testing.assert_allclose(float(out.loss_sum), want, rtol=1e-5)


def test_modality_ids_come_from_the_batchs_own_image_tokens(run):
    cfg, model, batch, _ = run
    mod = moe_modality(batch["input_ids"], cfg).reshape(-1)
    ids = batch["input_ids"].reshape(-1)
    vision = np.isin(ids, [cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id])
    np.testing.assert_array_equal(mod, vision.astype(np.int64))
    for block in model.moe_layers():
        np.testing.assert_array_equal(block.last_modality.numpy(), mod)


def _ortho(w: np.ndarray) -> float:
    w = w.astype(np.float64)
    w = w / np.sqrt((w * w).sum(0, keepdims=True))
    g = w.T @ w - np.eye(w.shape[1])
    return float((g * g).mean())


def test_router_losses_follow_their_formulas_per_modality(run):
    cfg, model, batch, out = run
    mod = moe_modality(batch["input_ids"], cfg).reshape(-1)
    total = 0.0
    for block in model.moe_layers():
        probs, topk = block.last_probs.numpy(), block.last_topk_idx.numpy()
        aux = ortho = 0.0
        for m, (offset, n) in enumerate(zip(block.offsets, block.experts_per_modality)):
            rows = mod == m
            assert rows.sum() > 0 and (topk[rows] >= offset).all() and (topk[rows] < offset + n).all()
            f = np.bincount((topk[rows] - offset).reshape(-1), minlength=n) / topk[rows].size
            aux += n * float((f * probs[rows][:, offset : offset + n].mean(0)).sum())
            ortho += _ortho(block.router(m).weight.numpy())
        np.testing.assert_allclose(float(block.loss_parts["aux"]), aux, rtol=1e-5)
        np.testing.assert_allclose(float(block.loss_parts["orthogonal"]), ortho, rtol=1e-5)
        total += AUX * aux + ORTHO * ortho
    np.testing.assert_allclose(float(out.aux_loss), total, rtol=1e-5)


def test_the_orthogonal_loss_trains_both_routers(run):
    _, model, _, out = run
    out.aux_loss.backward()
    for block in model.moe_layers():
        for m in range(block.num_modalities):
            grad = block.router(m).weight.grad
            assert grad is not None and float(paddle.abs(grad).max()) > 0


def _vl_step(model, batch) -> tuple[float, dict[str, np.ndarray]]:
    out = vl_loss(model, batch, token_balance=True)
    loss = out.loss_sum + out.aux_loss
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return float(loss), grads


@pytest.mark.parametrize("fp8", [0, 32])
def test_recompute_gives_the_plain_gradients_with_pictures(fp8):
    """The text model's recompute and FP8 experts, reused by the VL model, on a batch of pictures:
    each recompute granularity gives the plain step's loss and gradients (vision tower included),
    with emulated FP8 experts too; FP8 moves the loss a little and only a little."""
    cfg = model_config("tiny-vl").replace(router_aux_loss_coef=AUX, router_orthogonal_loss_coef=ORTHO)
    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(cfg).train()
    batch = _batch(cfg)
    plain, _ = _vl_step(model, batch)
    if fp8:
        model.set_fp8(fp8, "e5m2")
    loss0, g0 = _vl_step(model, batch)
    assert any(n.startswith("vision_model.") for n in g0) and any(n.startswith("resampler_model.") for n in g0)
    if fp8:
        assert loss0 != plain and abs(loss0 - plain) < 0.02 * abs(plain)
    for mode in ("full", "full_attn", "core_attn", "mlp"):
        model.set_recompute(mode)
        loss, g = _vl_step(model, batch)
        assert loss == loss0, mode
        assert g.keys() == g0.keys(), mode
        for n in g0:
            np.testing.assert_allclose(g[n], g0[n], rtol=1e-6, atol=1e-9, err_msg=f"{mode} {n}")


def test_the_chunked_head_gives_the_whole_logits_loss_and_gradients_on_pictures():
    """fused_head_loss on VL-SFT: the head and its loss chunk by chunk (no logits), the same loss and
    gradients as the whole logits on a batch with pictures; the token-balanced loss keeps the logits."""
    paddle.seed(4)
    cfg = model_config("tiny-vl")
    model = Ernie4_5_VLForConditionalGeneration(cfg)
    model.train()
    batch = _batch(cfg, n=2)

    def run(fused):
        model.clear_gradients(set_to_zero=False)
        out = vl_loss(model, batch, fused_head=fused)
        (out.loss_sum * 0.01).backward()
        return out, {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}

    (whole, g_whole), (fused, g_fused) = run(False), run(True)
    assert fused.logits is None and whole.logits is not None
    assert float(fused.loss_sum) == pytest.approx(float(whole.loss_sum), rel=1e-6)
    assert g_fused.keys() == g_whole.keys()
    for n in g_whole:
        np.testing.assert_allclose(g_fused[n], g_whole[n], rtol=1e-4, atol=1e-7, err_msg=n)
    assert vl_loss(model, batch, token_balance=True, fused_head=True).logits is not None


def _train_cfg(**kw):
    import dataclasses

    from erniekit.config.schema import TrainConfig

    base = {"model_name_or_path": "tiny-vl", "train_dataset_path": "synthetic:shapes/train?n=2", "max_seq_len": 256}
    return dataclasses.replace(TrainConfig(), **{**base, **kw})


@pytest.mark.parametrize("lo, hi", [(56 * 56, 0), (84 * 84, 56 * 56)])
def test_an_image_budget_no_picture_fits_is_a_config_error_before_any_is_read(lo, hi):
    from erniekit.errors import ConfigError
    from erniekit.train.stages.vl_sft import VLSFTStage

    cfg = _train_cfg(image_min_pixels=lo, image_max_pixels=hi)
    with pytest.raises(ConfigError, match=f"image_min_pixels={lo}, image_max_pixels={hi} are invalid") as e:
        VLSFTStage().build_train_rows(cfg, default_tokenizer())
    assert "\n" not in str(e.value)


def test_videos_are_trained_as_the_checkpoint_serves_them(tmp_path):
    """VL-SFT from a checkpoint samples and sizes video frames with its video_preprocessor_config.json
    (the settings it is served with and saves again), not the hub processor's defaults."""
    import json

    from media_files import moving_square, write_mp4

    from erniekit.models.ernie4_5_vl.video import VideoSettings
    from erniekit.models.registry import save_model
    from erniekit.train.stages.vl_sft import VLSFTStage

    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl"))
    model.video_settings = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=2, max_frames=2)
    save_model(model, str(tmp_path / "ckpt"), tokenizer=default_tokenizer())
    write_mp4(tmp_path / "v.mp4", moving_square(6, 64, 64), 6)
    part = {"type": "video_url", "video_url": {"url": "v.mp4"}}
    rec = {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "right"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    cfg = _train_cfg(model_name_or_path=str(tmp_path / "ckpt"), train_dataset_path=str(tmp_path / "d.jsonl"))
    (row,) = VLSFTStage().build_train_rows(cfg, default_tokenizer())
    assert row["videos"][1].tolist() == [[2, 4, 4]]  # 2 frames of 56 x 56, as the checkpoint says
