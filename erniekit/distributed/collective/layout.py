"""Config degrees -> one parallel layout, checked against the process count and the model
before any process starts. Importing this module does not import paddle (the CLI checks first).

Mesh dims, outermost first: pp (pipeline stages), dp (data replicas), sharding (data replicas
whose optimizer state, and at stage 3 parameters, are split), tp (tensor parallel). Expert
parallelism reuses the data ranks, as in ERNIE 4.5 / PaddleFormers: with `expert_parallel_degree`
> 1 the experts are split over all dp x sharding data ranks, so it must equal that product and
divide the expert count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from erniekit.errors import ConfigError

DIMS = ("pp", "dp", "sharding", "tp")
# Linears split over tp, by name (runtime.py places them, lora_cost.py counts them so): column-parallel
# (their output width) and row-parallel (their input width)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "up_gate_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# a VL model's vision transformer and resampler stay whole on every tp rank (runtime.py places them,
# lora_cost.py and the planner count them so): every tp rank encodes the same pictures; their layer
# names (qkv, proj, fc1, fc2, mlp) are kept from matching the text model's by this rule, not by luck
WHOLE_OVER_TP = ("vision_model", "resampler_model")


def whole_over_tp(name: str) -> bool:
    """A parameter (or module) of a VL model's vision transformer or resampler: replicated over tp."""
    return any(part in WHOLE_OVER_TP for part in name.split(".")[:-1])


SHARDING_STAGES = {"": 0, "stage1": 1, "stage2": 2, "stage3": 3}


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    sharding: int = 1
    tp: int = 1
    ep: int = 1
    sharding_stage: int = 0

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.sharding * self.tp

    @property
    def shape(self) -> list[int]:
        return [getattr(self, d) for d in DIMS]

    @property
    def data_only(self) -> bool:
        """Several processes that only split the batch: each holds the whole model."""
        return self.world > 1 and self.world == self.dp and self.ep == 1 and not self.sharding_stage

    def describe(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in DIMS + ("ep",) if getattr(self, d) > 1]
        if self.sharding_stage:
            parts.append(f"sharding stage{self.sharding_stage}")
        return " ".join(parts) or "single process"

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dim (row-major over DIMS, tp innermost)."""
        out = {}
        for d in reversed(DIMS):
            n = getattr(self, d)
            out[d] = rank % n
            rank //= n
        return out

    def mesh(self):
        """The paddle ProcessMesh over ranks 0..world-1 with named dims."""
        import numpy as np
        import paddle.distributed as dist

        return dist.ProcessMesh(np.arange(self.world).reshape(self.shape).tolist(), dim_names=list(DIMS))


def world_size(cfg) -> int:
    return cfg.nproc_per_node * cfg.nnodes


def layout_from_config(cfg, world: int | None = None) -> Layout:
    """Resolve `data_parallel_degree: -1` (whatever the other degrees leave) and check the product."""
    world = world_size(cfg) if world is None else world
    stage = SHARDING_STAGES[cfg.sharding]
    sd = cfg.sharding_parallel_degree
    if stage and sd == 1 and cfg.data_parallel_degree == -1:
        sd = world // max(1, cfg.tensor_parallel_degree * cfg.pipeline_parallel_degree)  # all data ranks shard
    fixed = cfg.tensor_parallel_degree * cfg.pipeline_parallel_degree * sd
    dp = cfg.data_parallel_degree
    if dp == -1:
        if world % fixed:
            raise ConfigError(
                f"tensor_parallel_degree {cfg.tensor_parallel_degree} x pipeline_parallel_degree "
                f"{cfg.pipeline_parallel_degree} x sharding_parallel_degree {sd} = {fixed} does not divide the "
                f"{world} processes (nproc_per_node {cfg.nproc_per_node} x nnodes {cfg.nnodes}); change the degrees"
            )
        dp = world // fixed
    lay = Layout(
        pp=cfg.pipeline_parallel_degree,
        dp=dp,
        sharding=sd,
        tp=cfg.tensor_parallel_degree,
        ep=cfg.expert_parallel_degree,
        sharding_stage=stage,
    )
    if lay.world != world:
        raise ConfigError(
            f"data_parallel_degree {dp} x sharding_parallel_degree {sd} x tensor_parallel_degree {lay.tp} x "
            f"pipeline_parallel_degree {lay.pp} = {lay.world}, but the job has {world} processes (nproc_per_node "
            f"{cfg.nproc_per_node} x nnodes {cfg.nnodes}); make the product equal the process count"
        )
    if sd > 1 and not stage:
        raise ConfigError(f"sharding_parallel_degree {sd} needs sharding: stage1, stage2 or stage3")
    if lay.ep > 1 and lay.dp * lay.sharding != lay.ep:
        raise ConfigError(
            f"expert_parallel_degree {lay.ep} must equal data_parallel_degree x "
            f"sharding_parallel_degree = {lay.dp * lay.sharding} (the experts are split over all the data "
            "ranks), or be 1"
        )
    return lay


def check_stage_layers(stage_layers: list[int] | None, num_layers: int) -> None:
    """`pipeline_stage_layers` must cover the model's layers exactly."""
    if stage_layers and sum(stage_layers) != num_layers:
        raise ConfigError(
            f"pipeline_stage_layers={list(stage_layers)} adds up to {sum(stage_layers)} layers, the model "
            f"has {num_layers} (num_hidden_layers); make the counts add up to {num_layers}"
        )


