"""Cross-cluster planner: the sites file and its errors, the step-time formulas on hand-computed
cases, the recommendation, the trainable-parameter counts and `erniekit plan CONFIG sites=FILE`."""

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest

from erniekit.cli import main
from erniekit.distributed import planner as P
from erniekit.distributed.cross_cluster import plan as X
from erniekit.distributed.cross_cluster.link import frame_bytes
from erniekit.errors import ConfigError
from erniekit.models.ernie4_5 import get_preset

ROOT = str(Path(__file__).resolve().parents[3])
NODE = P.Cluster(nodes=1, devices_per_node=2, intra_node_bandwidth=1e9, intra_node_latency_s=1e-4)
PLAN = P.Plan(2, 1, 1, 1, 0, "none", 8, 1)
JOB = X.Job(get_preset("tiny-dense"), P.Workload(16, 32), PLAN, rank_trainable=1_000_000)  # chunk 500_000


def _sites(n=2, per_rank_pair=True, mbit=80.0, ms=20.0):
    """80 Mbit/s = 1e7 bytes/s."""
    return X.Sites("t", tuple(X.Site(f"s{i}", NODE) for i in range(n)), X.Link(mbit, ms, per_rank_pair))


GATHER = 1e-4 + 1 * 500_000 * 4 / 1e9  # ring all-gather of 2 chunks on the site's link
WIRE = frame_bytes("sync", 0)  # the link's header and MACs per message


def test_gradients_mode_sends_four_bytes_per_chunk_element_every_step():
    r = X.predict_cross_cluster(JOB, _sites(), mode="gradients", overlap_steps=3, measured_step_s=1.0)
    assert r.chunk == 500_000 and r.payload_bytes == 4 * r.chunk
    assert r.bytes_per_step == 4 * r.chunk + WIRE
    sync = 0.02 + (2_000_000 + WIRE) / 1e7
    assert r.sync_s == pytest.approx(sync) and r.hidden_s == 0  # nothing overlaps the optimizer's wait
    assert r.step_s == pytest.approx(1.0 + sync + GATHER)
    assert r.tokens_per_s == pytest.approx(2 * 16 * 32 / r.step_s)
    assert r.sync_fraction == pytest.approx((sync + GATHER) / r.step_s)


def test_local_mode_pays_the_compressed_payload_once_per_interval_less_the_overlap():
    rows = math.ceil(500_000 / 1024)
    int8 = 13 + 500_000 + 4 * rows  # compress.py header, int8 values, a float32 scale per row
    r = X.predict_cross_cluster(JOB, _sites(), 4, "int8", mode="local", measured_step_s=1.0)
    sync = 0.02 + (int8 + WIRE) / 1e7
    assert r.payload_bytes == int8 and r.sync_s == pytest.approx(sync)
    assert r.step_s == pytest.approx(1.0 + (sync + GATHER) / 4)
    assert r.bytes_per_step == pytest.approx((int8 + WIRE) / 4)

    topk = 13 + rows * 11 * (4 + 2)  # k = ceil(0.01 x 1024) float32 values + uint16 indices per row
    r = X.predict_cross_cluster(JOB, _sites(), 8, "topk", 0.01, "local", overlap_steps=1, measured_step_s=0.005)
    sync = 0.02 + (topk + WIRE) / 1e7
    assert r.payload_bytes == topk and r.hidden_s == pytest.approx(0.005)
    assert r.step_s == pytest.approx(0.005 + (sync - 0.005 + GATHER) / 8)
    # overlap hides at most the whole exchange
    r = X.predict_cross_cluster(JOB, _sites(), 8, "topk", 0.01, "local", overlap_steps=2, measured_step_s=1.0)
    assert r.hidden_s == pytest.approx(sync) and r.step_s == pytest.approx(1.0 + GATHER / 8)


def test_a_shared_link_carries_every_rank_to_every_other_site():
    r = X.predict_cross_cluster(JOB, _sites(3, per_rank_pair=False), mode="gradients", measured_step_s=1.0)
    assert r.sync_s == pytest.approx(0.02 + 2 * 2 * (2_000_000 + WIRE) / 1e7)  # 2 ranks x 2 other sites
    assert r.bytes_per_step == 2 * (2_000_000 + WIRE) and r.site_bytes_per_step == 2 * r.bytes_per_step
    assert r.tokens_per_s == pytest.approx(3 * 16 * 32 / r.step_s)


