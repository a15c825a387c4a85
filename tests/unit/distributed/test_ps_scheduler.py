"""The heterogeneous placement cost model and its schedulers (erniekit/distributed/ps/)."""

import math

import numpy as np
import pytest

from erniekit.distributed.ps.cost_model import (
    BYTES,
    STATE,
    DeviceType,
    HeteroCluster,
    Part,
    PlacementProblem,
    load_hetero_cluster,
    model_parts,
)
from erniekit.distributed.ps.scheduler import (
    against_exact,
    against_greedy,
    best_reachable,
    exact,
    greedy,
    rl_search,
    synthetic_instance,
)
from erniekit.errors import ConfigError

CPU = DeviceType("cpu", 8, flops=1e11, memory=64e9, bandwidth=1.25e9, price_per_hour=0.2, memory_bandwidth=2e10)
GPU = DeviceType("gpu", 4, flops=1e14, memory=80e9, bandwidth=1.25e10, price_per_hour=3.0, memory_bandwidth=2e12)


def _naive_stage(parts, t, tokens, budget):
    """Fewest devices by trying every count (the closed form's reference)."""
    flops = sum(p.flops for p in parts) * tokens
    traffic = sum(p.memory_traffic for p in parts) * tokens
    grad = BYTES * sum(p.params for p in parts)
    for n in range(1, t.count + 1):
        time = (flops / t.flops + traffic / t.memory_bandwidth) / n + (2 * (n - 1) / n * grad / t.bandwidth)
        mem = STATE * BYTES * sum(p.params for p in parts) + BYTES * tokens * sum(p.saved for p in parts) / n
        if mem <= t.memory and time <= budget:
            return n, time
    return None, None


def test_one_stage_cost_is_the_formula():
    part = Part("block", flops=6e9, params=10_000_000, activation=1024, saved=4096)
    prob = PlacementProblem([part], HeteroCluster([GPU]), tokens=8192, target=3e4)
    ev = prob.evaluate(("gpu",))
    n, time = _naive_stage([part], GPU, 8192, 8192 / 3e4)
    assert n == 2
    assert ev.feasible and ev.devices == {"gpu": n}
    assert ev.cost_per_batch == pytest.approx(time * n * 3.0 / 3600)
    assert ev.throughput == pytest.approx(8192 / time)


def test_closed_form_device_counts_match_trying_every_count():
    rng = np.random.default_rng(0)
    for _ in range(200):
        cluster, parts = synthetic_instance(rng, 3, 2)
        target = float(10 ** rng.uniform(2, 6))
        prob = PlacementProblem(parts, cluster, 4096, target)
        for t in cluster.types:
            for i, j in ((0, 1), (0, 3), (1, 3)):
                n, time, _ = prob.stage(t.name, i, j)
                want_n, want_t = _naive_stage(parts[i:j], t, 4096, 4096 / target)
                assert n == want_n
                if n is not None:
                    assert time == pytest.approx(want_t)


def test_a_stage_boundary_pays_the_activation_transfer():
    parts = [Part("a", 1e9, 1000, activation=4096, saved=10), Part("b", 1e9, 1000, activation=4096, saved=10)]
    slow = DeviceType("x", 4, 1e15, 1e12, bandwidth=1e6, price_per_hour=1.0)
    other = DeviceType("y", 4, 1e15, 1e12, bandwidth=1e6, price_per_hour=1.0)
    prob = PlacementProblem(parts, HeteroCluster([slow, other]), 1000, 1.0)
    split, together = prob.evaluate(("x", "y")), prob.evaluate(("x", "x"))
    assert split.throughput == pytest.approx(1000 / (2 * BYTES * 1000 * 4096 / 1e6))
    assert together.throughput > 100 * split.throughput


def test_a_table_too_big_for_a_gpu_goes_to_cpu_and_the_blocks_to_gpu():
    """The Paddle-HeterPS case: a large row-sharded embedding lives on cheap CPU servers (its 96 GB
    of state needs two of them), the compute-heavy blocks on GPUs; CPU-only misses the target and
    GPU-only pays GPU prices for memory."""
    table = Part(
        "embedding", flops=0.0, params=6_000_000_000, activation=4096, saved=0.0, memory_traffic=32768, sharded=True
    )
    blocks = [Part(f"layer{i}", flops=6 * 2e8, params=200_000_000, activation=4096, saved=50_000) for i in range(4)]
    head = Part("head", flops=6 * 4096 * 32000, params=4096 * 32000, activation=0, saved=32000)
    prob = PlacementProblem([table, *blocks, head], HeteroCluster([CPU, GPU]), tokens=16384, target=2e4)
    best = exact(prob)
    assert best.evaluation.feasible
    assert best.placement[0].rstrip("*") == "cpu" and all(t.rstrip("*") == "gpu" for t in best.placement[1:5])
    assert best.evaluation.devices["cpu"] == 2  # the table's state split over two servers
    assert not prob.evaluate(tuple(["cpu"] * 6)).feasible
    gpu_only = prob.evaluate(tuple(["gpu"] * 6))
    assert not gpu_only.feasible or gpu_only.cost_per_batch > 1.2 * best.cost  # measured 1.36x
    assert rl_search(prob, seed=0, warm_start=greedy(prob).placement).cost == pytest.approx(best.cost)


