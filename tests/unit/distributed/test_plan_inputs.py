"""`erniekit plan` on bad inputs: huge or non-finite cluster figures, unwritable --json paths,
malformed YAML in --mode ps, training-config values train refuses, --top below 1. Each is one
line and exit status 2, before any table is printed."""

import json
import math
from pathlib import Path

import pytest

from erniekit.cli import main
from erniekit.config import load_config, validate
from erniekit.distributed import planner as P
from erniekit.distributed.cross_cluster import plan as cc
from erniekit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SFT = str(ROOT / "examples/configs/tiny/sft.yaml")
CPU_2CORE = (ROOT / "examples/clusters/cpu-2core.yaml").read_text()
HETERO = str(ROOT / "examples/clusters/hetero-cpu-gpu.yaml")


def _cluster(tmp_path, **changes) -> str:
    """A copy of examples/clusters/cpu-2core.yaml with `changes` (YAML text) in place of its keys."""
    lines = [line for line in CPU_2CORE.splitlines() if line.split(":")[0] not in changes]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines + [f"{k}: {v}" for k, v in changes.items()]) + "\n")
    return str(path)


def _one_line_error(capsys, argv) -> str:
    """Run the CLI; it must exit 2 with one error line and print nothing else (no table)."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), (out, err)
    return err


# ---- P1: a huge device count is refused, and the divisor search is O(sqrt(n)) -----------------
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"nodes": "1e12"}, "nodes=1000000000000 x devices_per_node=2"),
        ({"devices_per_node": "2000000"}, "devices_per_node=2000000"),
        ({"nodes": "1024", "devices_per_node": "1025"}, "= 1049600 devices"),
        ({"nodes": "1" + "0" * 400}, "nodes=1.0e+400"),
    ],
)
def test_a_cluster_of_more_devices_than_the_planner_takes_is_one_line(tmp_path, capsys, changes, words):
    path = _cluster(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:  # (before the fix: taken, then minutes of enumeration)
        P.load_cluster(path)
    assert (
        str(e.value).startswith(f"{path}: ")
        and words in str(e.value)
        and f"more than the {P.MAX_WORLD}" in str(e.value)
    )
    assert _one_line_error(capsys, ["plan", SFT, f"cluster={path}", "--top", "2"]) == f"error: {e.value}\n"
    assert P.MAX_WORLD == 2**20
    P.load_cluster(_cluster(tmp_path, nodes="1024", devices_per_node="1024"))  # the cap itself is taken


class _Bounded:
    """`range` for the planner's module that refuses to scan more than `most` candidates."""

    def __init__(self, most: int):
        self.most, self.longest = most, 0

    def __call__(self, *args):
        r = range(*args)
        self.longest = max(self.longest, len(r))
        assert len(r) <= self.most, f"scans {len(r)} candidates (range{args})"
        return r


def test_divisors_are_found_in_sqrt_n_steps(monkeypatch):
    bounded = _Bounded(10**6)
    monkeypatch.setattr(P, "range", bounded, raising=False)
    getattr(P._divisors, "cache_clear", lambda: None)()
    assert list(P._divisors(10**12)) == sorted({2**a * 5**b for a in range(13) for b in range(13)})
    assert bounded.longest <= math.isqrt(10**12)
    for n in [*range(1, 300), 720720, 2**20, 999983 * 2]:
        assert list(P._divisors(n)) == [d for d in range(1, n + 1) if n % d == 0], n


def test_a_100000_device_cluster_plans_without_scanning_the_batch(tmp_path, monkeypatch):
    """The 100000 data ranks' global batch is 6.4M rows: its divisors come from a sqrt(n) scan."""
    cfg = load_config(SFT, [])
    cluster = P.load_cluster(_cluster(tmp_path, devices_per_node="100000"))
    work = P.workload_from_config(cfg, cluster.world, cluster.device)
    assert work.global_batch == 64 * 100000
    bounded = _Bounded(10**4)
    monkeypatch.setattr(P, "range", bounded, raising=False)
    getattr(P._divisors, "cache_clear", lambda: None)()
    preds = P.plan(P.model_config_of(cfg), cluster, work)
    assert preds[0].fits and preds[0].plan.dp * preds[0].plan.tp * preds[0].plan.pp == 100000


# ---- P2: non-finite and out-of-range cluster figures ------------------------------------------
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"nodes": ".inf"}, "nodes=inf must be an integer"),
        ({"devices_per_node": ".nan"}, "devices_per_node=nan must be an integer"),
        ({"device_flops": ".inf"}, "device_flops=inf must be a finite number"),
        ({"device_memory": "-.inf"}, "device_memory=-inf must be a finite number"),
        ({"intra_node_bandwidth": ".nan"}, "intra_node_bandwidth=nan must be a finite number"),
        ({"memory_bandwidth": "1" + "0" * 400}, "memory_bandwidth=1.0e+400 must be a finite number"),
        ({"device_flops": "1.0e-300"}, "device_flops=1e-300 is out of range"),
        ({"op_overhead_s": "1.0e+300"}, "op_overhead_s=1e+300 is out of range"),
        ({"device_flops": "0"}, "device_flops=0 must be > 0"),
        ({"inter_node_latency_s": "-1.0e-5"}, "inter_node_latency_s=-1e-05 must be > 0"),
    ],
)
def test_non_finite_or_out_of_range_cluster_figures_are_one_line(tmp_path, capsys, changes, words):
    path = _cluster(tmp_path, **changes)
    err = _one_line_error(capsys, ["plan", SFT, f"cluster={path}", "--top", "2"])
    assert f"{path}: {words}" in err


