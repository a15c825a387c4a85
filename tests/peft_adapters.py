"""A PEFT-saved LoRA adapter directory (adapter_config.json + adapter_model.safetensors, no
tokenizer, no config.json) on a tiny transformers ERNIE 4.5, and PEFT's own merge of it: shared
by the unit and e2e tests of adapter directories."""

from __future__ import annotations

import json
import os

QUESTION = "What is 2+3?"


def make_peft_adapter(root: str) -> dict[str, str]:
    """{'base', 'adapter', 'merged'} directories under `root`; the adapter names its base by an
    absolute path, as PEFT writes it after `from_pretrained(path)`."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Ernie4_5Config(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.5,  # peaked logits: greedy choices not decided by rounding
    )
    dirs = {k: os.path.join(root, k) for k in ("base", "adapter", "merged")}
    transformers.Ernie4_5ForCausalLM(cfg).save_pretrained(dirs["base"])
    tok = default_tokenizer()
    tok.save_pretrained(dirs["base"])
    hf = transformers.Ernie4_5ForCausalLM.from_pretrained(os.path.abspath(dirs["base"]))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(hf, lora)
    peft_model.save_pretrained(dirs["adapter"])
    peft_model.merge_and_unload().save_pretrained(dirs["merged"])
    tok.save_pretrained(dirs["merged"])
    assert sorted(os.listdir(dirs["adapter"])) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    return dirs


def set_base(adapter: str, base: str | None) -> None:
    """Rewrite adapter_config.json's base_model_name_or_path."""
    file = os.path.join(adapter, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = base
    with open(file, "w") as f:
        json.dump(cfg, f)
