"""Cost model and planner: cluster files, the formulas on hand-computed cases, enumeration,
ranking and errors, `erniekit plan` and `parallel: auto`."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
from rank_shares import local_elements

from erniekit.cli import main
from erniekit.config import load_config, validate
from erniekit.distributed import planner as P
from erniekit.errors import ConfigError
from erniekit.models.ernie4_5 import get_preset

ROOT = str(Path(__file__).resolve().parents[3])
CLUSTER = P.Cluster(
    nodes=1,
    devices_per_node=4,
    device_flops=1e12,
    device_memory=8e9,
    op_overhead_s=1e-5,
    memory_overhead=1e8,
    intra_node_bandwidth=1e10,
    intra_node_latency_s=1e-4,
    memory_bandwidth=1e30,
)
GPU_CLUSTER = dataclasses.replace(CLUSTER, device="gpu")
WORK = P.Workload(global_batch=16, seq_len=128)


def _write(tmp_path, text):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    return str(f)


def test_cluster_file_loads_and_errors_name_the_key(tmp_path):
    c = P.load_cluster(_write(tmp_path, "nodes: 2\ndevices_per_node: 8\ndevice_flops: 3.0e14\nname: gpus\n"))
    assert c.world == 16 and c.device_flops == 3e14 and c.name == "gpus"
    for text, words in (
        ("nodes: 2\ndevice_flop: 1\n", "unknown key 'device_flop'"),
        ("nodes: 1.5\n", "nodes"),
        ("device_memory: -1\n", "must be > 0"),
        ("nodes: [1\n", "cluster.yaml:"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            P.load_cluster(_write(tmp_path, text))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cluster file"):
        P.load_cluster(str(tmp_path / "missing.yaml"))
    assert c.device == "cpu"  # files written before the key describe CPU devices
    assert P.load_cluster(_write(tmp_path, "device: gpu\n")).device == "gpu"
    with pytest.raises(ConfigError, match=r"cluster.yaml: device='tpu' must be one of cpu, gpu"):
        P.load_cluster(_write(tmp_path, "device: tpu\n"))


def test_data_parallel_comm_and_zero_memory_follow_the_formulas():
    c = get_preset("tiny-dense")
    base = P.predict(c, CLUSTER, WORK, P.Plan(4, 1, 1, 1, 0, "none", 4, 1))
    on_dist = P.predict(c, CLUSTER, dataclasses.replace(WORK, replicas=False), P.Plan(4, 1, 1, 1, 0, "none", 4, 1))
    zero1 = P.predict(c, CLUSTER, WORK, P.Plan(4, 1, 1, 1, 1, "none", 4, 1))
    n_params = sum(1 for _ in range(9 * c.num_hidden_layers + 2))
    params = base.parts["params_bytes"] / 4
    ring = 2 * 3 / 4 * 4 * params / 1e10
    # whole-model replicas: the float32 gradients in one all-reduce: 2(n-1)/n bytes / bandwidth
    assert base.parts["comm_dp_s"] == pytest.approx(1e-4 + ring, rel=1e-9)
    # on DistTensors (a stage whose loss is not a sum over rows): one call per parameter tensor
    assert on_dist.parts["comm_dp_s"] == pytest.approx(n_params * 1e-4 + ring, rel=1e-9)
    # the real tiny-dense parameter count (embedding tied): every weight is counted once
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM

    assert params == sum(int(p.numel()) for p in Ernie4_5ForCausalLM(c).parameters())
    assert zero1.parts["moments_bytes"] == pytest.approx(base.parts["moments_bytes"] / 4)
    assert zero1.parts["grads_bytes"] == base.parts["grads_bytes"]
    zero2 = P.predict(c, CLUSTER, WORK, P.Plan(4, 1, 1, 1, 2, "none", 4, 1))
    assert zero2.parts["grads_bytes"] == pytest.approx(base.parts["grads_bytes"] / 4)
    # compute: 3 x forward FLOPs over 4 devices, the op launches, and the optimizer's launch per tensor
    L, H, V, S = c.num_hidden_layers, c.hidden_size, c.vocab_size, 128
    q, kv, I = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    fwd_per_token = L * (2 * (H * (q + 2 * kv) + q * H) + 4 * q * S + 6 * H * I) + 2 * H * V
    flops = 3 * fwd_per_token * 16 * S
    want = flops / (4 * 1e12) + (3 * (30 * L + 10)) * 1e-5 + n_params * 1e-5
    assert base.parts["compute_s"] == pytest.approx(want, rel=1e-9)
    # memory-bound traffic: the saved activations written once and read back by the two backward
    # passes, and the optimizer's 8 passes over the parameters (ZeRO-1: over this rank's quarter)
    saved = L * ((2 * H + 3 * q + 3 * kv + H) + c.num_attention_heads * S + (2 * H + 4 * I) + 2 * H)
    slow_cluster = dataclasses.replace(CLUSTER, memory_bandwidth=1e10)
    slow = P.predict(c, slow_cluster, WORK, P.Plan(4, 1, 1, 1, 0, "none", 4, 1))
    want = (3 * 4 * saved * 4 * S + 8 * 4 * params) / 1e10
    assert slow.parts["compute_s"] - base.parts["compute_s"] == pytest.approx(want, rel=1e-6)
    assert slow.parts["optimizer_s"] == pytest.approx(8 * 4 * params / 1e10 + n_params * 1e-5, rel=1e-9)
    slow1 = P.predict(c, slow_cluster, WORK, P.Plan(4, 1, 1, 1, 1, "none", 4, 1))
    assert slow1.parts["optimizer_s"] == pytest.approx(8 * 4 * params / 4 / 1e10 + n_params * 1e-5, rel=1e-9)
    # sharding: reduce-scatter + all-gather, the same bytes in twice the calls
    assert zero1.parts["comm_dp_s"] == pytest.approx(on_dist.parts["comm_dp_s"] + n_params * 1e-4, rel=1e-9)


def test_replicas_sum_through_shared_memory_on_one_host_and_distensors_pay_per_op():
    """host_sum_*: the replicas' one sum on a single host; spmd_op_overhead_s: every op of a layout
    on DistTensors (tp, ep, sharding, or dp for a stage that cannot run replicas), none for a
    single process, replicas or pipeline stages (plain tensors)."""
    c = get_preset("tiny-moe")
    shm = dataclasses.replace(CLUSTER, host_sum_bandwidth=2e10, host_sum_latency_s=5e-6)
    dp = P.Plan(4, 1, 1, 1, 0, "none", 4, 1)
    r = P.predict(c, shm, WORK, dp)
    grads = r.parts["grads_bytes"]  # the parameters less the routers' correction biases (never trained)
    assert r.parts["comm_dp_s"] == pytest.approx(5e-6 + grads / 2e10, rel=1e-9)
    # two nodes: the data ranks span them, gloo's one all-reduce over the inter-node link
    two = dataclasses.replace(shm, nodes=2, devices_per_node=2)
    r2 = P.predict(c, two, WORK, dp)
    assert r2.parts["comm_dp_s"] == pytest.approx(5e-5 + 2 * 3 / 4 * grads / 1.25e9, rel=1e-9)
    spmd = dataclasses.replace(CLUSTER, spmd_op_overhead_s=1e-3)
    plans = {
        "single": (P.Plan(1, 1, 1, 1, 0, "none", 16, 1), WORK, False),
        "replicas": (dp, WORK, False),
        "pipeline": (P.Plan(1, 1, 4, 1, 0, "none", 1, 16), WORK, False),
        "tp": (P.Plan(2, 2, 1, 1, 0, "none", 8, 1), WORK, True),
        "ep": (P.Plan(4, 1, 1, 4, 0, "none", 4, 1), WORK, True),
        "zero1": (P.Plan(4, 1, 1, 1, 1, "none", 4, 1), WORK, True),
        "dp, not replicas": (dp, dataclasses.replace(WORK, replicas=False), True),
    }
    for name, (plan, work, pays) in plans.items():
        extra = P.predict(c, spmd, work, plan).step_s - P.predict(c, CLUSTER, work, plan).step_s
        layers = P.layer_costs(c)
        ops = 3 * (sum(l.ops for l in layers) + 10) * plan.accumulation
        tensors = 9 * len(layers) + 2 + 3 * sum(l.is_moe for l in layers)
        assert extra == (pytest.approx((ops + tensors) * 1e-3, rel=1e-9) if pays else 0.0), name
    # a cluster file may leave them at 0 (not measured); below 0 is refused
    assert P.cluster_from_mapping({"spmd_op_overhead_s": 0, "host_sum_bandwidth": 0}, "f").host_sum_bandwidth == 0
    with pytest.raises(ConfigError, match="spmd_op_overhead_s=-1 must be > 0"):
        P.cluster_from_mapping({"spmd_op_overhead_s": -1}, "f")
    with pytest.raises(ConfigError, match="device_flops=0 must be > 0"):
        P.cluster_from_mapping({"device_flops": 0}, "f")


def test_replicas_count_the_buffer_they_sum_their_gradients_through():
    """Whole-model replicas keep a gradient-sized buffer for the sum (replicas.py / host_sum.py):
    on one CPU host this rank's slot plus its chunk of the others', (2 - 1/dp) x the gradients;
    across hosts gloo's numpy copy, 1x; on GPUs the concat and split, 2x. Layouts that are not
    replicas, and one process, have none."""
    c = get_preset("tiny-dense")
    grads = P.predict(c, CLUSTER, WORK, P.Plan(1, 1, 1, 1, 0, "none", 16, 1)).parts["grads_bytes"]
    cases = [
        (CLUSTER, P.Plan(4, 1, 1, 1, 0, "none", 4, 1), WORK, (2 - 1 / 4) * grads),
        (CLUSTER, P.Plan(2, 1, 1, 1, 0, "none", 8, 1), WORK, 1.5 * grads),
        (dataclasses.replace(CLUSTER, nodes=2, devices_per_node=2), P.Plan(4, 1, 1, 1, 0, "none", 4, 1), WORK, grads),
        (GPU_CLUSTER, P.Plan(4, 1, 1, 1, 0, "none", 4, 1), WORK, 2 * grads),
        (CLUSTER, P.Plan(1, 1, 1, 1, 0, "none", 16, 1), WORK, 0.0),
        (CLUSTER, P.Plan(4, 1, 1, 1, 1, "none", 4, 1), WORK, 0.0),  # ZeRO-1: DistTensors
        (CLUSTER, P.Plan(4, 1, 1, 1, 0, "none", 4, 1), dataclasses.replace(WORK, replicas=False), 0.0),
    ]
    for cluster, plan, work, want in cases:
        r = P.predict(c, cluster, work, plan)
        assert r.parts["sum_buffer_bytes"] == pytest.approx(want, rel=1e-12), plan.describe()
        rest = sum(r.parts[k] for k in ("params_bytes", "grads_bytes", "moments_bytes", "activations_bytes"))
        assert r.memory > rest + r.parts["logits_bytes"] + want + cluster.memory_overhead  # + one layer's backward


def test_workload_runs_replicas_only_for_stages_whose_loss_sums_over_rows(tmp_path):
    base = ["model_name_or_path=tiny-dense", f"output_dir={tmp_path / 'o'}", "nproc_per_node=2"]
    assert P.workload_from_config(validate(load_config(None, base + ["stage=SFT"]))).replicas
    dpo = validate(load_config(os.path.join(ROOT, "examples/configs/tiny/dpo.yaml"), base))
    assert not P.workload_from_config(dpo).replicas


def test_workload_takes_the_chunked_head_where_the_stage_does(tmp_path):
    base = ["model_name_or_path=tiny-dense", f"output_dir={tmp_path / 'o'}", "stage=SFT"]
    sft = validate(load_config(None, base))
    assert P.workload_from_config(sft).fused_head and not P.workload_from_config(sft, device="gpu").fused_head
    # GPUs take Paddle's flash attention, which keeps no [S, S] probabilities
    assert P.workload_from_config(sft, device="gpu").fused_attention and not P.workload_from_config(sft).fused_attention
    for off in ("fused_head_loss=false", "loss_token_balance=true"):
        assert not P.workload_from_config(validate(load_config(None, base + [off]))).fused_head, off
    dpo = validate(load_config(os.path.join(ROOT, "examples/configs/tiny/dpo.yaml"), base[:2]))
    assert not P.workload_from_config(dpo).fused_head


def _tensors(r: P.Prediction) -> float:
    """A prediction's memory without the heap's holes (which depend on the tensors counted)."""
    return r.memory - r.parts["heap_slack_bytes"]


def test_the_cpu_heap_may_hold_another_steps_activations_and_logits():
    """A step's freed activations and logits leave holes the next allocations split: on CPU the
    prediction adds their size once more (the measured bound, docs/planner.md); GPUs add nothing."""
    c = get_preset("tiny-dense")
    for plan, work in (
        (P.Plan(1, 1, 1, 1, 0, "none", 1, 1), P.Workload(1, 128)),
        (P.Plan(1, 1, 1, 1, 0, "full", 16, 2), P.Workload(32, 128)),
        (P.Plan(4, 1, 1, 1, 1, "none", 4, 1), WORK),  # ZeRO-1 (DistTensors)
    ):
        r = P.predict(c, CLUSTER, work, plan)
        want = r.parts["activations_bytes"] + r.parts["logits_bytes"]
        assert want > 0 and r.parts["heap_slack_bytes"] == pytest.approx(want), plan.describe()
        gpu = P.predict(c, GPU_CLUSTER, work, plan)
        assert gpu.parts["heap_slack_bytes"] == 0 and gpu.memory == pytest.approx(_tensors(gpu))


def test_the_backward_working_set_is_a_layers_or_the_embeddings_dense_gradient():
    """At its end the backward makes the embedding's [V, H] gradient whole before adding it into the
    tied head's dW: where that is bigger than one layer's working set, it is the one counted."""
    c = get_preset("ERNIE-4.5-0.3B")
    cluster = dataclasses.replace(CLUSTER, device_memory=1e12)

    def working_set(c, mb, acc=1):
        r = P.predict(c, cluster, P.Workload(mb * acc, 128), P.Plan(1, 1, 1, 1, 0, "none", mb, acc))
        counted = ("params", "grads", "moments", "activations", "logits", "sum_buffer", "heap_slack")
        return r.memory - sum(r.parts[f"{k}_bytes"] for k in counted) - cluster.memory_overhead

    assert working_set(c, 1) == pytest.approx(4 * c.vocab_size * c.hidden_size)
    untied = c.replace(tie_word_embeddings=False)  # its gradient is the weight's own: one layer's set
    assert working_set(untied, 1) < working_set(c, 1) / 10
    # accumulating, an untied embedding's new gradient is added into the one kept from before
    assert working_set(untied, 1, acc=2) == pytest.approx(4 * c.vocab_size * c.hidden_size)
    assert working_set(c, 64) > 4 * c.vocab_size * c.hidden_size  # a long batch: one layer's is bigger


def test_the_chunked_head_counts_one_chunk_of_logits_instead_of_three_whole():
    c = get_preset("ERNIE-4.5-0.3B")
    V, rows = c.vocab_size, 2 * 4096
    one = P.Plan(dp=1, tp=1, pp=1, ep=1, sharding_stage=0, recompute="full", micro_batch=2, accumulation=1)
    work = P.Workload(global_batch=2, seq_len=4096)
    whole = _tensors(P.predict(c, CLUSTER, work, one))
    chunked = _tensors(P.predict(c, CLUSTER, dataclasses.replace(work, fused_head=True), one))
    assert whole - chunked == pytest.approx(4 * V * (3 * rows - 1024))  # 1024 rows a chunk at this vocabulary
    fused = dataclasses.replace(work, fused_head=True)
    for whole_logits in (dataclasses.replace(one, tp=2), dataclasses.replace(one, pp=2)):  # DistTensors; last stage
        assert P.predict(c, CLUSTER, work, whole_logits).memory == P.predict(c, CLUSTER, fused, whole_logits).memory
    acc = dataclasses.replace(one, micro_batch=1, accumulation=2)  # the forward's dW waits beside .grad
    acc_whole, acc_fused = _tensors(P.predict(c, CLUSTER, work, acc)), _tensors(P.predict(c, CLUSTER, fused, acc))
    assert acc_whole - acc_fused == pytest.approx(4 * V * (3 * 4096 - 1024) - 4 * V * c.hidden_size)


def test_recompute_trades_memory_for_time_and_pipeline_pays_a_bubble():
    c = get_preset("tiny-moe")
    preds = {rc: P.predict(c, CLUSTER, WORK, P.Plan(1, 1, 4, 1, 0, rc, 1, 4)) for rc in P.RECOMPUTE_MODES}
    act = {rc: r.parts["activations_bytes"] for rc, r in preds.items()}
    assert act["full"] < act["full_attn"] < act["none"] and act["full"] < act["mlp"] < act["none"]
    assert act["core_attn"] < act["none"]
    assert preds["full"].parts["compute_s"] > preds["none"].parts["compute_s"]
    assert preds["none"].parts["bubble"] == pytest.approx((4 + 4 - 1) / 4)
    more = P.predict(c, CLUSTER, WORK, P.Plan(1, 1, 4, 1, 0, "none", 1, 16))  # 16 micro-batches, smaller bubble
    assert more.parts["bubble"] == pytest.approx(19 / 16)


def test_enumeration_splits_model_and_batch_evenly():
    c = get_preset("tiny-moe")  # 4 heads, 2 KV heads, 8 experts, 4 layers
    plans = P.enumerate_plans(c, 4, WORK)
    assert plans and all(p.dp * p.tp * p.pp == 4 for p in plans)
    assert {p.tp for p in plans} == {1, 2}  # tp=4 does not divide the 2 KV heads
    assert all(16 % (p.dp * p.micro_batch) == 0 and p.micro_batch * p.accumulation * p.dp == 16 for p in plans)
    assert all(p.dp % p.ep == 0 for p in plans) and {p.ep for p in plans} == {1, 2, 4}
    assert all(p.accumulation >= p.pp for p in plans)
    # what `erniekit train` runs of them on CPU for a full fine-tune (config_refusal, train's check)
    refusal = P.config_refusal(_normalised(["model_name_or_path=tiny-moe"]), "cpu")
    runnable = [p for p in plans if not refusal(p)]
    assert runnable and all(p.sharding_stage != 3 for p in runnable) and {p.tp for p in runnable} == {1, 2}
    # the pipeline runs alone or beside dp, never beside tp, ep or sharding
    piped = [p for p in runnable if p.pp > 1]
    assert {(p.pp, p.dp) for p in piped} == {(2, 2), (4, 1)}
    assert all(p.tp == 1 and p.ep == 1 and not p.sharding_stage for p in piped)
    dense_refusal = P.config_refusal(_normalised(["model_name_or_path=tiny-dense"]), "cpu")
    dense = [p for p in P.enumerate_plans(get_preset("tiny-dense"), 4, WORK) if not dense_refusal(p)]
    assert any(p.pp == 2 and p.dp == 2 for p in dense)  # pp x dp on a dense model
    assert len(runnable) < len(plans)


def _normalised(args: list[str]):
    """A training config from key=value arguments, normalised as train and plan check it."""
    from erniekit.config import checks

    return checks.normalise(load_config(None, args))


def test_best_plan_prefers_fast_plans_that_fit_and_explains_when_none_fits():
    c = get_preset("ERNIE-4.5-0.3B")
    work = P.Workload(global_batch=32, seq_len=4096)
    best = P.best_plan(c, GPU_CLUSTER, work)
    preds = P.plan(c, GPU_CLUSTER, work)
    assert best.fits and best.step_s == min(r.step_s for r in preds if r.fits)
    assert any(not r.fits for r in preds)  # the full batch without recompute does not fit in 8 GB
    tiny = dataclasses.replace(CLUSTER, device_memory=1e8)
    with pytest.raises(ConfigError, match="no layout fits in 0.10 GB per device") as e:
        P.best_plan(c, tiny, work)
    assert "needs" in str(e.value) and "\n" not in str(e.value)


def test_plan_cli_prints_a_ranked_table(tmp_path, capsys):
    cluster = _write(tmp_path, "devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: 1.2e10\n")
    out = tmp_path / "plans.json"
    rc = main(
        [
            "plan",
            os.path.join(ROOT, "examples/configs/tiny/sft.yaml"),
            f"cluster={cluster}",
            "--top",
            "5",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "global batch 128 x 32 tokens" in text and text.count("dp=") == 5
    rows = json.loads(out.read_text())
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["plan"]["sharding_stage"] != 3 for r in rows)  # runnable on CPU only, unless --all


def test_plan_cli_plans_what_the_clusters_device_kind_runs(tmp_path, capsys):
    """A GPU cluster file (`device: gpu`) gets GPU rules: stage 3 is runnable, flash attention keeps
    no [S, S] probabilities and the head makes whole logits; a CPU one the CPU's."""
    body = "devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: 1.2e10\n"
    sft = os.path.join(ROOT, "examples/configs/tiny/sft.yaml")
    rows = {}
    for device in ("cpu", "gpu"):
        cluster = _write(tmp_path, body + f"device: {device}\n")
        out = tmp_path / f"{device}.json"
        assert main(["plan", sft, f"cluster={cluster}", "--top", "1", "--json", str(out)]) == 0
        assert f"1 x 2 {device} devices, 12.0 GB each" in capsys.readouterr().out
        rows[device] = {r["layout"]: r for r in json.loads(out.read_text())}
    assert not any("zero3" in k for k in rows["cpu"]) and any("zero3" in k for k in rows["gpu"])
    replicas = "dp=2 tp=1 pp=1 ep=1 rc=none mb=64x1"
    cpu, gpu = rows["cpu"][replicas]["parts"], rows["gpu"][replicas]["parts"]
    c = P.model_config_of(load_config(sft, []))  # tiny-moe with the config's model_overrides
    # 64 rows of 32 tokens: the CPU kernel keeps the (small) probabilities, flash attention does not
    probs = 4 * 64 * c.num_attention_heads * 32 * 32 * c.num_hidden_layers
    assert cpu["activations_bytes"] - gpu["activations_bytes"] == pytest.approx(probs)
    assert gpu["logits_bytes"] == 3 * 4 * 64 * 32 * c.vocab_size > cpu["logits_bytes"]


