"""LoRA / rsLoRA / DoRA / LoRA+: exactness at init and when disabled, merge/unmerge, training
touches only adapters, PEFT-layout io checked against transformers' module structure and logits."""

import json

import numpy as np
import paddle
import pytest

from erniekit.errors import CheckpointError, ConfigError
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset, save_pretrained
from erniekit.nn.linear import Linear
from erniekit.nn.lora import (
    LoraConfig,
    LoraLinear,
    LoraStackedExperts,
    adapters_disabled,
    apply_lora,
    load_adapter,
    lora_layers,
    lora_param_groups,
    merge_and_unload,
    merge_lora,
    save_adapter,
    set_adapters_enabled,
    unmerge_lora,
)
from erniekit.nn.moe import StackedExperts

IDS = paddle.to_tensor(np.random.RandomState(0).randint(0, 1024, (2, 12)))


def _model(preset="tiny-moe", seed=0, **overrides):
    paddle.seed(seed)
    cfg = get_preset(preset).replace(**{"num_hidden_layers": 2, "initializer_range": 0.2, **overrides})
    m = Ernie4_5ForCausalLM(cfg)
    m.eval()
    return m


def _randomize(model, seed=1, std=0.05):
    """Non-trivial adapters: random B, and for DoRA a magnitude that is no longer ||W||."""
    paddle.seed(seed)
    with paddle.no_grad():
        for _, layer in lora_layers(model):
            for p in layer.lora_b_params():
                p.set_value(paddle.randn(p.shape, dtype=p.dtype) * std)
            for n, p in layer.named_parameters():
                if "magnitude" in n:
                    p.set_value(p * (1 + 0.1 * paddle.randn(p.shape, dtype=p.dtype)))


def _logits(model):
    return model(IDS).logits.numpy()


def _close(a, b, rel=1e-5):
    """fp32 logits agree to `rel` of their scale (the forward itself differs from fp64 by ~2e-6 of it)."""
    err, scale = np.abs(a - b).max(), max(1.0, np.abs(b).max())
    assert err <= rel * scale, f"max |diff| {err} > {rel} * {scale}"


def _snapshot(model):
    return {n: p.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset,dora", [("tiny-dense", False), ("tiny-moe", False), ("tiny-moe", True)])
def test_init_equals_base_and_all_projections_adapted(preset, dora):
    m = _model(preset)
    base = _logits(m)
    names = apply_lora(m, LoraConfig(r=4, use_dora=dora))
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.0.mlp.down_proj" in names
    if preset == "tiny-moe":
        assert {"model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.up_proj"} <= set(names)
        assert isinstance(m.model.layers[1].mlp.experts, LoraStackedExperts)
    assert len(names) == len(lora_layers(m))
    np.testing.assert_array_equal(_logits(m), base)


def test_only_adapters_are_trainable_and_seen_by_the_optimizer():
    from erniekit.train.optim import AdamW

    m = _model()
    base_names = {n for n, _ in m.named_parameters()}
    apply_lora(m, LoraConfig(r=4, use_dora=True))
    trainable = {n for n, p in m.named_parameters() if not p.stop_gradient}
    adapter = {n for n, p in m.named_parameters() if any(p is q for _, l in lora_layers(m) for q in l.adapter_params())}
    assert trainable == adapter and trainable.isdisjoint(base_names)
    assert "model.layers.1.mlp.experts.gate_proj_lora_B" in trainable
    assert all(p.stop_gradient for n, p in m.named_parameters() if n in base_names)
    assert {n for n, _ in AdamW(m.named_parameters(), lr=1e-3).params} == trainable


def test_sgd_steps_change_only_adapter_params():
    m = _model()
    apply_lora(m, LoraConfig(r=4, use_dora=True, lora_dropout=0.1))
    before = _snapshot(m)
    m.train()
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=m.parameters())  # given all: frozen ones skip
    for _ in range(3):
        logits = m(IDS).logits
        loss = paddle.nn.functional.cross_entropy(
            logits[:, :-1].reshape([-1, logits.shape[-1]]), IDS[:, 1:].reshape([-1])
        )
        loss.backward()
        opt.step()
        opt.clear_grad()
    after = _snapshot(m)
    trainable = {n for n, p in m.named_parameters() if not p.stop_gradient}
    for n in before:
        if n in trainable:
            assert not np.array_equal(before[n], after[n]), f"adapter {n} did not train"
        else:
            np.testing.assert_array_equal(before[n], after[n], err_msg=n)