def test_intra_step_is_the_slowest_sites_prediction_unless_measured():
    slow = P.Cluster(nodes=1, devices_per_node=2, device_flops=1e9)
    sites = X.Sites("t", (X.Site("fast", NODE), X.Site("slow", slow)), X.Link(80, 20))
    r = X.predict_cross_cluster(JOB, sites, 4, "int8")
    assert r.slowest_site == "slow"
    assert r.intra_s == pytest.approx(P.predict(JOB.model, slow, JOB.work, PLAN).step_s)
    m = X.predict_cross_cluster(JOB, sites, 4, "int8", measured_step_s=0.3)
    assert m.intra_s == 0.3 and m.parts["predicted_intra_s"] == pytest.approx(r.intra_s)


@pytest.mark.parametrize("kind", X.KINDS)
def test_a_bigger_interval_never_predicts_more_bytes_or_time_per_step(kind):
    preds = [X.predict_cross_cluster(JOB, _sites(), h, kind, 0.05, overlap_steps=1) for h in X.INTERVALS]
    for a, b in zip(preds, preds[1:]):
        assert b.bytes_per_step < a.bytes_per_step and b.step_s <= a.step_s


def _meets_fraction(r, f):
    return r.sync_fraction <= f


def _before(r, c) -> bool:
    """r comes before c in the recommendation's order: dense codecs (none < int8) at every interval, smallest
    interval first, then top-k (adaptive.DENSE)."""
    return (r.compress == "topk", r.sync_every, X.KINDS.index(r.compress)) < (
        c.compress == "topk",
        c.sync_every,
        X.KINDS.index(c.compress),
    )


@pytest.mark.parametrize("fraction", [0.3, 0.1, 0.02])
def test_recommendation_is_the_smallest_interval_then_least_lossy_compression_meeting_the_fraction(fraction):
    rec = X.recommend(JOB, _sites(), fraction, measured_step_s=0.5)
    c = rec.choice
    assert c is not None and c.sync_fraction <= fraction and c.mode == "local"
    for r in rec.table[1:]:
        if _before(r, c):
            assert r.sync_fraction > fraction, r.describe()
    assert rec.table[0].mode == "gradients" and len(rec.table) == 1 + len(X.INTERVALS) * len(X.KINDS)


def test_recommendation_for_a_tokens_per_s_target_and_when_nothing_meets_it():
    gradients = X.predict_cross_cluster(JOB, _sites(), mode="gradients", measured_step_s=0.5)
    want = 1.3 * gradients.tokens_per_s  # of at most 0.72 / 0.5 = 1.44 without any sync
    rec = X.recommend(JOB, _sites(), None, want, measured_step_s=0.5)
    assert rec.choice.tokens_per_s >= want
    assert all(r.tokens_per_s < want for r in rec.table[1:] if _before(r, rec.choice))
    ceiling = 2 * 16 * 32 / 0.5  # no sync at all
    rec = X.recommend(JOB, _sites(), None, ceiling * 1.01, measured_step_s=0.5)
    assert rec.choice is None and "no interval up to 256" in rec.why and "\n" not in rec.why
    with pytest.raises(ConfigError, match="one target"):
        X.recommend(JOB, _sites(), 0.1, 1000.0)


@pytest.mark.parametrize("n,shared,bandwidth", [(2, False, 1e7), (3, True, 1e7 / 2)])
def test_adaptive_predicts_what_the_runs_adaptive_choice_picks(n, shared, bandwidth):
    """The run's chooser sees one rank's share of the link (a shared link: / the site's 2 ranks)."""
    from erniekit.distributed.cross_cluster import adaptive

    want = adaptive.choose(0.5, 500_000, bandwidth, 0.02, 0.05, 1, topk_ratio=0.1, n_clusters=n)
    sites = _sites(n, per_rank_pair=not shared)
    r = X.predict_cross_cluster(
        JOB, sites, compress="adaptive", overlap_steps=1, max_sync_fraction=0.05, measured_step_s=0.5
    )
    assert (r.sync_every, r.compress, r.overlap_steps) == (want.interval, want.kind, 1) and want.meets
    with pytest.raises(ConfigError, match="cross_cluster_overlap_steps=5"):
        X.predict_cross_cluster(JOB, _sites(), 4, "int8", overlap_steps=5)


