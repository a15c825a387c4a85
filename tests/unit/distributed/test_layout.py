"""Parallel layout from config degrees: resolution, mesh coordinates and the one-line errors that
must come before any process starts (erniekit/distributed/collective/layout.py)."""

from __future__ import annotations

import dataclasses

import pytest

from erniekit.config import TrainConfig, validate
from erniekit.distributed.collective.layout import Layout, check_model_fits, layout_from_config
from erniekit.errors import ConfigError
from erniekit.models.ernie4_5.configuration import get_preset


def cfg(**kw) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **kw)


@pytest.mark.parametrize(
    "kw, world, want",
    [
        ({}, 1, Layout()),
        ({}, 4, Layout(dp=4)),
        ({"tensor_parallel_degree": 2}, 4, Layout(dp=2, tp=2)),
        ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 8, Layout(pp=2, dp=2, tp=2)),
        ({"sharding": "stage1"}, 4, Layout(sharding=4, sharding_stage=1)),  # dp -1: every data rank shards
        ({"sharding": "stage2", "sharding_parallel_degree": 2}, 4, Layout(dp=2, sharding=2, sharding_stage=2)),
        ({"expert_parallel_degree": 2}, 2, Layout(dp=2, ep=2)),
    ],
)
def test_degrees_resolve_to_a_layout(kw, world, want):
    lay = layout_from_config(cfg(**kw), world)
    assert lay == want and lay.world == world


