"""Routed experts split over tensor parallelism (erniekit/distributed/collective/local_experts.py,
runtime.py `expert_tp_dim`): 2 processes with tp=2 hold half of every expert's width and must give
the whole layer's output and gradients, the gate weights' (the router's) above all: a tp rank
left with its half of that gradient moved its router away from the other's after the first step."""

import json
import os
from pathlib import Path

import pytest
from launched_jobs import run_two_rank_script

from erniekit.distributed.collective.runtime import expert_tp_dim

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.parametrize(
    "name,dim",
    [
        ("model.layers.1.mlp.experts.gate_proj", 2),
        ("model.layers.1.mlp.experts.up_proj", 2),
        ("model.layers.1.mlp.experts.down_proj", 1),
        ("model.layers.1.mlp.experts.gate_proj_lora_A", None),
        ("model.layers.1.mlp.experts.up_proj_lora_B", 2),
        ("model.layers.1.mlp.experts.up_proj_lora_magnitude_vector", 1),
        ("model.layers.1.mlp.experts.down_proj_lora_A", 1),
        ("model.layers.1.mlp.experts.down_proj_lora_B", None),
        ("model.layers.1.mlp.experts.down_proj_lora_magnitude_vector", None),
    ],
)
def test_expert_tensors_split_as_the_dense_mlp_and_adapters_follow_their_base(name, dim):
    assert expert_tp_dim(name) == dim


def test_two_tensor_parallel_ranks_equal_the_whole_expert_layer(tmp_path):
    """Float32, LoRA, DoRA (whose down-projection column norms span both ranks) and FP8 experts,
    with and without capacity drops: every rank's output and gradients within 1e-5 of the whole
    layer's (relative to the largest value)."""
    run_two_rank_script(os.path.join(ROOT, "tests", "e2e", "tp_experts_worker.py"), tmp_path, ROOT)
    for rank in (0, 1):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        assert len(result) == 8
        for case, diffs in result.items():
            assert {"y", "x.grad", "weight.grad", "down_proj.grad"} <= set(diffs), case
            for name, d in diffs.items():
                assert d < 1e-5, f"rank {rank} {case} {name}: {d}"