def _runs_on() -> str:
    """The device kind a run trains on here (as auto_plan and select_device decide)."""
    from erniekit.utils.device import cuda_visible

    return "gpu" if cuda_visible() else "cpu"


def test_parallel_auto_refuses_a_cluster_file_of_the_other_device_kind(tmp_path):
    here = _runs_on()
    other = {"cpu": "gpu", "gpu": "cpu"}[here]
    body = f"devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: 1.2e10\ndevice: {other}\n"
    cluster = _write(tmp_path, body)
    args = ["model_name_or_path=tiny-dense", f"output_dir={tmp_path / 'o'}", "parallel=auto", f"cluster={cluster}"]
    words = rf"describes {other.upper()} devices \(device: {other}\) but this run trains on the {here.upper()}"
    with pytest.raises(ConfigError, match=words) as e:
        validate(load_config(None, args + ["nproc_per_node=2"]))
    assert "\n" not in str(e.value)


def test_parallel_auto_applies_the_best_plan_keeping_the_global_batch(tmp_path):
    body = f"devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: 1.2e10\ndevice: {_runs_on()}\n"
    cluster = _write(tmp_path, body)
    base = [
        "model_name_or_path=tiny-dense",
        "per_device_train_batch_size=32",
        "gradient_accumulation_steps=2",
        "max_seq_len=32",
        f"output_dir={tmp_path / 'o'}",
    ]
    cfg = validate(load_config(None, base + ["parallel=auto", f"cluster={cluster}", "nproc_per_node=2"]))
    refusal = P.config_refusal(_normalised(base + ["nproc_per_node=2"]), _runs_on())  # train's own check
    want = P.best_plan(get_preset("tiny-dense"), P.load_cluster(cluster), P.Workload(128, 32), refusal=refusal)
    for k, v in want.plan.config_overrides().items():
        assert getattr(cfg, k) == v, k
    from erniekit.distributed.collective.layout import layout_from_config

    lay = layout_from_config(cfg)
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * lay.dp * lay.sharding == 128
    # a config the pipeline cannot run (generation during eval) gets the best plan without pp
    ev = [f"eval_dataset_path={os.path.join(ROOT, 'examples/data/arithmetic/eval.jsonl')}", "do_eval=true"]
    no_pp = validate(load_config(None, base + ev + ["parallel=auto", f"cluster={cluster}", "nproc_per_node=2"]))
    refusal = P.config_refusal(_normalised(base + ev + ["nproc_per_node=2"]), _runs_on())
    want = P.best_plan(
        get_preset("tiny-dense"), P.load_cluster(cluster), P.Workload(128, 32), pipeline=False, refusal=refusal
    )
    assert no_pp.pipeline_parallel_degree == 1
    for k, v in want.plan.config_overrides().items():
        assert getattr(no_pp, k) == v, k
    assert not any(
        p.pp > 1 for p in P.enumerate_plans(get_preset("tiny-dense"), 2, P.Workload(128, 32), pipeline=False)
    )
    with pytest.raises(ConfigError, match="needs cluster"):
        validate(load_config(None, base + ["parallel=auto"]))
    with pytest.raises(ConfigError, match="has 2 devices .* but the launch has 1 processes"):
        validate(load_config(None, base + ["parallel=auto", f"cluster={cluster}"]))


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny-moe", None),
        ("tiny-vl", None),
        ("tiny-dense", {"num_nextn_predict_layers": 1}),
        ("tiny-moe", {"num_nextn_predict_layers": 2}),
    ],
)
def test_parameter_count_is_the_built_models_on_every_rank(name, overrides):
    """Text and vision expert groups of their own sizes, the vision transformer and resampler, the
    routers' correction biases (held, never trained: stop_gradient) and the MTP depths: the planner's
    count is the built model's, and at tp=2 (with ep=2 on MoE) each rank's share is what the
    runtime's placements leave it (routed experts split by width, norms and routers whole)."""
    from erniekit.distributed.collective.layout import Layout
    from erniekit.models.registry import load_model, model_config

    c = model_config(name, overrides)
    model = load_model(name, overrides) if overrides else load_model(name)
    held, trained = local_elements(model, Layout())
    assert (held > trained) == c.is_moe  # the correction biases are parameters the optimizer skips
    ep = 2 if c.is_moe else 1
    layouts = [(Layout(), P.Plan(1, 1, 1, 1, 0, "none", 16, 1)), (Layout(tp=2), P.Plan(1, 2, 1, 1, 0, "none", 16, 1))]
    layouts.append((Layout(dp=2, tp=2, ep=ep), P.Plan(2, 2, 1, ep, 0, "none", 8, 1)))
    for lay, plan in layouts:
        pred = P.predict(c, CLUSTER, WORK, plan)
        assert (pred.parts["params_bytes"] / 4, pred.parts["trainable_params"]) == local_elements(model, lay), lay
    # tp=2 halves the projections and the routed experts: their weights, gradients and moments
    one, two = (P.predict(c, CLUSTER, WORK, P.Plan(1, tp, 1, 1, 0, "none", 16, 1)) for tp in (1, 2))
    counts = P.param_counts(c)
    assert counts.total == held and (counts.experts > 0) == c.is_moe
    for part, per_element in (("params_bytes", 4), ("grads_bytes", 4), ("moments_bytes", 8)):
        assert one.parts[part] - two.parts[part] == per_element * (counts.split + counts.experts) / 2