def _adapted_base_weights(model):
    out = {}
    for name, layer in lora_layers(model):
        if isinstance(layer, LoraLinear):
            out[name] = layer.weight
        else:
            out.update({f"{name}.{p}": getattr(layer, p) for p in layer.projs})
    return out


@pytest.mark.parametrize(
    "preset,dora,rslora",
    [
        ("tiny-dense", False, False),
        ("tiny-dense", True, True),
        ("tiny-moe", False, True),
        ("tiny-moe", True, False),
    ],
)
def test_merge_equals_adapter_and_unmerge_restores_base(preset, dora, rslora):
    m = _model(preset)
    base = _logits(m)
    apply_lora(m, LoraConfig(r=4, lora_alpha=8, use_dora=dora, use_rslora=rslora))
    _randomize(m)
    weights = {n: w.numpy().copy() for n, w in _adapted_base_weights(m).items()}
    adapted = _logits(m)
    assert np.abs(adapted - base).max() > 0.1  # the adapters do something
    merge_lora(m)
    changed = [n for n, w in _adapted_base_weights(m).items() if not np.array_equal(w.numpy(), weights[n])]
    assert len(changed) == len(weights)  # every adapted weight, experts included, was folded
    _close(_logits(m), adapted)
    unmerge_lora(m)
    for n, w in _adapted_base_weights(m).items():
        np.testing.assert_allclose(w.numpy(), weights[n], atol=1e-6, rtol=0, err_msg=n)
    _close(_logits(m), adapted)


def test_rslora_scale():
    assert LoraConfig(r=16, lora_alpha=32).scaling == 2.0
    assert LoraConfig(r=16, lora_alpha=32, use_rslora=True).scaling == 8.0


def test_disabled_adapters_give_the_base_model_exactly():
    m = _model()
    base = _logits(m)
    apply_lora(m, LoraConfig(r=4, use_dora=True))
    _randomize(m)
    adapted = _logits(m)
    with adapters_disabled(m):
        np.testing.assert_array_equal(_logits(m), base)
    np.testing.assert_array_equal(_logits(m), adapted)
    set_adapters_enabled(m, False)
    np.testing.assert_array_equal(_logits(m), base)
    set_adapters_enabled(m, True)
    merge_lora(m)
    with pytest.raises(ConfigError, match="unmerge_lora"):
        set_adapters_enabled(m, False)


