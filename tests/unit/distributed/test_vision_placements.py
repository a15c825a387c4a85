"""A VL model's vision transformer and resampler stay whole on every tensor-parallel rank
(erniekit/distributed/collective/runtime.py `whole_over_tp`), whatever their layers are named:
the text model's projection names split by substring, and a vision layer carrying one must not."""

import paddle
import pytest

from erniekit.distributed.collective.layout import Layout
from erniekit.distributed.collective.runtime import ParallelContext
from erniekit.distributed.lora_cost import linear_whole_over_tp


@pytest.mark.parametrize(
    "name, split",
    [
        ("model.layers.0.mlp.up_proj.weight", True),
        ("vision_model.blocks.0.mlp.up_proj.weight", False),
        ("vision_model.blocks.0.attn.q_proj.weight", False),
        ("resampler_model.spatial_linear.down_proj.weight", False),
        ("student.vision_model.blocks.0.attn.qkv_proj.weight", False),  # a wrapped model's names
        ("model.layers.0.mlp.vision_model_proj.up_proj.weight", True),  # a whole name part, not a substring
    ],
)
def test_vision_parameters_stay_whole_over_tp(name, split):
    ctx = ParallelContext(Layout(tp=2))
    placements = ctx.param_placements(name, paddle.zeros([64, 128]), is_expert=False)
    assert placements[-1].is_shard() is split, placements  # the tp dim is innermost
    # the planner's LoRA count (Paddle-free) places the same module's base the same way
    base_whole = linear_whole_over_tp(name.rsplit(".", 1)[0], 8, 64, 128, dora=False)[1]
    assert base_whole == (0 if split else 64 * 128)
