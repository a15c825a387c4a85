"""MoE LoRA adapters between erniekit and PEFT on transformers' fused experts: our adapter loads in
PEFT (transformers >= 5: `target_parameters` on `mlp.experts.gate_up_proj` / `down_proj`) with
no tensor dropped and the same logits; PEFT-trained fused-expert adapters load in erniekit; the
per-expert layout (transformers < 5) round-trips through our loader."""

import json
import warnings

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from erniekit.errors import CheckpointError, ConfigError  # noqa: E402
from erniekit.models.ernie4_5 import from_pretrained  # noqa: E402
from erniekit.nn import lora_fused  # noqa: E402
from erniekit.nn.lora import (  # noqa: E402
    LoraConfig,
    adapters_disabled,
    apply_lora,
    load_adapter,
    load_adapter_weights,
    lora_layers,
    save_adapter,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    initializer_range=0.2,
)
# layer 0: dense MLP; layer 1: 4 routed experts (moe_intermediate_size 16) + a shared expert
MOE = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1)
IDS = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random transformers Ernie4_5_MoeForCausalLM checkpoint (fused experts on disk)."""
    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**TINY, **MOE)).eval().save_pretrained(d)
    return str(d)


def _hf(hf_dir):
    return transformers.Ernie4_5_MoeForCausalLM.from_pretrained(hf_dir).eval()


def _ours(hf_dir):
    m = from_pretrained(hf_dir)
    m.eval()
    return m


def _logits(model):
    return model(paddle.to_tensor(IDS.numpy())).logits.numpy()


def _peft_logits(pm):
    with torch.no_grad():
        return pm(IDS).logits.numpy()


def _randomize(model, seed=1, std=0.2):
    paddle.seed(seed)
    with paddle.no_grad():
        for _, layer in lora_layers(model):
            for p in layer.lora_b_params():
                p.set_value(paddle.randn(p.shape, dtype=p.dtype) * std)


def _assert_close(got, ref):
    err = np.abs(got - ref).max()
    assert err <= TOL, f"max |logit diff| {err} > {TOL}"


def _peft_load(hf_dir, adapter):
    """PEFT's model with `adapter`, and the result of loading the adapter's file into it a second
    time under another name (its missing / unexpected keys: what PEFT dropped or could not place)."""
    with warnings.catch_warnings():
        # PEFT checks rank_pattern keys against module names only, so it reports a pattern for a
        # targeted *parameter* (experts.gate_up_proj) as unmatched although it applied it
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module")
        pm = peft.PeftModel.from_pretrained(_hf(hf_dir), adapter)
        result = pm.load_adapter(adapter, adapter_name="check")
    pm.set_adapter("default")
    return pm, result


def _file_tensors(adapter):
    from safetensors.torch import load_file

    return load_file(f"{adapter}/adapter_model.safetensors")


# ---- (1) our MoE adapter in PEFT, transformers >= 5 --------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        dict(r=4, lora_alpha=8),  # default targets: attention, dense MLP, shared and routed experts
        dict(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.1),
        dict(
            r=2,
            lora_alpha=6,
            target_modules=[r".*\.q_proj", r".*\.experts\.\d+\.up_proj", r".*\.shared_experts\.down_proj"],
        ),
        # no suffix list selects exactly these: full names (a regex PEFT would widen to leaf names)
        dict(
            r=2,
            lora_alpha=4,
            target_modules=[r"model\.layers\.1\.mlp\.experts", r"model\.layers\.0\.self_attn\.q_proj"],
        ),
    ],
    ids=["default", "rslora-dropout", "subset", "layer-subset"],
)
def test_our_moe_adapter_loads_in_peft_with_no_tensor_dropped(tmp_path, hf_dir, cfg):
    ours = _ours(hf_dir)
    apply_lora(ours, LoraConfig(**cfg))
    _randomize(ours)
    got = _logits(ours)
    adapter = str(tmp_path / "ad")
    save_adapter(ours, adapter)  # auto: the installed transformers (>= 5) fuses experts

    pm, result = _peft_load(hf_dir, adapter)
    assert result.missing_keys == [] and result.unexpected_keys == []
    saved = _file_tensors(adapter)
    placed = {n: p for n, p in pm.named_parameters() if ".default." in n}
    assert len(placed) == len(saved)  # every tensor of the file has a home in PEFT's model
    for name, t in saved.items():  # ... and PEFT holds it as written
        torch.testing.assert_close(placed[name.replace(".weight", ".default.weight")], t)
    ref = _peft_logits(pm)
    _assert_close(got, ref)
    with adapters_disabled(ours):  # and the adapter matters
        assert np.abs(_logits(ours) - ref).max() > 1e-2
    back = _ours(hf_dir)  # the same file through our own loader
    load_adapter(back, adapter)
    np.testing.assert_allclose(_logits(back), got, rtol=0, atol=1e-6)


def test_fused_layout_names_shapes_and_config(tmp_path, hf_dir):
    """PEFT's ParamWrapper names: gate_up_proj is the inner wrapper (`experts.base_layer`), rank 2r
    with alpha 2*alpha (gate and up block-diagonal), down_proj outer at rank r; the dense and shared
    MLP Linears are parameter targets (PEFT rewrites module targets named gate/up/down_proj)."""
    ours = _ours(hf_dir)
    apply_lora(ours, LoraConfig(r=4, lora_alpha=8))
    save_adapter(ours, str(tmp_path), peft_layout="fused")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg["target_parameters"] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"] + [
        "experts.gate_up_proj",
        "experts.down_proj",
    ]
    assert cfg["rank_pattern"] == {r"experts\.gate_up_proj": 8} and cfg["alpha_pattern"] == {
        r"experts\.gate_up_proj": 16
    }
    t = _file_tensors(str(tmp_path))
    E, H, I = 4, 32, 16
    pre = "base_model.model.model.layers.1.mlp.experts"
    assert list(t[f"{pre}.base_layer.lora_A.weight"].shape) == [8 * E, H]
    assert list(t[f"{pre}.base_layer.lora_B.weight"].shape) == [2 * I, 8 * E]
    assert list(t[f"{pre}.lora_A.weight"].shape) == [4 * E, I]
    assert list(t[f"{pre}.lora_B.weight"].shape) == [H, 4 * E]
    assert not any(".experts.0." in k for k in t)


# ---- (2) a PEFT-trained fused-expert adapter in erniekit --------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"rank_pattern": {"gate_up_proj": 6}, "alpha_pattern": {"gate_up_proj": 12.0}}],
    ids=["plain", "rank-pattern"],
)
def test_peft_fused_expert_adapter_loads_in_erniekit(tmp_path, hf_dir, extra):
    torch.manual_seed(5)
    pm = peft.get_peft_model(
        _hf(hf_dir),
        peft.LoraConfig(
            r=3,
            lora_alpha=9,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            **extra,
        ),
    )
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.2)
    pm.eval()
    ref = _peft_logits(pm)
    adapter = str(tmp_path / "peft")
    pm.save_pretrained(adapter)

    ours = _ours(hf_dir)
    config = load_adapter(ours, adapter)
    got = _logits(ours)
    _assert_close(got, ref)
    with adapters_disabled(ours):
        assert np.abs(_logits(ours) - ref).max() > 1e-2
    # rank_pattern: gate_up at 6 = 2r but B not block-diagonal: gate and up share A at rank 6, the others zero-padded
    assert config.r == (6 if extra else 3)

    # continued training: the expert adapters are trainable parameters with gradients
    ours.train()
    ours(paddle.to_tensor(IDS.numpy())).logits.mean().backward()
    experts = ours.model.layers[1].mlp.experts
    assert experts.gate_proj_lora_A.grad is not None and experts.down_proj_lora_B.grad is not None
    ours.eval()

    # and back: saved by us in the fused layout, PEFT loads it with the same logits
    again = str(tmp_path / "again")
    save_adapter(ours, again)
    back, result = _peft_load(hf_dir, again)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_close(got, _peft_logits(back))


# ---- (3) both layouts through our own loader ---------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_layouts_round_trip_through_our_loader(tmp_path, hf_dir, layout):
    ours = _ours(hf_dir)
    apply_lora(ours, LoraConfig(r=4, lora_alpha=8, peft_layout=layout))
    _randomize(ours)
    ref = _logits(ours)
    save_adapter(ours, str(tmp_path))
    names = set(_file_tensors(str(tmp_path)))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    if layout == "per_expert":  # transformers < 5: one Linear per expert, as the Hub checkpoints
        assert "base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight" in names
        assert "target_parameters" not in cfg and "down_proj" in cfg["target_modules"]
    else:
        assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in names
    back = _ours(hf_dir)
    config = load_adapter(back, str(tmp_path))
    assert config.r == 4
    np.testing.assert_allclose(_logits(back), ref, rtol=0, atol=1e-6)
    for (_, a), (_, b) in zip(lora_layers(ours), lora_layers(back)):
        for pa, pb in zip(a.adapter_params(), b.adapter_params()):
            np.testing.assert_array_equal(pa.numpy(), pb.numpy())

    # resume: a model with the same adapters applied is refilled from either layout
    resumed = _ours(hf_dir)
    apply_lora(resumed, LoraConfig(r=4, lora_alpha=8))
    load_adapter_weights(resumed, str(tmp_path))
    np.testing.assert_allclose(_logits(resumed), ref, rtol=0, atol=1e-6)
    part = _ours(hf_dir)  # a pipeline stage holds some of the adapted layers: it takes its own
    apply_lora(part, LoraConfig(r=4, lora_alpha=8, target_modules=[r".*\.experts"]))
    load_adapter_weights(part, str(tmp_path))
    want, got = ours.model.layers[1].mlp.experts, part.model.layers[1].mlp.experts
    np.testing.assert_array_equal(got.up_proj_lora_B.numpy(), want.up_proj_lora_B.numpy())


# ---- choosing the layout; what the fused layout cannot hold ------------------------------------


def test_auto_layout_follows_installed_transformers(monkeypatch):
    import importlib.metadata

    def version(v):
        def fake(name):
            assert name == "transformers"
            if v is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return v

        return fake

    for v, want in [("4.57.1", "per_expert"), ("5.0.0", "fused"), ("5.24.0", "fused"), (None, "fused")]:
        monkeypatch.setattr(importlib.metadata, "version", version(v))
        assert lora_fused.resolve_layout("auto") == want
    assert lora_fused.resolve_layout("per_expert") == "per_expert"
    with pytest.raises(ConfigError, match="peft_layout"):
        LoraConfig(peft_layout="fused_experts")


def test_dora_on_experts_is_refused_by_the_fused_layout(tmp_path, hf_dir):
    ours = _ours(hf_dir)
    apply_lora(ours, LoraConfig(r=2, use_dora=True))
    with pytest.raises(ConfigError, match="DoRA.*peft_layout='per_expert'"):
        save_adapter(ours, str(tmp_path / "a"), peft_layout="fused")
    with pytest.warns(UserWarning, match="per-expert layout"):  # auto: the layout that holds it, said so
        save_adapter(ours, str(tmp_path / "b"))
    assert "target_parameters" not in json.loads((tmp_path / "b" / "adapter_config.json").read_text())


def test_fused_adapter_with_mismatched_expert_shapes_is_one_line_error(tmp_path, hf_dir):
    ours = _ours(hf_dir)
    apply_lora(ours, LoraConfig(r=4, lora_alpha=8))
    save_adapter(ours, str(tmp_path), peft_layout="fused")
    from safetensors.torch import save_file

    t = _file_tensors(str(tmp_path))
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"
    t[key] = t[key][:8]  # two experts' worth
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"experts\.lora_A\.weight has shape \[8, 16\], the model expects \[16, 16\]"
    ):
        load_adapter(_ours(hf_dir), str(tmp_path))