def test_stage_cuts_let_one_type_pipeline_a_long_chain():
    """A run of GPU parts whose all-reduce limits data parallelism: cut into stages, each
    all-reduces only its own parameters, so a target one stage cannot meet becomes feasible."""
    from erniekit.models.ernie4_5 import get_preset

    parts = model_parts(get_preset("ERNIE-4.5-0.3B"), seq_len=1024)
    prob = PlacementProblem(parts, HeteroCluster([CPU, GPU]), tokens=16 * 1024, target=1e5)
    assert not prob.evaluate(tuple(["gpu"] * len(parts))).feasible
    found = rl_search(prob, seed=0, warm_start=greedy(prob).placement)
    assert found.evaluation.feasible and len(found.evaluation.stages) >= 2


def test_rl_scheduler_finds_the_exact_optimum_on_small_instances():
    """At least 95% of 40 seeded enumerable instances (4-5 parts, 2-3 device types, each part's
    choice a type or a type that starts a new stage)."""
    pairs = against_exact(range(40))
    for rl, ex in pairs:
        assert rl >= ex * (1 - 1e-9)  # nothing beats the optimum
    hits = sum(rl <= ex * (1 + 1e-9) for rl, ex in pairs)
    assert len(pairs) >= 35 and hits >= 0.95 * len(pairs)


def test_rl_scheduler_beats_greedy_on_larger_clusters():
    """40-part chains on 3 device types, each at a target greedy meets: RL warm-started from the
    greedy placement is never worse and is strictly cheaper on most."""
    pairs = against_greedy(range(10))
    for rl, g in pairs:
        assert rl <= g
    better = sum(rl < g * (1 - 1e-6) for rl, g in pairs)
    assert len(pairs) >= 4 and better >= len(pairs) - 1, (better, len(pairs))


def test_unreachable_target_reports_the_best_throughput():
    part = Part("block", flops=6e9, params=1000, activation=1024, saved=10)
    prob = PlacementProblem([part], HeteroCluster([CPU]), tokens=1000, target=1e9)
    assert exact(prob).placement is None
    best, pl = best_reachable(prob)
    assert pl == ("cpu",) and best == pytest.approx(1000 / (6e9 * 1000 / 1e11 / 8 + 2 * 7 / 8 * 4000 / 1.25e9))


def test_cluster_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("device_types:\n  - {name: cpu, count: 2, flops: 1e11, memory: 1e9, bandwidth: 1e9}\n")
    with pytest.raises(ConfigError, match=r"device_types\[0\] lacks price_per_hour"):
        load_hetero_cluster(str(bad))
    bad.write_text(
        "device_types:\n  - {name: cpu, count: 0, flops: 1e11, memory: 1e9, bandwidth: 1e9, price_per_hour: 1}\n"
    )
    with pytest.raises(ConfigError, match=r"count=0 must be a positive finite number"):
        load_hetero_cluster(str(bad))
    bad.write_text("nodes: 2\n")
    with pytest.raises(ConfigError, match="needs a non-empty device_types list"):
        load_hetero_cluster(str(bad))
    assert math.isfinite(load_hetero_cluster("examples/clusters/hetero-cpu-gpu.yaml").types[0].flops)