def _check_fp8_expert_slices(tp: int, config, fp8_block: int) -> None:
    """Each tp rank quantises its slice of a routed expert's width in fp8_block tiles."""
    if not fp8_block or not config.is_moe:
        return
    for size in config.expert_sizes:
        if (size // tp) % fp8_block:
            raise ConfigError(
                f"fp8_block_size {fp8_block} does not divide moe_intermediate_size {size} / "
                f"tensor_parallel_degree {tp} = {size // tp} (each tp rank's slice of the experts); "
                f"set fp8_block_size to a divisor of {size // tp}, e.g. {math.gcd(size // tp, fp8_block)}"
            )


def check_model_fits(lay: Layout, config, stage_layers: list[int] | None = None, fp8_block: int = 0) -> None:
    """Each degree must split the model evenly: one line naming the key, the sizes and the fix (what
    this version does not run is config/checks.py layout_refusal's). fp8_block: the run's
    fp8_block_size (0: no FP8), which must also tile each tp rank's slice of the experts."""
    if lay.tp > 1:
        sizes = [
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("vocab_size", config.vocab_size),
            ("intermediate_size", config.intermediate_size),
        ]
        if config.is_moe:  # shared and routed experts split their width as the dense MLP
            sizes += [("moe_intermediate_size", s) for s in config.expert_sizes]
        for name, size in sizes:
            if size % lay.tp:
                raise ConfigError(
                    f"tensor_parallel_degree {lay.tp} does not divide the model's {name} {size}; "
                    f"use a tensor_parallel_degree that divides it"
                )
        _check_fp8_expert_slices(lay.tp, config, fp8_block)
    if lay.ep > 1:
        if not config.is_moe:
            raise ConfigError(f"expert_parallel_degree {lay.ep}: the model is dense (no experts); set it to 1")
        for m, n in enumerate(config.experts_per_modality):
            if n % lay.ep:
                raise ConfigError(
                    f"expert_parallel_degree {lay.ep} does not divide the {n} experts of modality {m} "
                    "(moe_num_experts); use a degree that divides it"
                )
    if lay.pp > 1 and config.num_nextn_predict_layers > 0:
        raise ConfigError(
            f"pipeline_parallel_degree {lay.pp} with MTP heads (num_nextn_predict_layers "
            f"{config.num_nextn_predict_layers}) is not supported: the heads need the embedding and "
            "the last layer in one stage; set model_overrides num_nextn_predict_layers: 0 or pp 1"
        )
    check_stage_layers(stage_layers, config.num_hidden_layers)
    if lay.pp > config.num_hidden_layers:
        raise ConfigError(
            f"pipeline_parallel_degree {lay.pp} is more than the model's {config.num_hidden_layers} "
            "layers (num_hidden_layers); lower it"
        )
