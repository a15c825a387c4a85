"""tools/profile_cluster.py: the step-cost fit recovers the constants that generated the steps it
is given, and the replicas' sum figures come from the shared-memory path."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from erniekit.distributed import planner as P
from erniekit.models.ernie4_5 import get_preset

ROOT = str(Path(__file__).resolve().parents[3])
sys.path.insert(0, os.path.join(ROOT, "tools"))

import _train_runs  # noqa: E402
import profile_cluster  # noqa: E402


@pytest.mark.parametrize("devices", [1, 2])
def test_fit_recovers_the_constants_behind_the_measured_steps(monkeypatch, tmp_path, devices):
    measured = P.Cluster(
        devices_per_node=devices,
        device_flops=2e11,
        intra_node_bandwidth=2e9,
        intra_node_latency_s=1e-4,
        host_sum_bandwidth=3e10,
        host_sum_latency_s=4e-6,
    )
    truth = dataclasses.replace(measured, op_overhead_s=2.5e-5, memory_bandwidth=7e9, spmd_op_overhead_s=3e-4)
    seen = []

    def fake_step(model, procs, overrides, steps, out, seq_len, threads):
        """What `erniekit train` would log if the planner were exact with `truth`."""
        assert model == "tiny-dense" and procs == devices and seq_len == 128
        stage = {"": 0, "stage1": 1}[overrides["sharding"]]
        mb = overrides["per_device_train_batch_size"]
        plan = P.Plan(devices, 1, 1, 1, stage, "none", mb, overrides["gradient_accumulation_steps"])
        seen.append(plan.describe())
        step = P.predict(get_preset(model), truth, P.Workload(mb * devices, seq_len), plan).step_s
        return {"step_s": step, "memory": 0}

    monkeypatch.setattr(_train_runs, "layout_step", fake_step)
    fitted, notes = profile_cluster.fit_step_costs(measured, devices, None, 5, str(tmp_path))
    assert fitted["op_overhead_s"] == pytest.approx(2.5e-5, rel=1e-6)
    assert fitted["memory_bandwidth"] == pytest.approx(7e9, rel=1e-6)
    if devices == 1:
        assert "spmd_op_overhead_s" not in fitted and len(seen) == 2
    else:  # the DistTensor run is the third: ZeRO-1 over the two ranks
        assert fitted["spmd_op_overhead_s"] == pytest.approx(3e-4, rel=1e-6)
        assert "zero1" in seen[2] and len(notes) == 3


def test_replicas_sum_is_timed_through_shared_memory(monkeypatch):
    """One rank (the group of one) still maps the file and times its sum; no file: no figures,
    so the planner keeps gloo's for the replicas too."""
    import paddle.distributed as dist

    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    from erniekit.distributed.collective import host_sum

    monkeypatch.setattr(host_sum.HostSum, "_broadcast", lambda self, path, token: (path, token))
    monkeypatch.setattr(host_sum.HostSum, "_all_ok", lambda self, ok: ok)
    got = profile_cluster._host_sum(1, 0, dist)
    if host_sum._kernel() is None:
        pytest.skip("no C compiler here: the host-sum kernel is not built")
    assert got["host_sum_bandwidth"] > 1e8 and 0 < got["host_sum_latency_s"] < 0.01
    monkeypatch.setenv("ERNIEKIT_HOST_SUM", "0")
    assert profile_cluster._host_sum(1, 0, dist) == {}