def test_rank_coordinates_are_row_major_with_tp_innermost():
    lay = Layout(pp=2, dp=2, tp=2)
    assert [lay.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [lay.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [lay.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4


@pytest.mark.parametrize(
    "kw, world, match",
    [
        ({"data_parallel_degree": 2, "tensor_parallel_degree": 2}, 2, r"= 4, but the job has 2 processes"),
        ({"tensor_parallel_degree": 3}, 4, r"= 3 does not divide the 4 processes"),
        ({"sharding_parallel_degree": 2, "data_parallel_degree": 1}, 2, "needs sharding: stage1"),
        ({"expert_parallel_degree": 4, "tensor_parallel_degree": 2}, 4, r"must equal .* = 2"),
        ({"expert_parallel_degree": 2}, 4, r"must equal .* = 4 \(the experts are split over all the data ranks\)"),
    ],
)
def test_degrees_that_do_not_fit_the_processes_are_one_line_errors(kw, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        layout_from_config(cfg(**kw), world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "lay, model, match",
    [
        (Layout(tp=3), "tiny-moe", "tensor_parallel_degree 3 does not divide the model's num_attention_heads 4"),
        (Layout(tp=4), "tiny-moe", "num_key_value_heads 2"),
        (Layout(dp=3, ep=3), "tiny-moe", "expert_parallel_degree 3 does not divide the 8 experts"),
        (Layout(dp=2, ep=2), "tiny-dense", "the model is dense"),
        (Layout(pp=8), "tiny-moe", "more than the model's 4 layers"),
    ],
)
def test_degrees_that_do_not_split_the_model_are_one_line_errors(lay, model, match):
    with pytest.raises(ConfigError, match=match):
        check_model_fits(lay, get_preset(model))


def test_model_that_splits_evenly_passes():
    check_model_fits(Layout(dp=2, ep=2), get_preset("tiny-moe"))
    check_model_fits(Layout(dp=2, tp=2), get_preset("tiny-dense"))


def test_tensor_parallel_moe_is_accepted():
    check_model_fits(Layout(tp=2), get_preset("tiny-moe"))  # the experts' width 128 splits in two


def test_fp8_blocks_must_tile_each_tp_ranks_slice_of_the_experts():
    moe = get_preset("tiny-moe")  # moe_intermediate_size 128: 64 per rank at tp=2
    check_model_fits(Layout(tp=2), moe, fp8_block=64)
    check_model_fits(Layout(dp=2), moe, fp8_block=128)  # no tp: the whole width
    with pytest.raises(ConfigError, match=r"fp8_block_size 128 does not divide .* = 64 .* e\.g\. 64"):
        check_model_fits(Layout(tp=2), moe, fp8_block=128)


def test_config_validation_of_launch_keys():
    assert validate(cfg(nproc_per_node=2)).nproc_per_node == 2  # multi-process runs are accepted
    assert validate(cfg(nproc_per_node=2, pipeline_parallel_degree=2)).pipeline_parallel_degree == 2
    assert validate(cfg(nproc_per_node=2, fp8=True)).fp8  # replicated experts run on local tensors
    assert validate(cfg(nproc_per_node=2, tensor_parallel_degree=2, fp8=True)).fp8
    assert validate(cfg(nproc_per_node=2, pipeline_parallel_degree=2, fp8=True)).fp8  # stages hold plain tensors
    assert validate(cfg(nproc_per_node=2, expert_parallel_degree=2, fp8=True)).fp8  # expert slices are local
    with pytest.raises(ConfigError, match="sharding=stage3 needs reduce-scatter"):
        validate(cfg(nproc_per_node=2, sharding="stage3"))
    with pytest.raises(ConfigError, match="LoRA with tensor_parallel_degree=2: .* CReduceScatterOp"):
        validate(cfg(nproc_per_node=2, tensor_parallel_degree=2, fine_tuning="LoRA"))
    elastic = {"elastic_sandwich": True, "elastic_top_k": [1, 2], "fp8": False}
    with pytest.raises(ConfigError, match="elastic_sandwich with tensor_parallel_degree=2: .* soft-label"):
        validate(cfg(nproc_per_node=2, tensor_parallel_degree=2, **elastic))
    assert validate(cfg(nproc_per_node=2, expert_parallel_degree=2, **elastic)).elastic_sandwich
    with pytest.raises(ConfigError, match="max_restart=-1 is invalid"):
        validate(cfg(max_restart=-1))
    with pytest.raises(ConfigError, match="nnodes=2 needs master=HOST:PORT"):
        validate(cfg(nnodes=2))
    with pytest.raises(ConfigError, match="tensor_parallel_degree=0 is invalid"):
        validate(cfg(tensor_parallel_degree=0))
    assert validate(cfg(sharding="STAGE1")).sharding == "stage1"  # a mesh of one: sharding is a no-op


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tensor_parallel_degree": 2}, "combines with data parallelism only"),
        ({"sharding": "stage1"}, "combines with data parallelism only"),
        ({"stage": "DPO"}, "runs the Distill, pretrain and SFT stages, not stage=DPO"),
        ({"elastic_depth": [2, 4]}, "does not train elastic sub-models"),
        (
            {"do_eval": True, "eval_dataset_path": "examples/data/arithmetic/eval.jsonl"},
            "evaluates the held-out loss only",
        ),
    ],
)
def test_what_the_pipeline_does_not_run_is_a_one_line_error(kw, match):
    world = 4 if kw.get("tensor_parallel_degree") or kw.get("sharding") else 2
    with pytest.raises(ConfigError, match=f"pipeline_parallel_degree=2 {match}"):
        validate(cfg(nproc_per_node=world, pipeline_parallel_degree=2, **kw))


def test_pipeline_model_checks():
    check_model_fits(Layout(pp=2), get_preset("tiny-moe"))  # MoE alone in a pipeline: exact (tested)
    check_model_fits(Layout(pp=2, dp=2), get_preset("tiny-dense"))
    check_model_fits(Layout(pp=2, dp=2), get_preset("tiny-moe"))  # router statistics summed over dp
    with pytest.raises(ConfigError, match="with MTP heads"):
        check_model_fits(Layout(pp=2), get_preset("tiny-dense").replace(num_nextn_predict_layers=1))


def test_mesh_has_the_layout_shape_and_named_dims():
    mesh = Layout(dp=2, tp=2).mesh()
    assert mesh.shape == [1, 2, 1, 2] and mesh.dim_names == ["pp", "dp", "sharding", "tp"]
    assert mesh.process_ids == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "lay, whole",
    [
        (Layout(dp=2), True),
        (Layout(dp=4), True),
        (Layout(), False),  # one process: nothing to replicate
        (Layout(dp=2, tp=2), False),
        (Layout(pp=2, dp=2), False),
        (Layout(dp=2, ep=2), False),
        (Layout(sharding=2, sharding_stage=1), False),
    ],
)
def test_only_a_job_that_only_splits_the_batch_runs_whole_model_replicas(lay, whole):
    assert lay.data_only is whole


def test_picture_stages_take_synthetic_datasets_and_every_parallelism_but_pipeline_and_stage3(tmp_path):
    """VL-SFT runs with data, tensor and expert parallelism and sharding stage1/2 (each checked
    against one process in tests/e2e/test_vl_sft.py); pipeline and stage3 are refused, and so is a
    capacity limit wherever the tokens are DistTensors (only plain data replicas apply one)."""
    vl = dict(stage="vl_sft", model_name_or_path="tiny-vl", output_dir=str(tmp_path))
    vl |= dict(train_dataset_path="synthetic:shapes/train?n=8", eval_dataset_path=None)
    for layout in (
        {},  # plain data parallelism
        {"expert_parallel_degree": 2},
        {"tensor_parallel_degree": 2},
        {"sharding": "stage1"},
        {"sharding": "stage2"},
        {"nproc_per_node": 4, "tensor_parallel_degree": 2, "expert_parallel_degree": 2},
    ):
        assert validate(cfg(**vl, **{"nproc_per_node": 2, **layout})).stage == "VL-SFT", layout
    capped = {"model_overrides": {"moe_capacity_factor": 1.5}}
    assert validate(cfg(**vl, nproc_per_node=2, **capped)).stage == "VL-SFT"  # replicas apply it
    for layout, why in (
        ({"pipeline_parallel_degree": 2}, "VL-SFT does not run with pipeline parallelism"),
        ({"sharding": "stage3"}, "sharding=stage3: stage VL-SFT runs with sharding=stage1 or stage2"),
        ({"expert_parallel_degree": 2, **capped}, "moe_capacity_factor: stage VL-SFT on dp=2 ep=2 has no capacity"),
        ({"tensor_parallel_degree": 2, **capped}, "moe_capacity_factor: stage VL-SFT on tp=2 has no capacity"),
        ({"sharding": "stage1", **capped}, "moe_capacity_factor: stage VL-SFT on sharding=2 sharding stage1"),
    ):
        with pytest.raises(ConfigError, match=why):
            validate(cfg(**vl, nproc_per_node=2, **layout))
    with pytest.raises(ConfigError, match="synthetic picture dataset; it trains with stage: VL-SFT"):
        validate(cfg(train_dataset_path="synthetic:shapes/train", output_dir=str(tmp_path)))
