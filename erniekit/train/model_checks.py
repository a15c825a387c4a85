"""Checks of a run config against its model's config (sizes, heads, experts, layers).

A launched rank runs them once it has built its model (train/run.py); `erniekit train` runs the
same functions on the model config alone (config.json or the preset, no weights) before it starts
any process, so a layout the model cannot take is one line, not a failed job (docs/distributed.md,
"Checks before any process starts")."""

from __future__ import annotations

from erniekit.errors import ConfigError


def check_stop_ids(stop_token_ids: list[int], vocab_size: int) -> None:
    """An id past the vocabulary is never sampled: the stop asked for would never fire."""
    beyond = [t for t in stop_token_ids if t >= vocab_size]
    if beyond:
        raise ConfigError(
            f"stop_token_ids={stop_token_ids}: {beyond[0]} is not a token of this model (vocab_size={vocab_size}); "
            f"use ids below {vocab_size}"
        )


def check_ps_model(config) -> None:
    """What the parameter-server mode cannot train: MTP heads (they need the embedding and head on
    the worker) and an MoE head's bias (the servers hold the head as rows of weights)."""
    if config.num_nextn_predict_layers > 0:
        raise ConfigError(
            "distributed_mode=ps does not train MTP heads (they need the embedding and head on the "
            "worker); set model_overrides.num_nextn_predict_layers=0"
        )
    if getattr(config, "lm_head_bias", False):
        raise ConfigError(
            "distributed_mode=ps does not train the head's bias of an MoE model with use_bias (the servers "
            "hold the head as rows of weights); train it with data or tensor parallelism"
        )


def check_lora_layout(model, fine_tuning: str, peft_layout: str, use_dora: bool) -> None:
    """lora_peft_layout=fused that the adapter cannot be saved in (DoRA on routed experts, modality
    experts) is refused once apply_lora has run, before the first step, not by the first save."""
    if fine_tuning != "LoRA" or peft_layout != "fused":
        return
    from erniekit.nn.lora import fused_layout_obstacle

    why = fused_layout_obstacle(model)
    if why is None:
        return
    alternative = ", or use_dora=false" if use_dora and "DoRA" in why else ""
    raise ConfigError(
        f"lora_peft_layout=fused: the fused-expert PEFT layout (transformers >= 5) cannot hold this run's {why}; "
        f"set lora_peft_layout=per_expert (or auto: per-expert tensors with a warning){alternative}"
    )


def check_model_before_launch(cfg) -> None:
    """The model-dependent checks of a multi-process job's ranks, on the model config the ranks
    build (registry.load_model's: the checkpoint's config.json or the preset, plus
    model_overrides); ConfigError on the first that fails."""
    from erniekit.distributed.collective.layout import Layout, check_model_fits, layout_from_config
    from erniekit.models.registry import model_config

    config = model_config(cfg.model_name_or_path, cfg.model_overrides or None)
    check_stop_ids(cfg.stop_token_ids, config.vocab_size)
    if cfg.distributed_mode == "ps":
        check_ps_model(config)
        pp = cfg.pipeline_parallel_degree
        if pp > 1:  # the workers' pipeline splits the layers as a collective one does
            check_model_fits(Layout(pp=pp), config, stage_layers=cfg.pipeline_stage_layers)
        return
    check_model_fits(layout_from_config(cfg.parallelism), config, cfg.pipeline_stage_layers, cfg.expert_fp8_block)
