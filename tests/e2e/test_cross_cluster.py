"""Training across clusters over a link (docs/cross_cluster.md) through the CLI: two clusters on this
machine, each its own `erniekit train` job, joined by the authenticated cross-cluster link."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import concurrently, free_port, head_of, train
from safetensors.numpy import load_file

from erniekit.distributed.cross_cluster.compress import payload_nbytes
from erniekit.distributed.cross_cluster.link import frame_bytes

pytestmark = pytest.mark.e2e

ROOT = str(Path(__file__).resolve().parents[2])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic", "train.jsonl")


def _args(out, steps=8, batch=8, **extra):
    args = [
        "model_name_or_path=tiny-dense",
        "model_overrides.num_hidden_layers=2",
        f"train_dataset_path={head_of(DATA, 2000)}",
        "max_seq_len=32",
        f"per_device_train_batch_size={batch}",
        f"max_steps={steps}",
        "learning_rate=3e-3",
        "warmup_steps=2",
        "logging_steps=1",
        "do_eval=false",
        "save_steps=4",
        "disable_tqdm=true",
        f"output_dir={out}",
    ]
    return args + [f"{k}={v}" for k, v in extra.items()]


def _run(args):
    """`erniekit train ARGS` at 1 OpenMP thread, which must succeed (launched_jobs.train)."""
    return train(args, ROOT, timeout=300)


def _start(cmd):
    """A site's `erniekit train` in the background, its output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    by_step = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    return np.array([by_step[s] for s in sorted(by_step)])


def _weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def _n_params(out):
    return sum(v.size for v in _weights(out).values())