def test_figures_at_the_range_bounds_and_zero_where_it_means_none_are_taken(tmp_path):
    c = P.load_cluster(
        _cluster(tmp_path, device_flops="1.0e+21", op_overhead_s="1.0e-12", host_sum_bandwidth="0", nodes="2.0")
    )
    assert (c.device_flops, c.op_overhead_s, c.host_sum_bandwidth, c.world) == (1e21, 1e-12, 0.0, 4)


def test_a_sites_files_link_takes_finite_figures_only(tmp_path):
    sites = tmp_path / "s.yaml"
    for link, words in (
        ("{bandwidth_mbit: .inf, latency_ms: 5}", "bandwidth_mbit"),
        ("{bandwidth_mbit: 100, latency_ms: .nan}", "latency_ms"),
    ):
        sites.write_text(
            f"link: {link}\nsites:\n  - {{name: a, cluster: {{devices_per_node: 2}}}}\n"
            "  - {name: b, cluster: {devices_per_node: 2}}\n"
        )
        with pytest.raises(ConfigError, match=f"link.{words}=.* must be a finite number") as e:
            cc.load_sites(str(sites))
        assert "\n" not in str(e.value)


# ---- P3: --json PATH that cannot be written ---------------------------------------------------
def test_an_unwritable_json_path_is_refused_before_the_table(tmp_path, capsys):
    cluster = _cluster(tmp_path)
    err = _one_line_error(capsys, ["plan", SFT, f"cluster={cluster}", "--json", str(tmp_path)])
    assert f"--json {tmp_path}: is a directory" in err
    missing = tmp_path / "no" / "plans.json"
    err = _one_line_error(capsys, ["plan", SFT, f"cluster={cluster}", "--json", str(missing)])
    assert f"directory {tmp_path / 'no'} does not exist" in err
    err = _one_line_error(capsys, ["plan", "--mode", "ps", HETERO, "--json", str(tmp_path)])
    assert "is a directory" in err
    assert not missing.parent.exists()


# ---- P4: --mode ps on malformed YAML ------------------------------------------------------------
def test_plan_mode_ps_names_a_malformed_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_types:\n  - {name: cpu, count: [1\n")
    for argv in (["plan", "--mode", "ps", str(bad)], ["plan", "--mode", "ps", f"cluster={bad}"]):
        err = _one_line_error(capsys, argv)
        assert f"{bad}:3: not valid YAML" in err
    err = _one_line_error(capsys, ["plan", "--mode", "ps", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: No such file or directory" in err


# ---- P5: the training config's values, as train checks them -----------------------------------
@pytest.mark.parametrize(
    "override",
    [
        "per_device_train_batch_size=-4",
        "gradient_accumulation_steps=0",
        "max_seq_len=0",
        "tensor_parallel_degree=0",
        "learning_rate=.nan",
    ],
)
def test_plan_refuses_the_config_values_train_refuses(tmp_path, capsys, monkeypatch, override):
    monkeypatch.chdir(ROOT)  # the config's dataset paths, which validate checks, start at the repository
    with pytest.raises(ConfigError) as train_error:  # what `erniekit train` says
        validate(load_config(SFT, [override, f"output_dir={tmp_path / 'out'}"]))
    cluster = _cluster(tmp_path)
    err = _one_line_error(capsys, ["plan", SFT, f"cluster={cluster}", override])
    assert err == f"error: {train_error.value}\n"
    assert _one_line_error(capsys, ["plan", "--mode", "ps", HETERO, SFT, override]) == err


def test_plan_does_not_need_the_data_or_a_local_gpu(tmp_path, capsys):
    """What validate also checks but a plan does not read: the dataset files, this machine's GPU."""
    cluster = _cluster(tmp_path, device="gpu")
    argv = ["plan", SFT, f"cluster={cluster}", f"train_dataset_path={tmp_path / 'elsewhere.jsonl'}", "bf16=true"]
    assert main([*argv, "--top", "1"]) == 0
    assert "1 x 2 gpu devices" in capsys.readouterr().out


# ---- P6: --top ----------------------------------------------------------------------------------
@pytest.mark.parametrize("top", ["-1", "0"])
def test_top_below_one_is_refused(tmp_path, capsys, top):
    err = _one_line_error(capsys, ["plan", SFT, f"cluster={_cluster(tmp_path)}", "--top", top])
    assert f"--top {top} must be >= 1" in err
    assert f"--top {top} must be >= 1" in _one_line_error(capsys, ["plan", "--mode", "ps", HETERO, "--top", top])


def test_top_one_prints_one_row_and_counts_the_rest(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert main(["plan", SFT, f"cluster={_cluster(tmp_path)}", "--top", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    n = len(json.loads(out.read_text()))
    assert n > 1 and text.count("dp=") == 1 and f"... {n - 1} more (--top N)" in text


@pytest.mark.parametrize(
    "old, new, words",
    [
        ("count: 16", "count: .inf", "device_types[0].count=inf must be a positive finite number"),
        ("count: 16", "count: 2.5", "device_types[0].count=2.5 must be a whole number up to 2**20"),
        ("count: 16", "count: 1e12", "must be a whole number up to 2**20"),
    ],
)
def test_a_heterogeneous_cluster_takes_finite_whole_counts(tmp_path, old, new, words):
    """`count: .inf` was an OverflowError traceback; a flops of inf planned a table of nonsense."""
    from erniekit.distributed.ps.cost_model import load_hetero_cluster

    text = (Path(__file__).resolve().parents[3] / "examples" / "clusters" / "hetero-cpu-gpu.yaml").read_text()
    assert old in text
    f = tmp_path / "c.yaml"
    f.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as e:
        load_hetero_cluster(str(f))
    assert words in str(e.value) and "\n" not in str(e.value)
