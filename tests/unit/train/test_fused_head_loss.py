"""fused_head_loss: the LM stages' loss through the head chunk by chunk (erniekit/nn/linear_cross_entropy.py)
gives the loss and gradients of the head's whole logits, for a tied and an untied head and packed
rows; it steps aside where something needs the logits or the head is more than a product."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.train.batching import collate
from erniekit.train.stage import Stage, lm_loss


def _batch(vocab: int) -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for n in (24, 17, 30):
        ids = rng.integers(3, vocab, n)
        labels = ids.copy()
        labels[: n // 3] = -100  # a prompt
        rows.append({"input_ids": ids, "labels": labels})
    return collate(rows, pad_id=0)


def _loss_and_grads(model, batch, fused: bool):
    model.clear_gradients(set_to_zero=False)
    res = lm_loss(model, batch, fused_head=fused)
    (res.loss_sum * 0.01).backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return res, grads


@pytest.mark.parametrize("tied", [True, False])
def test_fused_head_gives_the_whole_logits_loss_and_gradients(tied):
    c = dataclasses.replace(get_preset("tiny-dense"), tie_word_embeddings=tied)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(c).train()
    batch = _batch(c.vocab_size)
    whole, g_whole = _loss_and_grads(model, batch, fused=False)
    fused, g_fused = _loss_and_grads(model, batch, fused=True)
    assert fused.logits is None and whole.logits is not None  # never made
    assert float(fused.loss_sum) == pytest.approx(float(whole.loss_sum), rel=1e-6)
    assert g_fused.keys() == g_whole.keys()
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert head in g_fused
    for n in g_whole:
        np.testing.assert_allclose(g_fused[n], g_whole[n], rtol=1e-4, atol=1e-7, err_msg=n)


def test_it_steps_aside_for_token_balance_and_for_a_head_that_is_more_than_a_product():
    c = dataclasses.replace(get_preset("tiny-dense"), tie_word_embeddings=False)
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(c).train()
    batch = _batch(c.vocab_size)
    assert lm_loss(model, batch, token_balance=True, fused_head=True).logits is not None

    class Adapted(type(model.lm_head)):  # as a LoRA or quantized head would be: not a plain Linear
        pass

    model.lm_head.__class__ = Adapted
    assert model.head_weight() is None
    assert lm_loss(model, batch, fused_head=True).logits is not None


@pytest.mark.parametrize(
    "keys,fused",
    [
        ({"fused_head_loss": True}, True),
        ({"fused_head_loss": False}, False),
        ({"fused_head_loss": True, "elastic_sandwich": True}, False),  # the sandwich's teacher logits
        ({"fused_head_loss": True, "online_distill_students": [{"num_hidden_layers": 1}]}, False),
    ],
)
def test_the_stage_fuses_unless_something_reads_the_logits(keys, fused):
    from erniekit.train.stages.dpo import DPOStage
    from erniekit.train.stages.pretrain import PretrainStage

    stage = PretrainStage()
    stage.prepare(None, [], None, SimpleNamespace(loss_token_balance=False, **keys), None)
    assert stage.fused_head is fused
    base = Stage()  # a stage that does not declare Supports.fused_head never takes it
    base.prepare(None, [], None, SimpleNamespace(loss_token_balance=False, **keys), None)
    assert base.fused_head is False and DPOStage.supports.fused_head is False


def test_a_vision_language_model_trained_on_text_takes_it_too():
    """SFT on an ERNIE-4.5-VL checkpoint goes through lm_loss: its forward takes skip_head as well."""
    from erniekit.models.registry import load_model

    paddle.seed(0)
    model = load_model("tiny-vl")
    model.train()
    batch = _batch(model.config.vocab_size)
    whole, g_whole = _loss_and_grads(model, batch, fused=False)
    fused, g_fused = _loss_and_grads(model, batch, fused=True)
    assert fused.logits is None
    assert float(fused.loss_sum) == pytest.approx(float(whole.loss_sum), rel=1e-6)
    for n in g_whole:
        np.testing.assert_allclose(g_fused[n], g_whole[n], rtol=1e-4, atol=1e-7, err_msg=n)


def test_the_stages_eval_loss_takes_the_chunked_head_as_training_does(monkeypatch):
    """Pretrain and SFT evaluate through `Stage.eval_lm_loss`: the head chunked when fused_head_loss
    is on (an eval batch's whole logits can outgrow training's), the same held-out loss; also where
    training keeps its logits for the token-balanced loss (evaluation reads none)."""
    from erniekit.nn import linear_cross_entropy
    from erniekit.train.stages.pretrain import PretrainStage

    c = get_preset("tiny-dense")
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(c)
    rng = np.random.default_rng(1)
    rows = []
    for n in (20, 31, 12):
        ids = rng.integers(3, c.vocab_size, n)
        rows.append({"input_ids": ids, "labels": ids.copy()})
    tok = SimpleNamespace(pad_token_id=0)
    cfg = lambda **kw: SimpleNamespace(per_device_eval_batch_size=2, **kw)  # noqa: E731
    chunked, real = [], linear_cross_entropy.linear_cross_entropy
    monkeypatch.setattr(
        linear_cross_entropy, "linear_cross_entropy", lambda *a, **k: chunked.append(1) or real(*a, **k)
    )
    stage = PretrainStage()
    whole = stage.evaluate(model, tok, rows, cfg(fused_head_loss=False))
    assert not chunked
    fused = stage.evaluate(model, tok, rows, cfg(fused_head_loss=True))
    assert len(chunked) == 2  # one per eval batch
    assert fused["loss"] == pytest.approx(whole["loss"], rel=1e-6) and fused.keys() == whole.keys()
    stage.prepare(None, [], None, cfg(fused_head_loss=True, loss_token_balance=True), None)
    assert not stage.fused_head  # training keeps the logits for the token-balanced loss ...
    stage.evaluate(model, tok, rows, cfg(fused_head_loss=True, loss_token_balance=True))
    assert len(chunked) == 4  # ... its evaluation does not
    from erniekit.train.stages.dpo import DPOStage

    assert not DPOStage().eval_fused_head(cfg(fused_head_loss=True))