def test_gradients_mode_is_one_data_parallel_job(tmp_path):
    """Two clusters summing gradients over the link train exactly as one process on their global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    concurrently(
        lambda: _run(_args(one, batch=8)),
        lambda: _run(_args(two, batch=4, cross_cluster_sizes="[1,1]", cross_cluster_sync="gradients")),
    )
    np.testing.assert_allclose(_losses(two), _losses(one), rtol=0, atol=2e-5)
    np.testing.assert_allclose(_losses(two / "cluster-1"), _losses(one), rtol=0, atol=2e-5)
    a, b = _weights(one), _weights(two)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5, err_msg=k)
    res = json.loads((two / "train_results.json").read_text())["cross_cluster"]
    gradient = frame_bytes("grad/1", 4 * (_n_params(one) + 2))  # every gradient and the two loss sums
    assert res["sync"] == "gradients" and res["steps"] == 8
    assert gradient <= res["bytes_sent_per_step"] < gradient * 1.02  # + the handshake, once


def test_local_sync_keeps_the_clusters_identical_and_resumes_from_a_common_checkpoint(tmp_path):
    out = tmp_path / "local"
    sync = dict(cross_cluster_sizes="[1,1]", cross_cluster_sync_every=4, cross_cluster_compress="int8")
    r = _run(_args(out, steps=12, **sync))
    a, b = _weights(out), _weights(out / "cluster-1")
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the final sync: bit-identical models
    assert not np.array_equal(_losses(out), _losses(out / "cluster-1"))  # different rows between syncs
    res = json.loads((out / "train_results.json").read_text())["cross_cluster"]
    per_sync = frame_bytes("outer/4", payload_nbytes("int8", _n_params(out), 0.1))
    assert res["syncs"] == 3 and per_sync * 3 / 12 <= res["bytes_sent_per_step"] < per_sync * 3 / 12 * 1.05
    for d in (out, out / "cluster-1"):  # the sync state of each checkpoint (written at a sync)
        assert sorted(os.listdir(d / "cross_cluster_state")) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert "emulated link" not in r.stdout
    # cluster 1 lost its newest checkpoint: both resume from the newest one they both hold
    import shutil

    shutil.rmtree(out / "cluster-1" / "checkpoint-12")
    r = _run(_args(out, steps=16, resume_from_checkpoint="auto", **sync))
    assert r.stdout.count("resumed from") == 2 and "checkpoint-8 at step 8" in r.stdout
    a, b = _weights(out), _weights(out / "cluster-1")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_pipeline_lora_with_a_stage_that_holds_no_adapter(tmp_path):
    """LoRA on layers 2-3 of a 4-layer model at pp=2: stage 0 has nothing to train, yet its rank takes part in
    every sync with an empty payload (it once stopped at start-up), and the clusters end with the same adapter."""
    out = tmp_path / "pp-lora"
    extra = dict(cross_cluster_sizes="[2,2]", cross_cluster_sync_every=2, cross_cluster_compress="int8")
    _run(
        _args(out, steps=4, batch=4, nproc_per_node=2, pipeline_parallel_degree=2, fused_head_loss="false", **extra)
        + [
            "model_overrides.num_hidden_layers=4",
            "fine_tuning=LoRA",
            r"lora_target_modules=model\.layers\.[23]\..*_proj",
        ]
    )
    a, b = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (out, out / "cluster-1"))
    assert a and all(".layers.2." in k or ".layers.3." in k for k in a)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the final sync: the same adapter in both clusters
    assert json.loads((out / "train_results.json").read_text())["cross_cluster"]["syncs"] == 2
    state = out / "cross_cluster_state" / "checkpoint-4"
    sizes = [load_file(str(state / f"rank-{r}.safetensors"))["residual"].size for r in (0, 1)]
    assert sizes[0] == 0 and sizes[1] > 0  # stage 0 synced nothing, stage 1 its adapters


def _site(out, cid, peers, key_file, steps, **extra):
    args = _args(
        out,
        steps=steps,
        batch=4,
        cross_cluster_id=cid,
        cross_cluster_peers=f"[{','.join(peers)}]",
        cross_cluster_key_file=key_file,
        **{"cross_cluster_sync_every": 2, **extra},
    )
    return [sys.executable, "-m", "erniekit", "train", *args]


def _key(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_a_lost_cluster_stops_the_other_with_one_line_and_both_resume(tmp_path):
    """Two sites started by hand (cross_cluster_id / peers, a key file): killing one stops the other
    at its next sync, naming the peer; started again, both resume from the checkpoint both hold."""
    key = _key(tmp_path / "cc.key", "k" * 40)
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    outs = [tmp_path / "site0", tmp_path / "site1"]
    slow = dict(cross_cluster_link_latency_ms=150)  # each sync waits: the kill lands mid-run
    procs = [_start(_site(outs[c], c, peers, key, 40, **slow)) for c in (0, 1)]
    deadline = time.time() + 120

    # both sites hold checkpoint-4 with its sync state (the state is written just before the
    # checkpoint is published, and the sites may be a sync apart): a common checkpoint to resume from
    def held_4(o):
        return (o / "checkpoint-4").is_dir() and (
            o / "cross_cluster_state" / "checkpoint-4" / "rank-0.safetensors"
        ).is_file()

    while not all(held_4(o) for o in outs):
        assert time.time() < deadline and procs[1].poll() is None, procs[1].communicate()[0][-3000:]
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    out0 = procs[0].communicate(timeout=120)[0]
    procs[1].wait()
    assert procs[0].returncode != 0
    last = [line for line in out0.splitlines() if line.strip()][-1]
    assert "cluster 1 rank 0" in last and "resume_from_checkpoint=auto" in last, out0[-2000:]
    assert "k" * 40 not in out0
    held = [
        {int(p.name.split("-")[1]) for p in o.glob("checkpoint-*") if (o / "cross_cluster_state" / p.name).is_dir()}
        for o in outs
    ]
    common = max(held[0] & held[1])
    rs = concurrently(
        *(lambda c=c: _run(_site(outs[c], c, peers, key, 40, resume_from_checkpoint="auto")[4:]) for c in (0, 1))
    )
    for r in rs:
        step = int(r.stdout.split("checkpoint-")[1].split(" at step")[0]) if "resumed from" in r.stdout else 0
        assert step == common and step >= 4
    a, b = _weights(outs[0]), _weights(outs[1])
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_cluster_with_another_key_is_refused_in_one_line(tmp_path):
    """The connecting site (1) stops at once with one line; the listening site (0) refuses the
    connection on stderr and waits on (anyone can connect to its port: a stranger's bad MAC must not
    stop it), so the test stops it once it has said so."""
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    keys = [_key(tmp_path / "a.key", "a" * 32), _key(tmp_path / "b.key", "b" * 32)]
    procs = [_start(_site(tmp_path / f"s{c}", c, peers, keys[c], 4)) for c in (0, 1)]
    out1 = procs[1].communicate(timeout=120)[0]
    last = [line for line in out1.splitlines() if line.strip()][-1]
    assert procs[1].returncode != 0 and last.startswith("error: ") and "failed its HMAC check" in last, out1[-2000:]
    assert f"cluster 0 rank 0 ({peers[0]})" in last
    seen, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline and not any("refused a connection" in x for x in seen):
        line = procs[0].stdout.readline()
        if not line:
            break
        seen.append(line)
    assert procs[0].poll() is None, "".join(seen)[-2000:]  # still waiting for the real cluster 1
    procs[0].send_signal(signal.SIGTERM)
    out0 = "".join(seen) + procs[0].communicate(timeout=60)[0]
    refused = [x for x in seen if "refused a connection" in x]
    assert refused and "failed its HMAC check" in refused[-1] and "127.0.0.1:" in refused[-1], out0[-2000:]
    for out in (out0, out1):
        assert "a" * 32 not in out and "b" * 32 not in out


def test_layouts_inside_the_clusters(tmp_path):
    """Each cluster runs its own layout unchanged: tensor parallel clusters summing gradients over the link
    train as one process on the global batch; expert-parallel MoE clusters with overlapped, adaptive syncs
    end bit-identical after the final sync, their router correction biases included."""
    one, tp, ep = tmp_path / "one", tmp_path / "tp", tmp_path / "ep"
    both = dict(cross_cluster_sizes="[2,2]")
    concurrently(
        lambda: _run(_args(one, steps=4, batch=16)),
        lambda: _run(_args(tp, steps=4, tensor_parallel_degree=2, cross_cluster_sync="gradients", **both)),
        lambda: _run(
            _args(
                ep,
                steps=6,
                expert_parallel_degree=2,
                cross_cluster_sync_every=2,
                cross_cluster_overlap_steps=1,  # each exchange lands one step later, in the background
                cross_cluster_compress="adaptive",  # interval and codec agreed from the measured link
                **both,
            )
            + ["model_name_or_path=tiny-moe", "model_overrides.moe_bias_update_rate=0.01"]
        ),
    )
    np.testing.assert_allclose(_losses(tp), _losses(one), rtol=0, atol=2e-5)
    a, b = _weights(ep), _weights(ep / "cluster-1")
    assert all(np.array_equal(a[k], b[k]) for k in a) and any("experts" in k for k in a)
    biases = [k for k in a if k.endswith("e_score_correction_bias")]  # moved by each cluster, averaged by the sync
    assert biases and any(np.abs(a[k]).max() > 0 for k in biases)
    res = json.loads((ep / "train_results.json").read_text())["cross_cluster"]
    assert res["syncs"] >= 2 and res["compress"] in ("none", "int8")  # adaptive: a dense codec meets 10% here


def test_clusters_with_other_settings_or_weights_are_refused_in_one_line(tmp_path):
    key = _key(tmp_path / "cc.key", "k" * 40)
    cases = (({"cross_cluster_sync_every": 4}, "runs with every="), ({"seed": 7}, "starts from other weights"))
    for case, (extra, message) in enumerate(cases):
        peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
        procs = [
            _start(_site(tmp_path / f"case{case}-{c}", c, peers, key, 4, **(extra if c == 1 else {}))) for c in (0, 1)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        for p, out in zip(procs, outs):
            last = [line for line in out.splitlines() if line.strip()][-1]
            assert p.returncode != 0 and last.startswith("error: ") and message in last, out[-2000:]
