"""Which LoRA runs pipeline parallelism takes (erniekit/config/checks.py pipeline_refusal): the
pretrain and SFT stages' adapters, LoRA or DoRA, with the base in float32 or bfloat16; the other
pipeline stage (Distill) trains full models only, refused in one line that names the fix."""

from __future__ import annotations

import dataclasses

import pytest

from erniekit.config import TrainConfig, validate
from erniekit.config.checks import layout_refusal, pipeline_refusal
from erniekit.distributed.collective.layout import Layout
from erniekit.errors import ConfigError

PP = {"nproc_per_node": 2, "pipeline_parallel_degree": 2, "fine_tuning": "LoRA"}


def cfg(**kw) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **kw)


@pytest.mark.parametrize("kw", [{}, {"use_dora": True}, {"lora_base_dtype": "bfloat16"}, {"lora_dropout": 0.1}])
def test_sft_lora_runs_in_a_pipeline(kw):
    c = validate(cfg(**PP, **kw))
    assert (c.pipeline_parallel_degree, c.fine_tuning) == (2, "LoRA")


def test_pretrain_lora_runs_in_a_pipeline():
    c = cfg(**PP, stage="pretrain")
    assert pipeline_refusal(c) is None and layout_refusal(c, Layout(pp=2), cuda=False) is None


def test_distill_lora_in_a_pipeline_is_one_line_naming_the_fix():
    why = layout_refusal(cfg(**PP, stage="Distill"), Layout(pp=2), cuda=False)
    assert why == (
        "pipeline_parallel_degree=2 trains fine_tuning=LoRA in the pretrain and SFT stages only, not stage=Distill; "
        "set fine_tuning=Full or pipeline_parallel_degree=1"
    )


def test_what_a_pipeline_still_refuses_is_refused_for_lora_too():
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=2 does not train elastic sub-models"):
        validate(cfg(**PP, elastic_depth=[2, 4]))
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=2 combines with data parallelism only"):
        validate(cfg(**{**PP, "nproc_per_node": 4}, expert_parallel_degree=2, model_name_or_path="tiny-moe"))
