"""The planner under fine_tuning: LoRA: the modules and adapters it counts from a model config are
the ones a built model has (erniekit train's own model builder), and only the adapters take
gradients, optimizer state, gradient traffic and weight-gradient FLOPs."""

import dataclasses

import pytest

from erniekit.config import checks, load_config
from erniekit.distributed import lora_cost as LC
from erniekit.distributed import planner as P
from erniekit.errors import ConfigError

# no heap term (device: gpu), free memory traffic: the parts below are the formulas' alone
CLUSTER = P.Cluster(devices_per_node=2, device_flops=1e12, device_memory=8e9, memory_bandwidth=1e21, device="gpu")
ONE = P.Plan(1, 1, 1, 1, 0, "none", 2, 1)
S = 16


def _cfg(*args: str):
    return checks.normalise(load_config(None, [f"max_seq_len={S}", "per_device_train_batch_size=2", *args]))


def _built(cfg):
    """The model `erniekit train` builds for cfg (adapters applied for LoRA)."""
    from erniekit.train.run import load_model

    return load_model(cfg)


def _modules_of(model) -> list[tuple[str, tuple]]:
    import paddle.nn as nn

    from erniekit.nn.moe import StackedExperts

    out = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, nn.Linear):
            out.append((name, tuple(layer.weight.shape)))
        elif isinstance(layer, StackedExperts):
            out.append((name, tuple(tuple(getattr(layer, p).shape) for p in ("gate_proj", "up_proj", "down_proj"))))
    return out


@pytest.mark.parametrize(
    "args",
    [
        ["model_name_or_path=tiny-dense"],
        ["model_name_or_path=tiny-vl"],
        [
            "model_name_or_path=tiny-moe",
            "model_overrides.tie_word_embeddings=false",
            "model_overrides.num_nextn_predict_layers=2",
        ],
    ],
)
def test_the_modules_listed_from_the_config_are_the_built_models(args):
    """Names and shapes of every Linear and routed-experts stack, in the model's order: the head
    when untied, the MTP blocks, the vision transformer and resampler included."""
    cfg = _cfg(*args)
    listed = [
        (m.name, tuple((m.experts, i, o) for _, i, o in m.projs) if m.experts else m.projs[0][1:])
        for m in LC.model_modules(P.model_config_of(cfg))
    ]
    assert listed == _modules_of(_built(cfg))


@pytest.mark.parametrize(
    "args",
    [
        ["model_name_or_path=tiny-dense"],  # the default targets
        ["model_name_or_path=tiny-dense", "lora_target_modules=.*\\.(q_proj|v_proj)", "lora_rank=4"],
        ["model_name_or_path=tiny-moe", "lora_rank=16"],  # routed experts split over ep
        # per-expert names select a routed projection; shared experts; DoRA's magnitude vectors
        ["model_name_or_path=tiny-moe", "lora_target_modules=.*experts\\.\\d+\\.down_proj|.*shared.*", "use_dora=true"],
        ["model_name_or_path=tiny-vl", "lora_target_modules=.*\\.(qkv|o_proj)|.*experts_1"],  # vision, 2nd group
    ],
)
def test_the_trainable_parameters_the_planner_assumes_are_the_built_lora_models(args):
    cfg = _cfg("fine_tuning=LoRA", *args)
    model = _built(cfg)
    trainable = sum(int(p.numel()) for p in model.parameters() if not p.stop_gradient)
    total = sum(int(p.numel()) for p in model.parameters())
    pred = P.predict(P.model_config_of(cfg), CLUSTER, P.workload_from_config(cfg, 1, "gpu"), ONE)
    assert 0 < trainable < total / 2
    assert pred.parts["trainable_params"] == trainable
    assert pred.parts["grads_bytes"] == 4 * trainable and pred.parts["moments_bytes"] == 8 * trainable


def test_targets_that_apply_lora_refuses_are_refused_by_the_planner_too():
    for args, words in (
        (["lora_target_modules=.*nothing_here"], "pattern '.*nothing_here' matches no module"),
        (["lora_target_modules=.*experts\\.[0-3]\\.down_proj"], "select only some experts of model.layers.1.mlp"),
    ):
        cfg = _cfg("model_name_or_path=tiny-moe", "fine_tuning=LoRA", *args)
        with pytest.raises(ConfigError, match=words[:20]):  # apply_lora's own refusal
            _built(cfg)
        with pytest.raises(ConfigError, match=words) as e:
            P.workload_from_config(cfg, 1)
        assert "\n" not in str(e.value) and "lora_target_modules" in str(e.value)