def test_merge_and_unload_gives_a_plain_checkpoint(tmp_path):
    m = _model()
    names = [n for n, _ in m.named_parameters()]
    apply_lora(m, LoraConfig(r=4, use_dora=True))
    _randomize(m)
    adapted = _logits(m)
    out = merge_and_unload(m)
    assert out is m and not lora_layers(m)
    assert type(m.model.layers[1].mlp.experts) is StackedExperts
    assert type(m.model.layers[0].self_attn.q_proj) is Linear
    assert [n for n, _ in m.named_parameters()] == names
    assert not any(p.stop_gradient for n, p in m.named_parameters() if n.endswith("q_proj.weight"))
    save_pretrained(m, str(tmp_path))
    _close(_logits(from_pretrained(str(tmp_path))), adapted)


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    m = _model()
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, use_rslora=True)
    apply_lora(m, cfg)
    _randomize(m)
    save_adapter(m, str(tmp_path), base_model_name_or_path="tiny-moe")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["task_type"] == "CAUSAL_LM" and saved["bias"] == "none"
    assert (saved["r"], saved["lora_alpha"], saved["use_rslora"], saved["use_dora"]) == (4, 8, True, True)
    assert saved["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert saved["fan_in_fan_out"] is False and saved["base_model_name_or_path"] == "tiny-moe"

    fresh = _model()
    got = load_adapter(fresh, str(tmp_path))
    assert (got.r, got.lora_alpha, got.use_rslora, got.use_dora) == (4, 8, True, True)
    assert [n for n, _ in lora_layers(fresh)] == [n for n, _ in lora_layers(m)]
    np.testing.assert_array_equal(_logits(fresh), _logits(m))


def test_target_subsets_round_trip_as_peft_regex_and_expert_projection_lists(tmp_path):
    m = _model()
    names = apply_lora(m, LoraConfig(r=2, target_modules=[r"model\.layers\.[01]\.self_attn\.(q|v)_proj"]))
    assert names == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]
    save_adapter(m, str(tmp_path))
    assert isinstance(json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"], list)

    m = _model()  # PEFT-style suffix list selects one projection of the routed experts
    apply_lora(m, LoraConfig(r=2, target_modules=[r"(?:.*\.)?gate_proj"]))
    assert m.model.layers[1].mlp.experts.projs == ("gate_proj",)

    m = _model()
    apply_lora(
        m, LoraConfig(r=2, target_modules=[r"model\.layers\.1\.mlp\.experts", r"model\.layers\.0\.self_attn\.q_proj"])
    )
    _randomize(m)
    save_adapter(m, str(tmp_path), peft_layout="per_expert")  # fused: full names (tests/unit/nn/test_peft_moe.py)
    tm = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(tm, str)  # no suffix list selects exactly these
    fresh = _model()
    load_adapter(fresh, str(tmp_path))
    assert [n for n, _ in lora_layers(fresh)] == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts"]
    np.testing.assert_array_equal(_logits(fresh), _logits(m))


def test_lora_plus_param_groups_mark_b():
    m = _model()
    apply_lora(m, LoraConfig(r=4, lora_plus_scale=16.0, use_dora=True))
    groups = lora_param_groups(m)
    assert set(groups) == {n for n, p in m.named_parameters() if not p.stop_gradient}
    for n, mult in groups.items():
        assert mult == (16.0 if n.endswith("lora_B") else 1.0), n
    assert groups["model.layers.1.mlp.experts.down_proj_lora_B"] == 16.0
    assert lora_param_groups(m, lora_plus_scale=4.0)["model.layers.0.self_attn.q_proj.lora_B"] == 4.0


def test_bad_pattern_lists_module_names_and_leaves_model_untouched():
    m = _model()
    with pytest.raises(ConfigError) as e:
        apply_lora(m, LoraConfig(target_modules=[r".*\.q_proj", "nope"]))
    msg = str(e.value)
    assert "'nope'" in msg and "model.layers.0.self_attn.q_proj" in msg and "model.layers.1.mlp.experts" in msg
    assert "\n" not in msg
    assert not lora_layers(m) and not any(p.stop_gradient for n, p in m.named_parameters() if "q_proj" in n)
    with pytest.raises(ConfigError, match="r=0"):
        LoraConfig(r=0)


def test_adapter_errors_name_the_file_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        load_adapter(_model("tiny-dense"), str(tmp_path / "none"))

    src = _model("tiny-dense", num_hidden_layers=3)
    apply_lora(src, LoraConfig(r=4))
    save_adapter(src, str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\..*does not have"):
        load_adapter(_model("tiny-dense"), str(tmp_path / "a"))  # 2 layers: layer 2 tensors are foreign

    other = _model("tiny-dense", num_hidden_layers=3, intermediate_size=256)
    with pytest.raises(CheckpointError) as e:
        load_adapter(other, str(tmp_path / "a"))
    msg = str(e.value)
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight" in msg, msg
    assert "[384, 4]" in msg and "[256, 4]" in msg, msg
    assert not lora_layers(other)  # checked before anything changed

    cfg_file = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["target_modules"] = ["v_proj"]  # the file still holds q_proj, k_proj, ... tensors
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"_proj\.lora_[AB]\.weight is for module .* does not select"):
        load_adapter(_model("tiny-dense", num_hidden_layers=3), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        set_adapters_enabled(_model("tiny-dense"), False)


def test_bf16_base_runs_on_cpu_and_matches_fp32_base(tmp_path):
    m = _model()
    apply_lora(m, LoraConfig(r=4, use_dora=True))
    _randomize(m)
    save_adapter(m, str(tmp_path))
    ref = _logits(m)

    b = _model()
    load_adapter(b, str(tmp_path), base_dtype="bfloat16")
    q = b.model.layers[1].mlp.experts
    assert str(b.model.layers[0].self_attn.q_proj.weight.dtype).endswith("bfloat16") and str(q.up_proj.dtype).endswith(
        "bfloat16"
    )
    assert str(q.up_proj_lora_A.dtype).endswith("float32")
    got = _logits(b)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.1  # bf16-rounded base: loose

    # exact check of the path: an fp32 model holding the bf16-rounded base weights gives the same
    held_bf16 = {n for n, p in b.named_parameters() if str(p.dtype).endswith("bfloat16")}
    assert held_bf16
    rounded = _model()
    for n, p in rounded.named_parameters():
        if n in held_bf16:
            p.set_value(p.astype("bfloat16").astype("float32"))
    load_adapter(rounded, str(tmp_path))
    _close(got, _logits(rounded))

    b.train()
    b(IDS).logits.mean().backward()
    assert b.model.layers[0].self_attn.q_proj.lora_B.grad is not None
    merge_and_unload(b)
    assert str(b.model.layers[0].self_attn.q_proj.weight.dtype).endswith("float32")


# ---- PEFT layout against transformers ---------------------------------------------------------


@pytest.mark.parametrize("moe,dora", [(False, False), (True, True)])
def test_peft_layout_matches_transformers_names_shapes_and_logits(tmp_path, moe, dora):
    """Names/shapes against transformers' modules and the Hub per-expert tensor names; numerics by
    folding s*B@A (DoRA: m * V / ||V||) into the torch weights by hand (no `peft` needed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from erniekit.models.ernie4_5.checkpoint import hf_state_dict

    torch.manual_seed(0)
    tiny = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
    )
    if moe:
        hf = transformers.Ernie4_5_MoeForCausalLM(
            transformers.Ernie4_5_MoeConfig(
                **tiny,
                moe_num_experts=4,
                moe_k=2,
                moe_intermediate_size=16,
                moe_num_shared_experts=1,
                moe_layer_start_index=1,
            )
        )
    else:
        hf = transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**tiny))
    hf.eval().save_pretrained(tmp_path / "hf")
    ours = from_pretrained(str(tmp_path / "hf"))
    ours.eval()
    hub_2d = {n[: -len(".weight")]: list(t.shape) for n, t in hf_state_dict(ours).items() if t.ndim == 2}
    apply_lora(ours, LoraConfig(r=4, lora_alpha=8, use_dora=dora))
    _randomize(ours, std=0.2)
    save_adapter(ours, str(tmp_path / "ad"))
    tensors = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]

    # every Hub-layout 2-D weight of a targeted module has exactly its lora_A/lora_B (and magnitude)
    hub = {mod: shape for mod, shape in hub_2d.items() if mod.rsplit(".", 1)[-1] in cfg["target_modules"]}
    suffixes = ["lora_A.weight", "lora_B.weight"] + (["lora_magnitude_vector"] if dora else [])
    assert set(tensors) == {f"base_model.model.{mod}.{s}" for mod in hub for s in suffixes}
    if moe:
        assert "base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight" in tensors
    modules = dict(hf.named_modules())
    for mod, (out_f, in_f) in hub.items():
        assert list(tensors[f"base_model.model.{mod}.lora_A.weight"].shape) == [4, in_f]
        assert list(tensors[f"base_model.model.{mod}.lora_B.weight"].shape) == [out_f, 4]
        if ".experts." not in mod:  # transformers 5 fuses routed experts into 3-D parameters
            assert isinstance(modules[mod], torch.nn.Linear)
            assert (modules[mod].out_features, modules[mod].in_features) == (out_f, in_f)

    def fold(w, mod):
        v = (
            w
            + scale
            * tensors[f"base_model.model.{mod}.lora_B.weight"]
            @ tensors[f"base_model.model.{mod}.lora_A.weight"]
        )
        if dora:
            v = tensors[f"base_model.model.{mod}.lora_magnitude_vector"][:, None] * v / v.norm(dim=1, keepdim=True)
        return v

    with torch.no_grad():
        for mod in hub:
            if ".experts." in mod:
                parent, e, proj = mod.rsplit(".", 2)
                ex, e, inter = modules[parent], int(e), modules[parent].intermediate_dim
                if proj == "down_proj":
                    ex.down_proj[e] = fold(ex.down_proj[e], mod)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    ex.gate_up_proj[e, rows] = fold(ex.gate_up_proj[e, rows], mod)
            else:
                modules[mod].weight.copy_(fold(modules[mod].weight, mod))
        ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
        ref = hf(ids).logits.numpy()
    got = ours(paddle.to_tensor(ids.numpy())).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)
    with adapters_disabled(ours):  # and the adapters really changed the output
        assert np.abs(ours(paddle.to_tensor(ids.numpy())).logits.numpy() - ref).max() > 1e-2


@pytest.mark.parametrize("targets", [r".*\.q_proj", r".*\.(q_proj|v_proj)"])
def test_adapters_on_some_attention_projections_train(targets):
    """PEFT's classic targets (q and v, or q alone): in the first layer k (and v) come from the frozen
    embedding and take no gradient; the CPU attention kernel's backward gave them one anyway and
    Paddle stopped the first backward."""
    m = _model("tiny-dense")
    m.train()
    names = apply_lora(m, LoraConfig(r=4, target_modules=targets))
    assert names and all(n.endswith(("q_proj", "v_proj")) for n in names)
    m(input_ids=IDS).logits.square().mean().backward()
    grads = [p.grad for n, p in m.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