def test_tp_splits_the_routed_experts_gemms_and_sums_their_partial_outputs():
    """Routed experts split by width (runtime.py): each tp rank runs half of every GEMM, routed ones
    included, so with free launches and memory traffic tp=2 halves the compute; each MoE layer adds
    per micro-batch an all-reduce of the experts' partial output [tokens, H] (forward; again when
    recompute reruns the MLP), of its input's gradient [tokens, H] and of the gate weights' [tokens, k]."""
    c = get_preset("tiny-moe")
    free = dataclasses.replace(CLUSTER, op_overhead_s=0.0, memory_bandwidth=1e30)
    work = dataclasses.replace(WORK, fused_attention=True)  # neither layout keeps the [S, S] scores
    for rc in ("none", "full_attn"):  # full_attn: recomputed attention, the experts' GEMMs once
        one, two = (P.predict(c, free, work, P.Plan(1, tp, 1, 1, 0, rc, 8, 2)) for tp in (1, 2))
        assert two.parts["compute_s"] - two.parts["optimizer_s"] == pytest.approx(
            (one.parts["compute_s"] - one.parts["optimizer_s"]) / 2, rel=1e-12
        )
    L, moe, k, H, rows, m = 4, 3, 2, 128, 8 * 128, 2
    act = 4 * rows * H

    def allreduce(nbytes: float) -> float:  # 2 ranks: latency + 2 (n - 1) / n x bytes / bandwidth
        return 1e-4 + nbytes / 1e10

    for rc, hidden in (("none", 2), ("mlp", 3)):
        r = P.predict(c, CLUSTER, WORK, P.Plan(2, 2, 1, 1, 0, rc, 8, 1))
        want = (4 * L + 2) * allreduce(act) + moe * (hidden * allreduce(act) + allreduce(4 * rows * k))
        assert r.parts["comm_tp_s"] == pytest.approx(want, rel=1e-12), rc
    two = P.predict(c, CLUSTER, WORK, P.Plan(1, 2, 1, 1, 0, "none", 8, m))
    sent = m * ((4 * L + 2 + 2 * moe) * act + moe * 4 * rows * k)  # ring of 2: the buffer once
    assert two.parts["comm_bytes"] == sent


