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
        # the base held in 16 bits: DoRA on routed experts and attention; vision, MTP blocks and a head
        ["model_name_or_path=tiny-moe", "use_dora=true", "lora_base_dtype=bfloat16"],
        ["model_name_or_path=tiny-vl", "lora_target_modules=.*\\.(qkv|fc1|q_proj|mlp)", "lora_base_dtype=float16"],
        [
            "model_name_or_path=tiny-dense",
            "model_overrides.num_nextn_predict_layers=1",
            "model_overrides.tie_word_embeddings=false",
            "lora_target_modules=.*(q_proj|down_proj|lm_head|linear_proj.*)",
            "use_dora=true",
            "lora_base_dtype=bfloat16",
        ],
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
    # the bytes held: the adapted base in lora_base_dtype, everything else as built (float32 here),
    # the MoE gates' e_score_correction_bias and the MTP blocks included
    assert pred.parts["params_bytes"] == _bytes(model)


@pytest.mark.parametrize(
    "args",
    [
        ["model_name_or_path=tiny-moe", "lora_rank=16"],  # the default targets: attention, MLPs, experts
        # routed experts (gate/up: B and the magnitude split; down: A split), shared experts, o_proj's
        # magnitude (whole: one dim of a row-parallel Linear)
        [
            "model_name_or_path=tiny-moe",
            "lora_target_modules=.*experts|.*shared.*|.*o_proj",
            "use_dora=true",
            "lora_base_dtype=bfloat16",
        ],
        ["model_name_or_path=tiny-vl", "lora_target_modules=.*\\.(qkv|o_proj|fc1|mlp)|.*experts_1"],  # vision: whole
        [  # the MTP input projection (whole), an untied head (its magnitude whole)
            "model_name_or_path=tiny-dense",
            "model_overrides.num_nextn_predict_layers=1",
            "model_overrides.tie_word_embeddings=false",
            "lora_target_modules=.*(q_proj|down_proj|lm_head|linear_proj.*)",
            "use_dora=true",
            "lora_base_dtype=bfloat16",
        ],
    ],
)
def test_a_tp_ranks_share_of_base_and_adapters_is_what_the_runtime_places_on_it(args):
    """At tp=2 (with ep=2 on MoE) each rank holds and trains what runtime.py's placements leave it:
    the adapters follow their base over tp, routed experts' split by width (lora_cost.py)."""
    from rank_shares import local_bytes, local_elements

    from erniekit.distributed.collective.layout import Layout

    cfg = _cfg("fine_tuning=LoRA", *args)
    model, c = _built(cfg), P.model_config_of(cfg)
    ep = 2 if c.is_moe else 1
    for lay, plan in (
        (Layout(tp=2), P.Plan(1, 2, 1, 1, 0, "none", 2, 1)),
        (Layout(dp=2, tp=2, ep=ep), P.Plan(2, 2, 1, ep, 0, "none", 2, 1)),
    ):
        pred = P.predict(c, CLUSTER, P.workload_from_config(cfg, plan.dp * plan.tp, "gpu"), plan)
        assert pred.parts["trainable_params"] == local_elements(model, lay)[1], lay
        assert pred.parts["params_bytes"] == local_bytes(model, lay), lay  # the adapted base in its dtype


def test_tp_ranks_run_the_whole_expert_adapter_tensors_in_full_and_sum_their_gradients():
    """Of a routed projection's adapter, gate/up A and down B are whole on every tp rank: each rank
    multiplies them in full (forward, both backward GEMMs), the rest of the model's GEMMs are halved
    at tp=2; a hook all-reduces their gradients over tp, one call per tensor, each micro-batch."""
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30, intra_node_latency_s=1e-4)
    pred = {}
    for ft in ("Full", "LoRA"):
        cfg = _cfg(f"fine_tuning={ft}", "model_name_or_path=tiny-moe", "lora_target_modules=.*experts")
        work = P.workload_from_config(cfg, 1, "gpu")  # one global batch for both layouts
        for tp in (1, 2):
            pred[ft, tp] = P.predict(P.model_config_of(cfg), free, work, P.Plan(1, tp, 1, 1, 0, "none", 2, 1))
    E, k, r, H, moe, tokens = 8, 2, 8, 128, 3, 2 * S
    whole_flops = 3 * moe * 2 * k * r * 3 * H * tokens  # 3 passes, 2 FLOPs a weight, gate A, up A, down B
    one, two = pred["LoRA", 1].parts["compute_s"], pred["LoRA", 2].parts["compute_s"]
    assert two == pytest.approx((one + whole_flops / free.device_flops) / 2, rel=1e-12)
    whole = 4 * moe * E * r * 3 * H  # bytes of the whole tensors' gradients
    hooks = 3 * moe * 1e-4 + whole / free.intra_node_bandwidth  # ring of 2: the buffer once
    added = pred["LoRA", 2].parts["comm_tp_s"] - pred["Full", 2].parts["comm_tp_s"]
    assert added == pytest.approx(hooks, rel=1e-12)


