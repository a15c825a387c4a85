"""Stage registry: name -> module, imported only when that stage runs."""

from __future__ import annotations

import importlib

from erniekit.train.stage import Stage

STAGE_MODULES = {
    "pretrain": "erniekit.train.stages.pretrain",
    "SFT": "erniekit.train.stages.sft",
    "DPO": "erniekit.train.stages.dpo",
    "GRPO": "erniekit.train.stages.grpo",
    "PPO": "erniekit.train.stages.ppo",
}


def get_stage(name: str) -> Stage:
    return importlib.import_module(STAGE_MODULES[name]).STAGE