def test_vl_424b_preset_has_its_published_size():
    from erniekit.models.registry import model_config

    pred = P.predict(model_config("ERNIE-4.5-VL-424B-A47B"), CLUSTER, WORK, P.Plan(1, 1, 1, 1, 0, "none", 16, 1))
    assert pred.parts["params_bytes"] / 4 == pytest.approx(424e9, rel=0.01)


def test_the_attention_probabilities_count_where_the_layers_keep_them():
    """The CPU kernel keeps [heads, S, S] only while a micro-batch's are small (nn/kernel_memory.py),
    Paddle's math path on DistTensors always, GPU flash attention never."""
    c = get_preset("ERNIE-4.5-0.3B")

    def acts(seq_len, fused=False, **plan):
        p = P.Plan(**{"dp": 1, "tp": 1, "pp": 1, "ep": 1, "sharding_stage": 0, "recompute": "none"} | plan)
        work = P.Workload(global_batch=p.dp * p.micro_batch, seq_len=seq_len, fused_attention=fused)
        return P.predict(c, CLUSTER, work, p).parts["activations_bytes"]

    one = {"micro_batch": 1, "accumulation": 1}
    long_probs = 4 * c.num_attention_heads * 4096 * 4096 * c.num_hidden_layers  # 1 GiB a layer
    assert acts(4096, **one) == acts(4096, fused=True, **one)  # the kernel keeps 2 floats a row
    assert acts(32, **one) - acts(32, fused=True, **one) == pytest.approx(
        4 * c.num_attention_heads * 32 * 32 * c.num_hidden_layers
    )
    tp = acts(4096, tp=2, **one) - acts(4096, fused=True, tp=2, **one)
    assert tp == pytest.approx(long_probs / 2)  # DistTensors: the math path keeps each tp rank's heads