def _bytes(model) -> int:
    return sum(int(p.numel()) * p.element_size() for p in model.parameters())


def _upcast_buffer_grown(model, monkeypatch) -> int:
    """float32 elements of the buffer erniekit/nn/lora.py `_upcast` grows over one forward and
    backward of `model` (started empty: other tests' calls in this process grew theirs)."""
    import threading

    import paddle

    from erniekit.nn import lora

    monkeypatch.setattr(lora, "_scratch", threading.local())
    ids = paddle.randint(0, model.config.vocab_size, [2, S])
    model(ids).logits.sum().backward()
    return lora._scratch.buf.size


def test_a_16_bit_base_is_counted_as_held_and_upcast_into_one_buffer_on_the_cpu(monkeypatch):
    """lora_base_dtype: the adapted base weights take 2 bytes, everything else 4. Paddle's CPU build
    has no bf16 matmul: each adapted GEMM upcasts its weight, in the forward and again in the
    backward, into one float32 buffer reused by every call (erniekit/nn/lora.py `_UpcastMatmul`,
    `_upcast`): the largest adapted weight's, once per rank; nothing kept per micro-batch, so no
    activations and no heap holes more than a float32 base. On a GPU the activations are cast
    instead: half of each input kept."""
    cfgs = {
        bd: _cfg("model_name_or_path=tiny-dense", "fine_tuning=LoRA", *bd) for bd in ((), ("lora_base_dtype=bfloat16",))
    }
    model = _built(cfgs[("lora_base_dtype=bfloat16",)])
    half = sum(int(p.numel()) for p in model.parameters() if str(p.dtype).endswith("bfloat16"))
    assert half == 4 * (128 * (128 + 64 + 64) + 128 * 128 + 3 * 128 * 384)  # q, k, v, o; gate, up, down
    largest = 128 * 384  # gate, up [128, 384]; down [384, 128]
    assert _upcast_buffer_grown(model, monkeypatch) == largest  # what the runtime holds
    preds = {}
    for device in ("cpu", "gpu"):
        cluster = dataclasses.replace(CLUSTER, device=device)
        for bd, cfg in cfgs.items():
            for plan in (ONE, dataclasses.replace(ONE, accumulation=2)):
                work = P.workload_from_config(cfg, 1, device)
                preds[device, bd, plan.accumulation] = P.predict(P.model_config_of(cfg), cluster, work, plan)
    for device in ("cpu", "gpu"):
        f32, b16 = preds[device, (), 1].parts, preds[device, ("lora_base_dtype=bfloat16",), 1].parts
        assert f32["params_bytes"] - b16["params_bytes"] == 2 * half
        assert f32["trainable_params"] == b16["trainable_params"]
    for m in (1, 2):  # the buffer once, whatever the micro-batches
        f32, b16 = preds["cpu", (), m], preds["cpu", ("lora_base_dtype=bfloat16",), m]
        assert b16.parts["upcast_buffer_bytes"] == 4 * largest and f32.parts["upcast_buffer_bytes"] == 0
        for part in ("activations_bytes", "heap_slack_bytes", "logits_bytes"):
            assert b16.parts[part] == f32.parts[part], part
        assert b16.memory - f32.memory == pytest.approx(4 * largest - 2 * half, rel=1e-12)
    gpu = [preds["gpu", bd, 1].parts for bd in cfgs]
    assert gpu[1]["upcast_buffer_bytes"] == 0
    fan_in = 4 * 128 + 2 * 128 + 384  # q, k, v, o; gate, up; down
    cast = 4 * 0.5 * fan_in * 4 * ONE.micro_batch * S  # float32 bytes: half the input, 4 layers
    assert gpu[1]["activations_bytes"] - gpu[0]["activations_bytes"] == pytest.approx(cast, rel=1e-12)