# ---- the sites file --------------------------------------------------------------------------
def test_example_sites_files_load():
    local = X.load_sites(os.path.join(ROOT, "examples/clusters/two_sites.yaml"))
    assert [s.name for s in local.sites] == ["site-a", "site-b"] and local.world == 2
    assert local.link == X.Link(100.0, 50.0, False)  # the emulation shares a link per direction
    assert local.sites[0].cluster == P.load_cluster(os.path.join(ROOT, "examples/clusters/cpu-2core.yaml"))
    gpu = X.load_sites(os.path.join(ROOT, "examples/clusters/two_sites_gpu.yaml"))
    assert gpu.world == 8 and gpu.link.bandwidth_bytes_s == 1.25e8 and gpu.sites[1].cluster.device_flops == 1.5e14


GOOD_SITE = "  - name: a\n    cluster: {devices_per_node: 2}\n  - name: b\n    cluster: {devices_per_node: 2}\n"
LINK = "link: {bandwidth_mbit: 100, latency_ms: 50}\n"


@pytest.mark.parametrize(
    "text,where",
    [
        ("sites:\n" + GOOD_SITE, "link: must be a mapping"),
        ("link: {bandwidth_mbit: 100}\nsites:\n" + GOOD_SITE, "link.latency_ms is missing"),
        ("link: {bandwidth_mbit: -1, latency_ms: 5}\nsites:\n" + GOOD_SITE, "link.bandwidth_mbit=-1 must be"),
        ("link: {bandwidth_mbit: fast, latency_ms: 5}\nsites:\n" + GOOD_SITE, "link.bandwidth_mbit='fast'"),
        ("link: {bandwidth_mbit: 1, latency_ms: 5, mtu: 9000}\nsites:\n" + GOOD_SITE, "link: unknown key 'mtu'"),
        (LINK + "sites:\n  - name: a\n    cluster: {devices_per_node: 2}\n", "at least 2 sites"),
        (LINK + "sites:\n" + GOOD_SITE + "  - cluster: {devices_per_node: 2}\n", "sites[2].name is missing"),
        (LINK + "sites:\n" + GOOD_SITE + "  - name: a\n    cluster: {devices_per_node: 2}\n", "sites[2].name='a'"),
        (LINK + "sites:\n" + GOOD_SITE + "  - name: c\n    cluster: {devices_per_node: 4}\n", "sites[2].cluster has 4"),
        (
            LINK + "sites:\n" + GOOD_SITE + "  - name: c\n    cluster: {gpus: 2}\n",
            "sites[2].cluster: unknown key 'gpus'",
        ),
        (
            LINK + "sites:\n" + GOOD_SITE + "  - name: c\n    cluster: {nodes: 1.5}\n",
            "sites[2].cluster: nodes=1.5 must be an integer",
        ),
        (LINK + "sites:\n" + GOOD_SITE + "  - name: c\n    cluster: nowhere.yaml\n", "nowhere.yaml"),
        (LINK + "sites:\n" + GOOD_SITE + "  - name: c\n    where: x\n", "sites[2]: unknown key 'where'"),
        (LINK + "sites: [a, b", "sites.yaml:2: not valid YAML"),
        (LINK + "clusters: []\n", "unknown key 'clusters'"),
    ],
)
def test_bad_sites_files_get_one_line_errors_naming_the_key(tmp_path, text, where):
    f = tmp_path / "sites.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        X.load_sites(str(f))
    msg = str(e.value)
    assert where in msg and str(f) in msg and "\n" not in msg


def test_a_site_cluster_path_is_relative_to_the_sites_file(tmp_path):
    (tmp_path / "node.yaml").write_text("devices_per_node: 4\ndevice_flops: 1.0e12\n")
    (tmp_path / "sites.yaml").write_text(
        LINK + "sites:\n  - {name: a, cluster: node.yaml}\n  - {name: b, cluster: node.yaml}\n"
    )
    s = X.load_sites(str(tmp_path / "sites.yaml"))
    assert s.world == 4 and s.sites[1].cluster.device_flops == 1e12


