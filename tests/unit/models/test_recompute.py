"""Activation recompute: every granularity gives the gradients of the plain forward (dense, MoE
with router losses, FP8 experts), really runs its part a second time in the backward, and does
not count MoE loads twice."""

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.nn import recompute as rc
from erniekit.train.losses import causal_lm_loss_sum

MODES = ("full", "full_attn", "core_attn", "mlp")


def _model(preset: str, fp8: int = 0) -> Ernie4_5ForCausalLM:
    cfg = get_preset(preset).replace(hidden_size=128, intermediate_size=192, num_hidden_layers=3)
    if cfg.is_moe:
        cfg = cfg.replace(moe_intermediate_size=128, router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    paddle.seed(0)
    m = Ernie4_5ForCausalLM(cfg)
    if fp8:
        m.set_fp8(fp8, "e5m2")
    return m.train()


def _step(m, ids):
    out = m(paddle.to_tensor(ids))
    loss = causal_lm_loss_sum(out.logits, ids) / ids.size
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in m.named_parameters() if p.grad is not None}
    counts = [l.load_counts.numpy().copy() for l in m.moe_layers()]
    m.clear_gradients()
    for l in m.moe_layers():
        l.load_counts.zero_()
    return float(loss), grads, counts


@pytest.mark.parametrize("preset,fp8", [("tiny-dense", 0), ("tiny-moe", 0), ("tiny-moe", 128)])
def test_every_granularity_gives_the_plain_gradients(preset, fp8):
    m = _model(preset, fp8)
    ids = np.random.RandomState(0).randint(3, 1000, (4, 24))
    loss0, g0, c0 = _step(m, ids)
    assert len(g0) == sum(not p.stop_gradient for p in m.parameters())
    for mode in MODES:
        m.set_recompute(mode)
        loss, g, c = _step(m, ids)
        assert loss == loss0, mode
        assert g.keys() == g0.keys(), mode
        for n in g0:
            np.testing.assert_allclose(g[n], g0[n], rtol=1e-6, atol=1e-9, err_msg=f"{mode} {n}")
        for a, b in zip(c, c0):  # the backward's second run does not count routed tokens again
            np.testing.assert_array_equal(a, b)
        if c0:
            assert all(a.sum() > 0 for a in c)


@pytest.mark.parametrize("mode,part", [("full", "layer"), ("full_attn", "attn"), ("core_attn", "core"), ("mlp", "mlp")])
def test_the_recomputed_part_runs_again_in_the_backward(mode, part, monkeypatch):
    m = _model("tiny-moe")
    m.set_recompute(mode)
    calls = {"layer": 0, "attn": 0, "core": 0, "mlp": 0, "second": 0}
    layer = m.model.layers[1]

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            calls["second"] += rc.recomputing()
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(layer, "_forward", counting("layer", layer._forward))
    monkeypatch.setattr(layer, "_attn", counting("attn", layer._attn))
    monkeypatch.setattr(layer, "_mlp", counting("mlp", layer._mlp))
    monkeypatch.setattr(layer.self_attn, "core", counting("core", layer.self_attn.core))
    ids = np.random.RandomState(1).randint(3, 1000, (2, 16))
    out = m(paddle.to_tensor(ids))
    assert calls[part] == 1 and calls["second"] == 0
    (causal_lm_loss_sum(out.logits, ids) + out.aux_loss).backward()
    assert calls[part] == 2 and calls["second"] >= 1  # the forward of the part again, flagged
    with paddle.no_grad():  # evaluation never recomputes
        before = dict(calls)
        m(paddle.to_tensor(ids))
        assert calls[part] == before[part] + 1 and calls["second"] == before["second"]


def test_recompute_keys_validate_and_reach_the_model(tmp_path):
    from erniekit.train.run import load_model

    with pytest.raises(ConfigError, match="recompute_granularity") as e:
        validate(load_config(None, ["recompute=true", "recompute_granularity=attn"]))
    assert "\n" not in str(e.value)
    cfg = validate(
        load_config(
            None,
            [
                "model_name_or_path=tiny-moe",
                "recompute=true",
                "recompute_granularity=core_attn",
                f"output_dir={tmp_path}",
            ],
        )
    )
    m = load_model(cfg)
    assert all(l.self_attn.recompute_core and l.recompute is None for l in m.model.layers)
    cfg = validate(load_config(None, ["model_name_or_path=tiny-moe", "recompute=true", f"output_dir={tmp_path}"]))
    assert all(l.recompute == "full" for l in load_model(cfg).model.layers)
