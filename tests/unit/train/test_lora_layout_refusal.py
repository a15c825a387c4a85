"""lora_peft_layout=fused that the adapter cannot be saved in (DoRA on routed experts) is refused by
`erniekit train` once apply_lora has run, before the first step, in one line naming the config keys;
it used to train and then fail at the first save, naming save_adapter's Python argument."""

from __future__ import annotations

import os

import pytest
from test_train import SMALL, _run

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError
from erniekit.nn.lora import LoraConfig, apply_lora
from erniekit.train.model_checks import check_lora_layout

MOE = ["model_name_or_path=tiny-moe", "fine_tuning=LoRA", "max_steps=2", "save_steps=1", "do_eval=false"]


def _cfg(*overrides: str):
    return validate(load_config(None, SMALL + MOE + list(overrides)))


def test_dora_on_routed_experts_with_the_fused_layout_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, "out", *MOE, "use_dora=true", "lora_peft_layout=fused")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("lora_peft_layout=fused: ") and "DoRA" in msg
    assert "set lora_peft_layout=per_expert" in msg and "use_dora=false" in msg and "peft_layout='" not in msg
    out = tmp_path / "out"
    assert not os.path.exists(out / "vdl_log" / "scalars.jsonl") and not os.path.exists(out / "checkpoint-1")


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (("use_dora=true", "lora_peft_layout=fused"), True),
        (("use_dora=true", "lora_peft_layout=per_expert"), False),
        (("use_dora=true", "lora_peft_layout=auto"), False),  # auto writes per-expert tensors, with a warning
        (("lora_peft_layout=fused",), False),  # plain LoRA fits the fused layout
        (("use_dora=true", "lora_peft_layout=fused", r"lora_target_modules=.*self_attn\..*"), False),  # no MLP
    ],
)
def test_the_check_follows_save_adapters_rule(overrides, refused):
    from erniekit.models import registry

    cfg = _cfg(*overrides)
    model = registry.load_model(cfg.model_name_or_path, cfg.model_overrides)
    kw = {"target_modules": cfg.lora_target_modules} if cfg.lora_target_modules else {}
    apply_lora(model, LoraConfig(r=2, use_dora=cfg.use_dora, peft_layout=cfg.lora_peft_layout, **kw))
    if refused:
        with pytest.raises(ConfigError, match="lora_peft_layout=fused: .*DoRA on MLP projections"):
            check_lora_layout(model, cfg.fine_tuning, cfg.lora_peft_layout, cfg.use_dora)
    else:
        check_lora_layout(model, cfg.fine_tuning, cfg.lora_peft_layout, cfg.use_dora)