def test_plan_mode_ps_prints_the_placements_and_refuses_an_unreachable_target(tmp_path):
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "erniekit",
        "plan",
        "--mode",
        "ps",
        "examples/clusters/hetero-cpu-gpu.yaml",
        "model_name_or_path=ERNIE-4.5-0.3B",
        "max_seq_len=1024",
        "per_device_train_batch_size=16",
    ]
    r = subprocess.run(
        cmd + ["--target", "1e5", "--json", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| RL scheduler | yes |" in r.stdout and "| cpu only | no" in r.stdout and "| gpu only | no" in r.stdout
    rows = {row["name"]: row for row in json.load(open(tmp_path / "p.json"))["rows"]}
    assert rows["RL scheduler"]["tokens_per_s"] >= 1e5
    r = subprocess.run(cmd + ["--target", "1e9"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "unreachable" in err[0] and "the best placement found reaches" in err[0]


def test_a_cluster_that_cannot_hold_a_part_is_a_one_line_error():
    from erniekit.distributed.ps.plan import plan_placement
    from erniekit.models.ernie4_5 import get_preset

    tiny = DeviceType("small", 8, flops=1e12, memory=1e9, bandwidth=1e9, price_per_hour=1.0)
    with pytest.raises(
        ConfigError,
        match=r"no device type can hold layer0: .* need [\d.]+ GB, the most any type "
        r"offers is 1.0 GB",
    ) as e:  # the table, row-sharded, fits 8 x 1 GB
        plan_placement(get_preset("ERNIE-4.5-21B-A3B"), HeteroCluster([tiny], "tiny"), 1024, 8, target=1e3)
    assert "\n" not in str(e.value)


def test_fixed_workers_per_stage_cost_every_stage_that_many_devices():
    """replicas=R (ps_stage_workers: the PS pipeline runs R copies of itself): a stage gets R
    devices, not the fewest that meet the target; it is infeasible when R are too slow or cannot
    hold its share, and the device counts of all stages add up against the cluster's."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        cluster, parts = synthetic_instance(rng, 3, 2)
        target = float(10 ** rng.uniform(2, 6))
        for r in (1, 2, 3):
            prob = PlacementProblem(parts, cluster, 4096, target, replicas=r)
            for t in cluster.types:
                n, time, _ = prob.stage(t.name, 0, 3)
                flops = sum(p.flops for p in parts) * 4096
                traffic = sum(p.memory_traffic for p in parts) * 4096
                grad = BYTES * sum(p.params for p in parts)
                want_t = (flops / t.flops + traffic / t.memory_bandwidth) / r + (2 * (r - 1) / r * grad / t.bandwidth)
                mem = STATE * BYTES * sum(p.params for p in parts) + BYTES * 4096 * sum(p.saved for p in parts) / r
                assert time == pytest.approx(want_t)
                assert (n == r) == (mem <= t.memory and want_t <= 4096 / target)
            pl = (cluster.types[0].name, cluster.types[1].name + "*", cluster.types[1].name + "*")
            ev = prob.evaluate(pl)
            if ev.feasible:
                assert all(n == r for _, _, n in ev.stages)
                assert ev.devices[cluster.types[1].name] == 2 * r <= cluster.types[1].count


def test_auto_placement_takes_the_cheapest_of_rl_and_exact():
    """The placement `ps_placement: auto` applies on a fast and a slow worker kind: both layers on
    one kind miss the target, so the layers are cut over the two kinds, the cheap slow kind taking
    the lighter layer; the exact search agrees."""
    from erniekit.distributed.ps.plan import auto_placement
    from erniekit.models.ernie4_5.configuration import get_preset

    fast = DeviceType("fast", 1, flops=1e9, memory=1e9, bandwidth=1e9, price_per_hour=2.0)
    slow = DeviceType("slow", 1, flops=0.8e9, memory=1e9, bandwidth=1e9, price_per_hour=1.0)
    config = get_preset("tiny-moe").replace(num_hidden_layers=2)
    auto = auto_placement(
        config, HeteroCluster([fast, slow]), seq_len=64, micro_batch=8, accum=1, replicas=1, servers=1, target=512.0
    )
    assert auto.stage_layers == [1, 1] and auto.stage_types == ["slow", "fast"] and auto.processes == 3
    assert auto.overrides()[:2] == ["pipeline_parallel_degree=2", "pipeline_stage_layers=[1,1]"]
    exact_row = next(r for r in auto.rows if r.name == "exact")
    assert auto.evaluation.cost_per_batch == pytest.approx(exact_row.evaluation.cost_per_batch)
    pairs = HeteroCluster([DeviceType("fast", 2, 1e9, 1e9, 1e9, 2.0), DeviceType("slow", 2, 0.8e9, 1e9, 1e9, 1.0)])
    two = auto_placement(config, pairs, 64, 8, 1, replicas=2, servers=1, target=600.0)
    # 1024 tokens a batch: two slow workers run both layers in 1.6 s, too slow for 600 tokens/s
    assert two.replicas == 2 and two.processes == 1 + 2 * len(two.stage_layers)
    assert two.evaluation.feasible and two.evaluation.throughput >= 600.0
    with pytest.raises(ConfigError, match="no placement fits the cluster's device counts with ps_stage_workers=3"):
        auto_placement(config, pairs, 64, 8, 1, replicas=3, servers=1, target=600.0)


def test_a_plan_takes_the_best_of_several_seeds_not_one_seeds_luck():
    """ERNIE-4.5-0.3B at 2e5 tokens/s on hetero-cpu-gpu.yaml (docs/ps.md): one RL run's cost spread
    1.41x over seeds 0-9, so `erniekit plan --mode ps` (seed 42) and the benchmark (seed 0) printed
    different placements; the search over SEARCH_SEEDS seeds finds the cheapest from either."""
    from erniekit.distributed.ps.cost_model import PlacementProblem, load_hetero_cluster
    from erniekit.distributed.ps.plan import model_parts
    from erniekit.distributed.ps.scheduler import SEARCH_SEEDS, greedy, rl_search
    from erniekit.models.ernie4_5 import get_preset

    cluster = load_hetero_cluster("examples/clusters/hetero-cpu-gpu.yaml")
    prob = PlacementProblem(model_parts(get_preset("ERNIE-4.5-0.3B"), 1024), cluster, 16 * 1024, 2e5)
    start = greedy(prob).placement
    single = [rl_search(prob, seed=s, warm_start=start, seeds=1).cost for s in range(SEARCH_SEEDS)]
    assert max(single) > 1.1 * min(single)  # one seed alone is luck
    for seed in (0, 42):
        assert rl_search(prob, seed=seed, warm_start=start).cost == pytest.approx(min(single), rel=1e-9)