def test_attention_that_keeps_no_probabilities_computes_q_k_again(monkeypatch):
    c = get_preset("ERNIE-4.5-0.3B")
    p = P.Plan(dp=1, tp=1, pp=1, ep=1, sharding_stage=0, recompute="none", micro_batch=1, accumulation=1)
    work = P.Workload(global_batch=1, seq_len=4096)
    again = P.predict(c, CLUSTER, work, p).parts["compute_s"]
    monkeypatch.setattr(P.kernel_memory, "KEEP_PROBS_BYTES", 1 << 40)  # the kernel keeps them
    kept = P.predict(c, CLUSTER, work, p).parts["compute_s"]
    qk = 2.0 * c.num_attention_heads * c.head_dim * 4096 * 4096 * c.num_hidden_layers  # q k^T, every layer
    assert again - kept == pytest.approx(qk / CLUSTER.device_flops)


def test_a_tp_rank_keeps_the_moe_activations_of_width_h_e_and_k_whole():
    """Routed experts split over tp by width run every rank's slice on the same tokens: each tp rank
    keeps the MoE's input and outputs [T, H] (4H), routing tensors (3E), dispatched rows and expert
    outputs [T k, H] (2kH) whole; only the gate / up / SwiGLU activations of the routed (4k I_e) and
    shared (4 I_s) experts are split. Attention and dense MLP: their whole parts too (the next test)."""
    c = get_preset("tiny-moe")
    H, q, kv, I, E, k, Ie, Is = 128, 128, 64, 384, 8, 2, 128, 128
    assert (c.hidden_size, c.intermediate_size, c.total_experts, c.moe_k, c.moe_intermediate_size) == (H, I, E, k, Ie)
    work = dataclasses.replace(WORK, fused_attention=True)  # no [S, S] probabilities on either side
    residual = 2 * H
    moe_whole, moe_split = 4 * H + 3 * E + 2 * k * H, 4 * k * Ie + 4 * Is
    tokens = 8 * 128  # one micro-batch of 8 rows in flight
    for tp in (1, 2):
        r = P.predict(c, CLUSTER, work, P.Plan(1, tp, 1, 1, 0, "none", 8, 2))
        attn, dense = 3 * H + 3 * (q + kv) / tp, 2 * H + 4 * I / tp
        per_token = attn + dense + residual + 3 * (attn + moe_whole + moe_split / tp + residual)
        assert r.parts["activations_bytes"] == pytest.approx(4 * per_token * tokens, rel=1e-12), tp
