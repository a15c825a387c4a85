"""The planner's activation count over tensor parallelism: what a tp rank keeps whole and what it
keeps a 1/tp slice of, for the attention block, the dense MLP, the recompute modes and the LoRA
adapters, as measured at tp=2 by tools/measure_saved_activations.py (docs/planner.md, "Attention and
dense MLP whole over tp: what moved"); and the cross-cluster plan's header naming the router biases a
local sync averages."""

import dataclasses
import os
from pathlib import Path

import pytest

from erniekit.cli import main
from erniekit.distributed import lora_cost as LC
from erniekit.distributed import planner as P
from erniekit.models.ernie4_5 import get_preset

ROOT = str(Path(__file__).resolve().parents[3])
# GPU: flash attention keeps no [S, S] probabilities and no heap term is added
CLUSTER = P.Cluster(devices_per_node=2, device_flops=1e12, device_memory=8e9, memory_bandwidth=1e21, device="gpu")
WORK = P.Workload(global_batch=4, seq_len=64, fused_attention=True)


def _dense_shapes():
    c = get_preset("tiny-dense")
    H, q, kv, I = 128, 128, 64, 384
    assert (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim) == (H, q, kv)
    assert c.intermediate_size == I and not c.is_moe
    return c, H, q, kv, I


def _per_token(c, work, tp: int, recompute: str = "none") -> float:
    p = P.Plan(1, tp, 1, 1, 0, recompute, 4, 1)
    return P.predict(c, CLUSTER, work, p).parts["activations_bytes"] / (4 * 4 * work.seq_len)


def test_a_tp_rank_keeps_the_attention_and_dense_mlp_tensors_of_width_h_whole():
    """Measured at tp=2 (2 processes, runtime.py's placements): each rank keeps the H-wide tensors
    whole (the block's input, the norm's normalized input and output); the attention's q- and kv-wide
    ones (3q + 3kv: rope's cos and sin broadcast, not expanded to the replicated global shape) and the
    dense MLP's I-wide activations (4I) are split. tp=1 is the count it always was."""
    c, H, q, kv, I = _dense_shapes()
    L = c.num_hidden_layers
    assert _per_token(c, WORK, 1) == pytest.approx(L * ((2 * H + 3 * q + 3 * kv + H) + (2 * H + 4 * I) + 2 * H))
    attn = 3 * H + 3 * (q + kv) / 2
    mlp = 2 * H + 4 * I / 2
    assert _per_token(c, WORK, 2) == pytest.approx(L * (attn + mlp + 2 * H), rel=1e-12)


def test_the_recompute_modes_keep_the_whole_parts_whole_and_the_core_inputs_split():
    """core_attn keeps the core's inputs q, k, v (3H in the count), split with the heads (measured:
    the layer under core_attn keeps at tp=2 what it keeps without recompute less the probabilities,
    as at tp=1); full_attn / mlp keep the other block's share and the recomputed block's input whole."""
    c, H, q, kv, I = _dense_shapes()
    L = c.num_hidden_layers
    attn = 3 * H + 3 * (q + kv) / 2
    mlp, other = 2 * H + 4 * I / 2, 2 * H
    expected = {
        "core_attn": attn + 3 * H / 2 + mlp + other,
        "full_attn": H + mlp + other,
        "mlp": attn + H + other,
        "full": H,
    }
    for mode, per_layer in expected.items():
        assert _per_token(c, WORK, 2, mode) == pytest.approx(L * per_layer, rel=1e-12), mode
    one = {"core_attn": 2 * H + 3 * q + 3 * kv + H + 3 * H + 2 * H + 4 * I + other}
    assert _per_token(c, WORK, 1, "core_attn") == pytest.approx(L * one["core_attn"], rel=1e-12)


def test_the_backward_working_set_takes_one_layers_whole_parts_whole():
    """The transient of one layer's backward (`biggest_layer`) is a tp rank's share too."""
    c, H, q, kv, I = _dense_shapes()
    work = dataclasses.replace(WORK, global_batch=8, seq_len=2048)  # one layer's working set above the embedding's
    p = P.Plan(1, 2, 1, 1, 0, "none", 8, 1)
    r = P.predict(c, CLUSTER, work, p)
    layer = 3 * H + 3 * (q + kv) / 2 + 2 * H + 4 * I / 2
    assert 4 * layer * 8 * 2048 > 4 * c.vocab_size * H / 2
    expected = r.parts["activations_bytes"] + 4 * layer * 8 * 2048
    parts = ("params_bytes", "grads_bytes", "moments_bytes", "logits_bytes", "sum_buffer_bytes", "upcast_buffer_bytes")
    assert r.memory - CLUSTER.memory_overhead - sum(r.parts[k] for k in parts) == pytest.approx(expected, rel=1e-12)


def _adapters(c, **kw):
    return LC.count_adapters(c, 8, [".*_proj"], **kw)