# ---- what a rank syncs ------------------------------------------------------------------------
def test_job_from_config_syncs_the_rank_parameters_or_only_the_adapters():
    from erniekit.config import load_config

    sites = X.load_sites(os.path.join(ROOT, "examples/clusters/two_sites.yaml"))
    base = ["model_name_or_path=tiny-moe", "per_device_train_batch_size=4", "max_seq_len=64"]
    full = X.job_from_config(load_config(None, base), sites.sites[0].cluster)
    c = get_preset("tiny-moe")
    # every parameter but the routers' correction biases (never trained; moe_bias_update_rate is 0 here)
    trained = P.predict(c, sites.sites[0].cluster, full.work, full.plan).parts["trainable_params"]
    assert full.plan.dp == 2 and full.rank_trainable == trained == P.param_counts(c).total - 24
    # the site's workload is the stage's, on the site's device kind: SFT on CPUs takes the chunked head
    assert full.work == P.Workload(8, 64, replicas=True, fused_head=True)
    gpu_site = dataclasses.replace(sites.sites[0].cluster, device="gpu")
    assert X.job_from_config(load_config(None, base), gpu_site).work == P.Workload(8, 64, fused_attention=True)
    dpo = X.job_from_config(load_config(None, base + ["stage=DPO"]), sites.sites[0].cluster)
    assert not dpo.work.replicas and not dpo.work.fused_head
    # LoRA syncs the adapters only: the planner's count of what apply_lora builds (tests/unit/distributed/
    # test_lora_cost.py checks it against built models), in any spelling, for any target modules
    from erniekit.distributed.lora_cost import count_adapters

    lora = X.job_from_config(load_config(None, base + ["fine_tuning=lora", "lora_rank=4"]), sites.sites[0].cluster)
    assert lora.rank_trainable == count_adapters(c, 4).params < full.rank_trainable / 10
    q_only = base + ["fine_tuning=LoRA", "lora_rank=4", "lora_target_modules=.*q_proj"]
    q = X.job_from_config(load_config(None, q_only), sites.sites[0].cluster)
    assert q.rank_trainable == count_adapters(c, 4, [".*q_proj"]).params < lora.rank_trainable
    with pytest.raises(ConfigError, match="matches no module"):
        X.job_from_config(load_config(None, [*q_only, "lora_target_modules=.*nothing"]), sites.sites[0].cluster)