def test_the_upcast_buffer_is_one_routed_experts_weight_over_tp(monkeypatch):
    """Routed experts go through _UpcastMatmul one expert at a time (by index into the stacked
    weight): the buffer is one expert's [in, out], split over tp by width (runtime.py), whatever ep."""
    routed = ("model_name_or_path=tiny-moe", "fine_tuning=LoRA", r"lora_target_modules=.*mlp\.experts")
    cfg, bf16 = _cfg(*routed), _cfg(*routed, "lora_base_dtype=bfloat16")
    expert = 128 * 128  # hidden x moe_intermediate_size
    assert _upcast_buffer_grown(_built(bf16), monkeypatch) == expert
    cpu = dataclasses.replace(CLUSTER, device="cpu")
    c = P.model_config_of(cfg)
    for tp, ep in ((1, 1), (1, 2), (2, 1), (2, 2)):
        plan = P.Plan(1, tp, 1, ep, 0, "none", 2, 1)
        work = P.workload_from_config(bf16, tp * ep, "cpu")
        assert P.predict(c, cpu, work, plan).parts["upcast_buffer_bytes"] == 4 * expert / tp, (tp, ep)
        work = P.workload_from_config(cfg, tp * ep, "cpu")
        assert P.predict(c, cpu, work, plan).parts["upcast_buffer_bytes"] == 0


@pytest.mark.parametrize("m", [1, 2])
def test_a_16_bit_bases_casts_run_in_forward_and_backward_and_again_in_recomputed_parts(m):
    """The CPU's upcast traffic per micro-batch: each adapted weight read in 16 bits and written in
    float32 (6 bytes an element) twice, forward and backward, and a third time for the recomputed
    parts' weights (their forward runs again; core attention has none). With free op launches the
    compute differs from a float32 base's by that traffic alone."""
    cpu = dataclasses.replace(CLUSTER, device="cpu", op_overhead_s=0.0, memory_bandwidth=1e9)
    plans = {rc: dataclasses.replace(ONE, recompute=rc, accumulation=m) for rc in P.RECOMPUTE_MODES}
    compute = {}
    for bd in ("float32", "bfloat16"):
        cfg = _cfg("model_name_or_path=tiny-dense", "fine_tuning=LoRA", f"lora_base_dtype={bd}")
        work, c = P.workload_from_config(cfg, 1, "cpu"), P.model_config_of(cfg)
        compute[bd] = {rc: P.predict(c, cpu, work, plan).parts["compute_s"] for rc, plan in plans.items()}
    attn, mlp = 4 * (128 * (128 + 64 + 64) + 128 * 128), 4 * 3 * 128 * 384  # the 4 layers' elements
    again = {"none": 0, "core_attn": 0, "full_attn": attn, "mlp": mlp, "full": attn + mlp}
    for rc in P.RECOMPUTE_MODES:
        traffic = 6 * (2 * (attn + mlp) + again[rc]) * m
        added = compute["bfloat16"][rc] - compute["float32"][rc]
        assert added == pytest.approx(traffic / cpu.memory_bandwidth, rel=1e-9), rc


def test_dora_keeps_each_adapted_output_before_its_scale_and_computes_its_norms_every_forward():
    """DoRA: y = m / ||W + s A B|| (x W + s x A B): the product's backward keeps the pre-scale output
    ([out] per token, per routed token also its row scales), and every forward computes s A B and
    the column norms of W + s A B (2r + 3 FLOPs per base weight) without a gradient."""
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30)
    preds = []
    for dora in ("false", "true"):
        cfg = _cfg("model_name_or_path=tiny-dense", "fine_tuning=LoRA", f"use_dora={dora}", "lora_rank=8")
        preds.append(P.predict(P.model_config_of(cfg), free, P.workload_from_config(cfg, 1, "gpu"), ONE).parts)
    fan_out = 128 + 64 + 64 + 128 + 384 + 384 + 128
    tokens = ONE.micro_batch * S
    assert preds[1]["activations_bytes"] - preds[0]["activations_bytes"] == pytest.approx(4 * fan_out * 4 * tokens)
    base = 4 * (128 * (128 + 64 + 64) + 128 * 128 + 3 * 128 * 384)
    assert preds[1]["compute_s"] - preds[0]["compute_s"] == pytest.approx((2 * 8 + 3) * base / free.device_flops)
    assert preds[1]["trainable_params"] - preds[0]["trainable_params"] == fan_out * 4  # the magnitudes
    moe = LC.count_adapters(P.model_config_of(_cfg("model_name_or_path=tiny-moe")), 8, dora=True)
    assert moe.dora_transient_experts == 3 * 4 * 8 * 128 * 128  # all 8 experts' [128, 128] at once