def test_a_target_pattern_that_is_no_regex_is_one_line_before_planning_or_training():
    """`erniekit plan` and `parallel: auto` printed re.error's traceback (the config check let it through)."""
    raw = ["model_name_or_path=tiny-moe", "fine_tuning=LoRA", "lora_target_modules=(q_proj"]
    with pytest.raises(ConfigError) as e:
        checks.check_values(checks.normalise(load_config(None, raw)))  # what `erniekit plan` checks first
    assert str(e.value).startswith("lora_target_modules: pattern '(q_proj' is not a valid regex (missing )")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="lora_target_modules: pattern '.q_proj' is not a valid regex"):
        P.workload_from_config(load_config(None, raw), 1)  # the planner's own matcher, on a config as loaded
    # a global flag compiles alone but not inside the group adapter_config.json's target regex puts it in
    # (a traceback at the adapter's save, after training)
    flagged = ["model_name_or_path=tiny-moe", "fine_tuning=LoRA", r"lora_target_modules=(?i)model\.layers\.0\..*"]
    with pytest.raises(ConfigError, match=r"cannot be combined with others .* \(\?i:q_proj\)"):
        checks.check_values(checks.normalise(load_config(None, flagged)))


def _full_and_lora(*args: str, plan: P.Plan = ONE, cluster: P.Cluster = CLUSTER):
    """Predictions for the same config trained Full and LoRA, and the adapters' parameter count."""
    out = []
    for ft in ("Full", "LoRA"):
        cfg = _cfg(f"fine_tuning={ft}", *args)
        work = P.workload_from_config(cfg, plan.dp * plan.tp * plan.pp, cluster.device)
        out.append(P.predict(P.model_config_of(cfg), cluster, work, plan))
    return out[0], out[1], out[1].parts["trainable_params"]


def test_lora_memory_is_the_full_fine_tunes_less_the_frozen_bases_gradients_and_moments():
    """Untied tiny-dense, one device: LoRA holds the base and the adapters, gradients and AdamW's two
    moments for the adapters only, and its layers keep x A ([r]) per adapted module and token. (Untied
    and without accumulation, the full fine-tune has no embedding-gradient working set to lose.)"""
    untied = ("model_name_or_path=tiny-dense", "model_overrides.tie_word_embeddings=false")
    full, lora, T = _full_and_lora(*untied)
    P_ = full.parts["trainable_params"]
    assert T == 8 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 384)) * 4  # r (in + out): 7 modules x 4 layers
    assert lora.parts["params_bytes"] == 4 * (P_ + T)
    assert full.parts["grads_bytes"] - lora.parts["grads_bytes"] == 4 * (P_ - T)
    assert full.parts["moments_bytes"] - lora.parts["moments_bytes"] == 8 * (P_ - T)
    # r floats x 7 modules x tokens, kept by the 4 layers and again in one layer's backward working set
    adapter_activations = 4 * 8 * 7 * ONE.micro_batch * S * (4 + 1)
    assert full.memory - lora.memory == pytest.approx(12 * (P_ - T) - 4 * T - adapter_activations, rel=1e-12)
    assert lora.memory < full.memory


def test_adapter_dropout_keeps_each_adapted_inputs_dropped_copy_and_mask():
    """lora_dropout > 0: matmul(dropout(x), A) keeps the dropped copy of x (float32) and dropout's
    uint8 mask: 1.25 x fan_in floats per adapted module and token, in every layer."""
    acts = {}
    for p in ("0.0", "0.1"):
        cfg = _cfg("model_name_or_path=tiny-dense", "fine_tuning=LoRA", f"lora_dropout={p}")
        pred = P.predict(P.model_config_of(cfg), CLUSTER, P.workload_from_config(cfg, 1, "gpu"), ONE)
        acts[p] = pred.parts["activations_bytes"]
    fan_in = 4 * 128 + 2 * 128 + 384  # q, k, v, o; gate, up; down
    assert acts["0.1"] - acts["0.0"] == pytest.approx(4 * 1.25 * fan_in * 4 * ONE.micro_batch * S)