def test_lora_adapters_keep_whole_what_meets_a_replicated_input_or_a_partial_sum():
    """Per adapted projection and token: x A [r] split beside a column-parallel Linear (A split by its
    columns: measured), whole beside a row-parallel one (a partial sum [T, r], kept as given before
    the reshard); the dropped copy of the input and its mask whole where the input is (column:
    measured); DoRA's pre-scale output whole where the output is a partial sum (row); a 16-bit base's
    cast input (GPU) whole where the input is."""
    c, H, q, kv, I = _dense_shapes()
    r = 8
    plain = _adapters(c).layers[0]
    assert (plain.attn_saved, plain.attn_saved_whole) == (4 * r, r)  # o_proj's x A
    assert (plain.mlp_saved, plain.mlp_saved_whole) == (3 * r, r)  # down's x A
    drop = _adapters(c, dropout=0.1).layers[0]
    assert drop.attn_saved == 4 * r + 1.25 * (3 * H + q)
    assert drop.attn_saved_whole == r + 1.25 * 3 * H  # q, k, v read the whole input; o_proj its slice
    assert drop.mlp_saved_whole == r + 1.25 * 2 * H
    dora = _adapters(c, dora=True).layers[0]
    assert dora.attn_saved_whole == r + H and dora.mlp_saved_whole == r + H  # o_proj's, down's [H]
    half = _adapters(c, base_dtype="bfloat16").layers[0]
    assert (half.attn_cast_saved, half.attn_cast_saved_whole) == (0.5 * (3 * H + q), 0.5 * 3 * H)
    assert (half.mlp_cast_saved, half.mlp_cast_saved_whole) == (0.5 * (2 * H + I), 0.5 * 2 * H)


def test_routed_expert_adapters_keep_x_a_whole_on_every_tp_rank():
    """Routed experts split by width run every rank's slice on the same rows: gate/up A is whole
    (x A whole), down's x A a partial sum [rows, r] (whole), gate/up's dropped input copy whole,
    down's DoRA pre-scale output and row scales ([H] each, partial sums) whole."""
    c = get_preset("tiny-moe")
    H, k, r, Ie = c.hidden_size, c.moe_k, 8, c.moe_intermediate_size
    Is = c.moe_num_shared_experts * c.expert_sizes[0]
    moe_layer = next(i for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    shared = r  # the shared experts' down (row-parallel) x A
    a = LC.count_adapters(c, r, [".*experts.*"]).layers[moe_layer]
    assert a.mlp_saved_whole == k * 3 * r + shared
    a = LC.count_adapters(c, r, [".*experts.*"], dropout=0.1).layers[moe_layer]
    assert a.mlp_saved_whole == k * (3 * r + 2 * 1.25 * H) + shared + 2 * 1.25 * H
    assert a.mlp_saved == k * (3 * r + 1.25 * (2 * H + Ie)) + 3 * r + 1.25 * (2 * H + Is)
    a = LC.count_adapters(c, r, [".*experts.*"], dora=True).layers[moe_layer]
    assert a.mlp_saved_whole == k * (3 * r + 2 * H) + shared + H


def test_the_planner_splits_only_the_adapters_split_part_over_tp():
    """A LoRA plan at tp=2 (GPU) keeps the adapters' whole part whole, on top of the base's."""
    c, H, q, kv, I = _dense_shapes()
    L = c.num_hidden_layers
    lora = _adapters(c, dropout=0.1)
    work = dataclasses.replace(WORK, lora=lora)
    a = lora.layers[0]
    base = 3 * H + 3 * (q + kv) / 2 + 2 * H + 4 * I / 2 + 2 * H
    adapters = a.attn_saved_whole + a.mlp_saved_whole
    adapters += (a.attn_saved - a.attn_saved_whole + a.mlp_saved - a.mlp_saved_whole) / 2
    assert _per_token(c, work, 2) == pytest.approx(L * (base + adapters), rel=1e-12)


def test_the_cross_cluster_header_names_the_router_biases_a_local_sync_averages(capsys):
    """moe_bias_update_rate > 0: the biases are not trained (not in the trainable count) but each
    site moves them, so a rank's local sync averages them too: the header says how many."""
    sites = os.path.join(ROOT, "examples/clusters/two_sites.yaml")
    base = ["plan", "--sites", sites, "model_name_or_path=tiny-moe", "per_device_train_batch_size=4", "max_seq_len=64"]
    assert main([*base, "cross_cluster_sync=local", "model_overrides.moe_bias_update_rate=0.01"]) in (0, 1)
    header = capsys.readouterr().out.splitlines()[0]
    assert "trainable parameters per rank (Full) + 24 router correction biases its local syncs average" in header
    assert main([*base, "cross_cluster_sync=local"]) in (0, 1)
    assert "router correction biases" not in capsys.readouterr().out.splitlines()[0]