def test_local_sync_moves_the_router_biases_the_sites_update_as_the_runner_sends_them():
    """moe_bias_update_rate > 0: each site moves its routers' e_score_correction_bias by its own loads
    and the runner's local sync averages them with the trainable parameters (`_synced_tensors`); the
    plan's chunk is the vector the runner builds, split over the dp replicas (tp: the biases whole
    on every rank). Gradients mode (which the runner refuses with biases that move) sums gradients only."""
    import types

    import numpy as np

    from erniekit.config import load_config
    from erniekit.distributed.cross_cluster.compress import FlatCompressor
    from erniekit.models.registry import load_model
    from erniekit.train.runners.cross_cluster import CrossClusterRunner, FlatParams

    sites = X.load_sites(os.path.join(ROOT, "examples/clusters/two_sites.yaml"))
    base = ["model_name_or_path=tiny-moe", "per_device_train_batch_size=4", "max_seq_len=64"]
    rate = ["model_overrides.moe_bias_update_rate=0.01"]
    model = load_model("tiny-moe", {"moe_bias_update_rate": 0.01})
    trainer = types.SimpleNamespace(model=model, params=[p for p in model.parameters() if not p.stop_gradient])
    runner = CrossClusterRunner.__new__(CrossClusterRunner)
    runner.mode = "local"
    sent = FlatParams(runner._synced_tensors(trainer)).n  # what one rank of a whole-model replica syncs
    trained = sum(int(p.numel()) for p in trainer.params)
    assert sent == trained + 3 * 8  # 3 MoE layers' 8 biases
    for extra, dp, biases in (([], 2, 24), (["tensor_parallel_degree=2"], 1, 24), ([], 2, 0)):
        job = X.job_from_config(load_config(None, base + extra + (rate if biases else [])), sites.sites[0].cluster)
        assert job.plan.dp == dp and job.rank_frozen_synced == biases
        for kind in ("none", "int8"):
            local = X.predict_cross_cluster(job, sites, 4, kind, mode="local", measured_step_s=1.0)
            assert local.chunk == math.ceil((job.rank_trainable + biases) / dp)
        if biases:  # refused as the runner refuses it, with its line
            with pytest.raises(ConfigError, match=re.escape(X.BIASES_WITH_GRADIENTS)):
                X.predict_cross_cluster(job, sites, mode="gradients", measured_step_s=1.0)
        else:
            grads = X.predict_cross_cluster(job, sites, mode="gradients", measured_step_s=1.0)
            assert grads.chunk == math.ceil(job.rank_trainable / dp)
    runner.mode = "gradients"
    with pytest.raises(ConfigError, match=re.escape(X.BIASES_WITH_GRADIENTS)):
        runner._synced_tensors(trainer)
    moving = X.job_from_config(load_config(None, base + rate), sites.sites[0].cluster)
    rec = X.recommend(moving, sites, measured_step_s=1.0)  # recommends among local syncs only
    assert rec.table and all(r.mode == "local" for r in rec.table)
    assert [
        r.mode for r in X.recommend(X.job_from_config(load_config(None, base), sites.sites[0].cluster), sites).table
    ][0] == "gradients"
    one = X.job_from_config(load_config(None, base + rate), sites.sites[0].cluster)
    for kind in ("none", "int8"):  # the payload the runner's codec makes of its chunk
        r = X.predict_cross_cluster(one, sites, 4, kind, mode="local")
        chunk = -(-sent // 2)  # CrossClusterRunner.bind: each of the 2 replicas' share
        assert r.chunk == chunk and r.payload_bytes == len(FlatCompressor(kind, chunk).encode(np.zeros(chunk)))


# ---- the CLI ----------------------------------------------------------------------------------
def test_plan_cli_prints_the_config_prediction_and_the_recommendation_table(tmp_path, capsys):
    out = tmp_path / "cc.json"
    sft = os.path.join(ROOT, "examples/configs/tiny/sft.yaml")
    sites = os.path.join(ROOT, "examples/clusters/two_sites.yaml")
    args = ["plan", sft, f"sites={sites}", "cross_cluster_sync_every=8", "cross_cluster_compress=topk"]
    rc = main(args + ["cross_cluster_max_sync_fraction=0.05", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "config: local every 8, topk 0.1:" in text
    assert "recommended for visible sync at most 5% of the step" in text
    assert text.count("local every") == 1 + len(X.INTERVALS) * len(X.KINDS) + 1  # config, table, recommendation
    starred = [line for line in text.splitlines() if line.startswith("  * ")]
    rec = json.loads(out.read_text())
    assert len(starred) == 1 and rec["recommended"]["sync_every"] == int(starred[0].split()[3].rstrip(","))
    assert rec["recommended"]["step_s"] <= rec["config"]["step_s"] * 10 and len(rec["table"]) == 28
    # a tokens/s target nothing reaches: the table, a one-line reason, exit status 1
    rc = main(["plan", sft, "--sites", sites, "--target", "1e12", "--measured-step-s", "0.2"])
    text = capsys.readouterr().out
    assert rc == 1 and "recommended: none; no interval up to 256" in text and "gradients every step" in text
    assert main(["plan", sft, "sites=nowhere.yaml"]) == 2
    assert "sites file nowhere.yaml" in capsys.readouterr().err


def test_plan_refuses_sites_of_different_device_kinds_in_one_line(tmp_path, capsys):
    """One job is predicted on every site, so a CPU site beside a GPU site is refused, not planned
    with the first site's rules."""
    (tmp_path / "cpu.yaml").write_text("devices_per_node: 2\ndevice_flops: 1.0e11\ndevice: cpu\n")
    (tmp_path / "gpu.yaml").write_text("devices_per_node: 2\ndevice_flops: 1.0e14\ndevice: gpu\n")
    sites = tmp_path / "sites.yaml"
    sites.write_text(LINK + "sites:\n  - {name: a, cluster: cpu.yaml}\n  - {name: b, cluster: gpu.yaml}\n")
    sft = os.path.join(ROOT, "examples/configs/tiny/sft.yaml")
    assert main(["plan", sft, f"sites={sites}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mix device kinds (cpu, gpu)" in err and len(err.splitlines()) == 1