def _trainable_rows(model, names: str) -> int:
    return sum(int(p.numel()) for n, p in model.named_parameters() if not p.stop_gradient and n.startswith(names))


def test_the_mtp_blocks_adapters_train_on_every_token():
    """Every token runs the MTP blocks: their adapters' 2 r (in + out) FLOPs per token (twice their
    parameters, counted on the built model) at 3 x for forward and backward."""
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30)
    computes = {}
    for ft in ("Full", "LoRA"):
        for depth in (0, 2):
            cfg = _cfg(
                "model_name_or_path=tiny-dense",
                f"fine_tuning={ft}",
                f"model_overrides.num_nextn_predict_layers={depth}",
            )
            pred = P.predict(P.model_config_of(cfg), free, P.workload_from_config(cfg, 1, "gpu"), ONE)
            computes[ft, depth] = pred.parts["compute_s"]
    assert computes["Full", 2] == computes["Full", 0]  # the MTP blocks' own compute is not modelled
    cfg = _cfg("model_name_or_path=tiny-dense", "fine_tuning=LoRA", "model_overrides.num_nextn_predict_layers=2")
    mtp = _trainable_rows(_built(cfg), "mtp.")
    assert mtp == 2 * 8 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 384))
    added = 3 * 2 * mtp * ONE.micro_batch * S / free.device_flops
    assert computes["LoRA", 2] - computes["LoRA", 0] == pytest.approx(added, rel=1e-9)


def test_the_vision_adapters_run_on_each_image_tokens_patches():
    """An image token is spatial_merge_size^2 patches in the vision transformer and one row in the
    resampler: the rows each adapted vision module of the built tiny-vl sees for one image."""
    import numpy as np
    import paddle

    args = ("model_name_or_path=tiny-vl", "fine_tuning=LoRA", r"lora_target_modules=.*\.(qkv|fc2|mlp)")
    cfg = _cfg(*args)
    c = P.model_config_of(cfg)
    model = _built(cfg)
    rows: dict[str, int] = {}
    for name, layer in model.named_sublayers():
        if name.startswith(("vision_model", "resampler_model")) and hasattr(layer, "lora_A"):
            layer.register_forward_post_hook(
                lambda l, i, o, name=name: rows.__setitem__(name, int(np.prod(o.shape[:-1])))
            )
    v, merge = c.vision, c.vision.spatial_merge_size
    grid = np.array([[1, 2 * merge, 3 * merge]])  # 24 patches, 6 image tokens
    pixels = paddle.randn([int(grid.prod()), v.in_channels * v.patch_size**2])
    model.visual_features(pixels, grid)
    image_tokens = int(grid.prod()) // merge**2
    counted = {m.name: m.rows for m, _ in LC.adapted(c, [cfg.lora_target_modules])}
    assert rows and rows == {n: r * image_tokens for n, r in counted.items() if n in rows}
    assert set(rows) == {n for n in counted if n.startswith(("vision_model", "resampler_model"))}
    # the step: 3 x 2 r (in + out) x rows per image token; the config's bound is one image of
    # image_max_pixels per row (84 x 84: 9 tokens)
    work = P.workload_from_config(_cfg(*args, "image_max_pixels=7056"), 1, "gpu")
    assert work.image_tokens == 9
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30)
    with_images = P.predict(c, free, work, ONE).parts["compute_s"]
    without = P.predict(c, free, dataclasses.replace(work, image_tokens=0.0), ONE).parts["compute_s"]
    vision = [(m, projs) for m, projs in LC.adapted(c, [cfg.lora_target_modules]) if m.part == "vision"]
    per_image_token = sum(2 * 8 * (i + o) * m.rows for m, projs in vision for _, i, o in projs)
    assert with_images - without == pytest.approx(
        3 * per_image_token * 9 * ONE.micro_batch / free.device_flops, rel=1e-9
    )


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