def test_lora_replicas_sum_and_zero_shard_the_adapters_only():
    dp2 = P.Plan(2, 1, 1, 1, 0, "none", 2, 1)
    full, lora, T = _full_and_lora("model_name_or_path=tiny-dense", plan=dp2)
    assert 0 < T < full.parts["trainable_params"] / 10
    # one all-reduce of the adapters' gradients: 2(n-1)/n x 4T bytes
    assert lora.parts["comm_bytes"] == 4 * T and full.parts["comm_bytes"] == full.parts["grads_bytes"]
    assert lora.parts["sum_buffer_bytes"] == 2 * 4 * T  # GPU: Paddle's concat and split of the gradients
    zero1 = dataclasses.replace(dp2, sharding_stage=1)
    _, lora1, _ = _full_and_lora("model_name_or_path=tiny-dense", plan=zero1)
    assert lora1.parts["moments_bytes"] == 8 * T / 2 and lora1.parts["grads_bytes"] == 4 * T


def test_lora_skips_the_frozen_weights_gradient_flops():
    """Frozen GEMMs: forward + input gradient (2 x forward) instead of 3 x; the adapters' two small
    GEMMs train in full. With free op launches and memory traffic the compute is FLOPs alone."""
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30)
    full, lora, T = _full_and_lora("model_name_or_path=tiny-dense", cluster=free)
    H, q, kv, inter, L, V = 128, 128, 64, 384, 4, 1024
    weights = 2 * (L * (H * (q + 2 * kv) + q * H + 3 * H * inter) + H * V)  # forward FLOPs per token
    adapters = 2 * T  # forward FLOPs per token of x A and (x A) B: 2 r (in + out) per module
    tokens = ONE.micro_batch * S
    skipped = (weights - 3 * adapters) * tokens / free.device_flops
    assert full.parts["compute_s"] - lora.parts["compute_s"] == pytest.approx(skipped, rel=1e-9)


def test_lora_is_read_from_the_config_in_any_spelling_and_full_trains_everything():
    raw = load_config(None, ["model_name_or_path=tiny-dense", "fine_tuning=lora", "lora_rank=4"])
    work = P.workload_from_config(raw, 1)  # `erniekit plan` passes the config as loaded
    assert work.lora is not None and work.lora.rank == 4 and work.lora.params == 4 * 4 * (2 * 256 + 2 * 192 + 3 * 512)
    assert P.workload_from_config(load_config(None, ["model_name_or_path=tiny-dense"]), 1).lora is None


def test_planning_a_lora_config_imports_no_paddle():
    """`erniekit plan` answers without importing Paddle (seconds saved on every call): the target
    matching it shares with apply_lora lives in erniekit/nn/lora_targets.py, which needs no Paddle."""
    import subprocess
    import sys

    code = (
        "import sys; from erniekit.distributed import planner as P; from erniekit.distributed.lora_cost import "
        "count_adapters; from erniekit.models.ernie4_5.configuration import get_preset; c = get_preset('tiny-moe'); "
        "P.predict(c, P.Cluster(), P.Workload(2, 16, lora=count_adapters(c, 8)), P.Plan(1, 1, 1, 1, 0, 'none', 2, 1)); "
        "print('paddle' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_an_expert_parallel_rank_launches_the_adapters_of_its_own_experts_only():
    """LoraStackedExperts loops over the experts that got rows: under ep a rank's E / ep. Counting all
    E made LoRA look slower than a full fine-tune of ERNIE-4.5-21B-A3B at ep=8."""
    from erniekit.models.ernie4_5.configuration import get_preset

    c = get_preset("tiny-moe")
    lora = LC.count_adapters(c, 8, [r".*mlp\.experts"])
    moe = [i for i, a in enumerate(lora.layers) if a.expert_ops]
    assert moe and all(lora.layers[i].expert_ops == 3 * 3 * c.moe_num_experts for i in moe)  # 3 projections
    base = P.layer_costs(c)
    for ep in (1, 2, 4):
        added = [a.ops - b.ops for a, b in zip(P._with_adapters(base, lora, ep), base)]
        assert [added[i] for i in moe] == [3 * 5 + 9 * c.moe_num_experts / ep for _ in moe]
        again = sum(a.mlp_ops for a in lora.layers) + sum(a.expert_ops for a in lora.layers) / ep
        assert P._adapter_ops_again(lora, "mlp", ep) == again  # a recomputed MLP launches them again
