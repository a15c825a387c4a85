"""Multi-process training through `erniekit train ... nproc_per_node=2` (paddle.distributed.launch,
gloo on 127.0.0.1): each layout must follow the 1-process loss curve, checkpoints must move between
process counts, and a killed worker must be restarted from the latest checkpoint."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import concurrently, head_of, worker_pids
from safetensors.numpy import load_file

from erniekit.distributed.collective import host_sum

ROOT = str(Path(__file__).resolve().parents[2])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic", "train.jsonl")
EVAL = os.path.join(ROOT, "examples", "data", "arithmetic", "eval.jsonl")


def _data():
    """The first 2000 rows of DATA: a run here trains on at most 160 (20 steps of 8), and every
    process encodes its whole training file first (20000 rows: ~1 s a process)."""
    return head_of(DATA, 2000)


def _args(out=None, model="tiny-dense", steps=20, batch=8):
    """out=None: no output_dir (a `shared_run` picks it)."""
    return [
        f"model_name_or_path={model}",
        "model_overrides.num_hidden_layers=2",
        f"train_dataset_path={_data()}",
        "max_seq_len=32",
        f"per_device_train_batch_size={batch}",
        f"max_steps={steps}",
        "learning_rate=3e-3",
        "logging_steps=1",
        "do_eval=false",
        "save_steps=10",
        "disable_tqdm=true",
        *([f"output_dir={out}"] if out else []),
    ]


def _train(args, env=None, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **popen,
    )


def _ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _train_all(*arg_lists):
    """Independent runs at the same time (launched_jobs.concurrently); each must succeed."""
    return concurrently(*(lambda a=a: _ok(_train(a)) for a in arg_lists))


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """args (without output_dir) -> (output_dir, CompletedProcess) of that run, trained once per
    module: a run several tests need (a 1-process reference, a layout whose checkpoint another test
    moves) is one run. Read its files; a test that writes (resumes) uses an output_dir of its own."""
    base, done = tmp_path_factory.mktemp("shared"), {}

    def run(args):
        key = tuple(args)
        if key not in done:
            out = base / hashlib.sha1("\0".join(key).encode()).hexdigest()[:12]
            done[key] = (out, _ok(_train([*args, f"output_dir={out}"])))
        return done[key]

    return run


def _losses(out, key="train/loss"):
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    by_step = {r["step"]: r[key] for r in rows if key in r}  # a resumed run re-logs steps
    return np.array([by_step[s] for s in sorted(by_step)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1-process runs: the curves every layout must follow (dense and MoE, 20 steps, batch 8)."""
    base = tmp_path_factory.mktemp("ref")
    _train_all(_args(base / "dense"), _args(base / "moe", "tiny-moe"))
    return base


@pytest.mark.parametrize(
    "name,model,batch,extra,sharded",
    [
        # tensor parallel: column/row projections, vocab-parallel embedding; the batch is replicated
        (
            "tp",
            "tiny-dense",
            8,
            ["tensor_parallel_degree=2"],
            {
                "model.layers.0.self_attn.q_proj.weight": [128, 64],
                "model.layers.0.mlp.down_proj.weight": [192, 128],
                "model.embed_tokens.weight": [512, 128],
            },
        ),
        # data parallel over 2 sharding ranks, ZeRO-1: batch split, optimizer moments split by rows
        ("sharding", "tiny-dense", 4, ["sharding=stage1"], {}),
        # tensor parallel on MoE: attention, embedding and the routed experts' width split
        (
            "tp-moe",
            "tiny-moe",
            8,
            ["tensor_parallel_degree=2"],
            {"model.layers.0.self_attn.q_proj.weight": [128, 64], "model.layers.1.mlp.experts.up_proj": [8, 128, 64]},
        ),
        # the same, its MoE blocks recomputed in the backward: the recomputed expert GEMMs get their
        # saved tp slices back as new tensors (erniekit/nn/native.py versions: not read as modified)
        (
            "tp-moe-recompute",
            "tiny-moe",
            8,
            ["tensor_parallel_degree=2", "recompute=true", "recompute_granularity=mlp"],
            {},
        ),
        # data parallel: whole-model replicas on plain tensors, each rank on its rows, gradients
        # summed by one all-reduce (erniekit/distributed/collective/replicas.py); on MoE the router
        # losses and load counts are the whole batch's (MoEBlock.data_sum)
        ("dp", "tiny-dense", 4, [], {}),
        ("dp-moe", "tiny-moe", 4, [], {}),
        # data parallel with experts split over the 2 data ranks, tokens moved by all-to-all
        ("ep", "tiny-moe", 4, ["expert_parallel_degree=2"], {"model.layers.1.mlp.experts.up_proj": [4, 128, 128]}),
        # the same over 2 ZeRO-1 sharding ranks: experts split over the sharding dim
        (
            "ep-zero1",
            "tiny-moe",
            4,
            ["expert_parallel_degree=2", "sharding=stage1"],
            {"model.layers.1.mlp.experts.up_proj": [4, 128, 128]},
        ),
    ],
)
def test_two_processes_follow_the_one_process_loss_curve(reference, shared_run, name, model, batch, extra, sharded):
    out, r = shared_run(_args(None, model, batch=batch) + ["nproc_per_node=2", *extra])
    ref = _losses(reference / ("moe" if model == "tiny-moe" else "dense"))
    got = _losses(out)
    assert len(got) == 20
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    # the clip's norm: sharded gradients' squares summed over their shards (one collective per sharding)
    ref_norm = _losses(reference / ("moe" if model == "tiny-moe" else "dense"), "train/grad_norm")
    np.testing.assert_allclose(_losses(out, "train/grad_norm"), ref_norm, rtol=1e-4)
    plan = json.load(open(out / "parallel_plan.json"))
    if name == "dp-moe":  # each replica's router losses are its share: logged summed over the ranks
        ref_aux = _losses(reference / "moe", "train/moe_aux_loss")
        np.testing.assert_allclose(_losses(out, "train/moe_aux_loss"), ref_aux, rtol=1e-4)
    if name in ("dp", "dp-moe"):
        assert "replicas" in plan["data_parallel"]
        assert "data parallelism: 2 whole-model replicas" in r.stdout
        if host_sum._kernel() is not None:  # two ranks on one host: the sums go through shared memory
            assert "(shared memory on this host)" in r.stdout
    else:
        assert plan["expert_all_to_all"] == ([[0, 1]] if "expert_parallel_degree=2" in extra else [])
    for param, local_shape in sharded.items():
        assert plan["parameters"][param]["local_shape"] == local_shape, plan["parameters"][param]
    # rank 0 reports, every rank logs under launch_logs/
    assert r.stdout.count("step 20/20") == 1
    assert {"workerlog.0", "workerlog.1"} <= set(os.listdir(out / "launch_logs"))
    if name == "sharding":  # ZeRO-1: each rank holds half of the optimizer state
        m = [line for line in r.stdout.splitlines() if line.startswith("optimizer state on rank 0:")]
        assert m and "(50%)" in m[0], r.stdout[-2000:]


def test_shared_memory_sums_give_gloo_s_bits(shared_run, tmp_path):
    """Two ranks: a + b either way, so the shared-memory sums (gradients and the router losses'
    whole-batch counts) leave every weight and loss as gloo's do."""
    if host_sum._kernel() is None:
        pytest.skip("no C compiler to build kernels/host_sum.c")
    args = _args(None, "tiny-moe", batch=4) + ["nproc_per_node=2"]
    shm, _ = shared_run(args)
    r = _ok(_train([*args, f"output_dir={tmp_path}"], env={"ERNIEKIT_HOST_SUM": "0"}))
    assert "(gloo; shared memory not used: ERNIEKIT_HOST_SUM=0)" in r.stdout
    np.testing.assert_array_equal(_losses(tmp_path), _losses(shm))
    a, b = load_file(str(shm / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_checkpoints_move_between_process_counts(reference, shared_run, tmp_path):
    # 1 -> 2: the 1-process checkpoint at step 10 finishes in a 2-process data-parallel run; beside
    # it, the tensor-parallel run of the test above (trained here if it has not run in this process)
    ckpt1 = reference / "dense" / "checkpoint-10"
    _, (tp, _) = concurrently(
        lambda: _ok(
            _train(_args(tmp_path / "one_to_two", batch=4) + ["nproc_per_node=2", f"resume_from_checkpoint={ckpt1}"])
        ),
        lambda: shared_run(_args(None) + ["nproc_per_node=2", "tensor_parallel_degree=2"]),
    )
    # 2 -> 1: a tensor-parallel run's step-10 checkpoint finishes in one process
    ckpt2 = tp / "checkpoint-10"
    _ok(_train(_args(tmp_path / "two_to_one") + [f"resume_from_checkpoint={ckpt2}"]))
    ref = _losses(reference / "dense")
    for run in ("one_to_two", "two_to_one"):
        np.testing.assert_allclose(_losses(tmp_path / run), ref[10:], rtol=1e-5)  # steps 11-20

    # the unsharded HF-layout checkpoint of the 2-process run gives the 1-process run's logits
    import paddle

    from erniekit.models.ernie4_5 import from_pretrained

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 1000, (2, 12)))
    a = from_pretrained(str(tp))(input_ids=ids).logits.numpy()
    b = from_pretrained(str(reference / "dense"))(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_killed_worker_restarts_from_the_latest_checkpoint_and_ends_on_the_same_loss(reference, tmp_path):
    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "erniekit", "train", *_args(out, batch=4), "nproc_per_node=2", "max_restart=1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    pids: dict[int, int] = {}
    # the workers' PIDs first (a /proc scan takes a while), then the kill as soon as checkpoint-10
    # appears: the 10 steps to the last checkpoint take well under a second on an idle machine
    while 1 not in pids and p.poll() is None and time.time() < deadline:
        pids = worker_pids(out)
        time.sleep(0.05)
    while not (out / "checkpoint-10").is_dir() and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert 1 in pids and not (out / "checkpoint-20").exists(), pids
    os.kill(pids[1], signal.SIGKILL)
    stdout, _ = p.communicate(timeout=600)
    assert p.returncode == 0, stdout[-3000:]
    assert "restart 1 of 1 from the latest checkpoint" in stdout
    assert "resumed from" in stdout and "checkpoint-10 at step 10" in stdout
    final = json.load(open(out / "train_results.json"))["train"]["train/loss"]
    assert final == pytest.approx(_losses(reference / "dense")[-1], rel=1e-5)


def test_zero1_moe_survives_partial_expert_gradients(tmp_path):
    """ZeRO-1 on tiny-moe over packed 128-token rows: at step 26 a gradient arrived as a partial sum
    whose move to the moments' row shard needed a reduce-scatter (missing on CPU) and the job died;
    the optimizer now all-reduces first. The 2-process curve must follow the 1-process one."""
    common = [
        "examples/configs/tiny/pretrain.yaml",
        "max_steps=30",
        "logging_steps=1",
        "save_steps=1000",
        "disable_tqdm=true",
        "learning_rate=3e-3",
    ]
    _train_all(
        [*common, "per_device_train_batch_size=16", f"output_dir={tmp_path / 'one'}"],
        [
            *common,
            "per_device_train_batch_size=8",
            "sharding=stage1",
            "nproc_per_node=2",
            f"output_dir={tmp_path / 'two'}",
        ],
    )
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 30
    np.testing.assert_allclose(two, one, rtol=1e-4)


# ---- pipeline parallelism (1F1B over 4 micro-batches of 2 rows, 4 layers split 2 + 2) ------------
def _pp_args(out, model, batch=2, steps=12):
    """out=None: no output_dir (a `shared_run` picks it). The pipeline's last stage takes the loss
    through the whole logits; so does the one-process reference (fused_head_loss sums the head's
    weight gradient in another order, and the weights are compared element by element)."""
    return [
        "fused_head_loss=false",
        f"model_name_or_path={model}",
        "model_overrides.num_hidden_layers=4",
        f"train_dataset_path={_data()}",
        f"eval_dataset_path={EVAL}",
        "eval_generation=false",
        "eval_steps=1000",
        "max_seq_len=32",
        f"per_device_train_batch_size={batch}",
        "gradient_accumulation_steps=4",
        f"max_steps={steps}",
        "learning_rate=3e-3",
        "logging_steps=1",
        "save_steps=6",
        "disable_tqdm=true",
        *([f"output_dir={out}"] if out else []),
    ]


def _final_eval(out) -> float:
    return json.load(open(os.path.join(out, "train_results.json")))["eval"]["loss"]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_pipeline_follows_the_one_process_curve_and_checkpoints_move_both_ways(tmp_path, model):
    ref, pp = tmp_path / "one", tmp_path / "pp"
    _, r = _train_all(_pp_args(ref, model), _pp_args(pp, model) + ["nproc_per_node=2", "pipeline_parallel_degree=2"])
    assert "pipeline stage 1/2: layers 0-1" in r.stdout and r.stdout.count("step 12/12") == 1
    assert "M trainable on this rank (its part of the model)" in r.stdout  # rank 0's count is its stage's
    np.testing.assert_allclose(_losses(pp), _losses(ref), rtol=1e-5)
    assert _final_eval(pp) == pytest.approx(_final_eval(ref), rel=1e-5)  # held-out loss through the stages
    plan = json.load(open(pp / "parallel_plan.json"))
    assert plan["stage_layers"] == [[0, 1], [2, 3]] and plan["pipeline_schedule"] == "1F1B"
    assert not any(".layers.2." in n for n in plan["parameters"])  # rank 0 holds stage 1's layers only

    # the checkpoint is the single-process HF layout: all weights, and the same logits
    import paddle

    from erniekit.models.ernie4_5 import from_pretrained

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 12)))
    a = from_pretrained(str(pp))(input_ids=ids).logits.numpy()
    b = from_pretrained(str(ref))(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    # pipeline checkpoint -> 1 process, and 1-process checkpoint -> pipeline: steps 7-12 as uninterrupted
    _train_all(
        _pp_args(tmp_path / "to_one", model) + [f"resume_from_checkpoint={pp / 'checkpoint-6'}"],
        _pp_args(tmp_path / "to_pp", model)
        + ["nproc_per_node=2", "pipeline_parallel_degree=2", f"resume_from_checkpoint={ref / 'checkpoint-6'}"],
    )
    for run in ("to_one", "to_pp"):
        np.testing.assert_allclose(_losses(tmp_path / run), _losses(ref)[6:], rtol=1e-5)


@pytest.mark.parametrize(
    "model,extra",
    [
        ("tiny-dense", []),
        # router losses and load counts must be the whole batch's, not each data rank's half
        (
            "tiny-moe",
            [
                "model_overrides.router_z_loss_coef=0.001",
                "model_overrides.router_orthogonal_loss_coef=0.01",
                "model_overrides.moe_bias_update_rate=0.001",
            ],
        ),
    ],
)
def test_pipeline_beside_data_parallelism_four_processes(shared_run, tmp_path, model, extra):
    """pp=2 x dp=2: each stage's two data ranks split the rows and sum their gradients."""
    pp = tmp_path / "pp_dp"
    (ref, _), _ = concurrently(
        lambda: shared_run(_pp_args(None, model, batch=2, steps=6) + extra),  # tiny-dense: also the pp=3 test's
        lambda: _ok(
            _train(_pp_args(pp, model, batch=1, steps=6) + extra + ["nproc_per_node=4", "pipeline_parallel_degree=2"])
        ),
    )
    np.testing.assert_allclose(_losses(pp), _losses(ref), rtol=1e-5)
    assert _final_eval(pp) == pytest.approx(_final_eval(ref), rel=1e-5)
    if model == "tiny-moe":
        rows = [
            [
                r["train/router_loss"]
                for r in map(json.loads, open(out / "vdl_log" / "scalars.jsonl"))
                if "train/router_loss" in r
            ]
            for out in (ref, pp)
        ]
        assert len(rows[0]) == 6
        np.testing.assert_allclose(rows[1], rows[0], rtol=1e-5)


def test_three_stages_follow_the_one_process_curve(shared_run, tmp_path):
    """pp=3: the middle stage talks to both neighbours, each link on its own group (on one shared
    group gloo's per-group message tags disagreed and the first step timed out, measured); the
    checkpoint gathers all three stages."""
    pp = tmp_path / "pp"
    (ref, _), _ = concurrently(
        lambda: shared_run(_pp_args(None, "tiny-dense", steps=6)),
        lambda: _ok(_train(_pp_args(pp, "tiny-dense", steps=6) + ["nproc_per_node=3", "pipeline_parallel_degree=3"])),
    )
    np.testing.assert_allclose(_losses(pp), _losses(ref), rtol=1e-5)
    from safetensors.numpy import load_file

    a, b = load_file(str(pp / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_pipeline_runs_fp8_experts(tmp_path):
    """A pipeline stage keeps plain tensors, so the block-scaled FP8 expert GEMM runs there (it is
    refused beside DistTensor layouts); the curve is the 1-process FP8 one, not the float32 one."""
    fp8 = ["fp8=true", "fp8_block_size=32", "save_steps=100"]
    _train_all(
        _pp_args(tmp_path / "one", "tiny-moe", steps=6) + fp8,
        _pp_args(tmp_path / "pp", "tiny-moe", steps=6) + fp8 + ["nproc_per_node=2", "pipeline_parallel_degree=2"],
        _pp_args(tmp_path / "f32", "tiny-moe", steps=6) + ["save_steps=100"],
    )
    one, pp, f32 = (_losses(tmp_path / n) for n in ("one", "pp", "f32"))
    np.testing.assert_allclose(pp, one, rtol=1e-5)
    assert np.abs(one - f32).max() > 1e-4  # FP8 really ran


def test_four_data_ranks_sum_in_shared_memory_and_follow_the_one_process_curve(reference, tmp_path):
    """Four replicas on one host: each sums its chunk over four slots in rank order (not gloo's
    ring order), the router counts too; the curve is the one process's."""
    out = tmp_path / "dp4"
    r = _ok(_train(_args(out, "tiny-moe", batch=2) + ["nproc_per_node=4"]))
    if host_sum._kernel() is not None:
        assert "4 whole-model replicas, gradients summed by one all-reduce (shared memory on this host)" in r.stdout
    np.testing.assert_allclose(_losses(out), _losses(reference / "moe"), rtol=1e-5)


def test_tensor_and_data_parallel_moe_on_four_processes(reference, tmp_path):
    """tp=2 x dp=2 without expert parallelism: the replicated experts' gradients are summed over
    the data ranks of each tp coordinate ({0, 2} and {1, 3}) by a hook on their own group."""
    out = tmp_path / "tp-dp"
    _ok(_train(_args(out, "tiny-moe", batch=4) + ["nproc_per_node=4", "tensor_parallel_degree=2"]))
    np.testing.assert_allclose(_losses(out), _losses(reference / "moe"), rtol=1e-5)


def test_tensor_and_expert_parallel_on_four_processes(reference, tmp_path):
    """tp=2 x (dp=2, ep=2): each tp rank swaps tokens with the data rank of its own tp coordinate."""
    out = tmp_path / "tp-ep"
    _ok(
        _train(
            _args(out, "tiny-moe", batch=4)
            + ["nproc_per_node=4", "tensor_parallel_degree=2", "expert_parallel_degree=2"]
        )
    )
    np.testing.assert_allclose(_losses(out), _losses(reference / "moe"), rtol=1e-5)
    plan = json.load(open(out / "parallel_plan.json"))
    assert plan["expert_all_to_all"] == [[0, 2]]  # rank 0's group: tp coordinate 0 of both data ranks
    # half the experts (ep) and half of each one's width (tp)
    assert plan["parameters"]["model.layers.1.mlp.experts.up_proj"]["local_shape"] == [4, 128, 64]


def test_expert_parallel_over_four_ranks(reference, tmp_path):
    """ep=4: three rounds of paired exchanges, each pair on its own process group."""
    out = tmp_path / "ep4"
    _ok(_train(_args(out, "tiny-moe", batch=2) + ["nproc_per_node=4", "expert_parallel_degree=4"]))
    np.testing.assert_allclose(_losses(out), _losses(reference / "moe"), rtol=1e-5)
    plan = json.load(open(out / "parallel_plan.json"))
    assert plan["expert_all_to_all"] == [[0, 1, 2, 3]]
    assert plan["parameters"]["model.layers.1.mlp.experts.up_proj"]["local_shape"] == [2, 128, 128]


FP8 = ["fp8=true", "fp8_block_size=32"]


def _fp8_runs(shared_run, two_args):
    """(FP8 1-process, `two_args` run, float32 1-process) loss curves: tiny-moe, 8 steps, global batch
    4; the two 1-process runs are shared by the FP8 expert tests, the three run at the same time."""
    one_args = _args(None, "tiny-moe", steps=8, batch=4)
    (one, _), (two, _), (f32, _) = concurrently(
        lambda: shared_run(one_args + FP8),
        lambda: shared_run(two_args),
        lambda: shared_run(one_args),
    )
    return _losses(one), _losses(two), _losses(f32)


def test_expert_parallel_runs_fp8_experts(shared_run):
    """An expert-parallel process runs its expert slice on local tensors, so the FP8 expert GEMM
    runs there too: 2 processes follow the 1-process FP8 curve (each expert sees the same rows in
    the same order, so the block scales are the same)."""
    one, ep, f32 = _fp8_runs(
        shared_run, _args(None, "tiny-moe", steps=8, batch=2) + FP8 + ["nproc_per_node=2", "expert_parallel_degree=2"]
    )
    np.testing.assert_allclose(ep, one, rtol=1e-5)
    assert np.abs(one - f32).max() > 1e-4  # FP8 really ran


@pytest.mark.parametrize("layout", [[], ["tensor_parallel_degree=2"]], ids=["dp", "tp"])
def test_fp8_experts_under_data_and_tensor_parallelism(shared_run, layout):
    """FP8 experts with plain data or tensor parallelism: the replicated experts run on local tensors.
    Tensor parallel: every tp rank computes the whole batch's experts, so the curve is the 1-process
    FP8 one. Data parallel: dW's token-run tiles hold each rank's tokens only (the scales of a
    data-parallel FP8 GEMM), so the curve follows the 1-process one within FP8's rounding, closer
    than FP8 is to float32 (the all-reduce of the expert gradients itself is checked to 1e-5 by
    the float32 dp-moe case above)."""
    batch = 4 if layout else 2
    one, two, f32 = _fp8_runs(
        shared_run, _args(None, "tiny-moe", steps=8, batch=batch) + FP8 + ["nproc_per_node=2", *layout]
    )
    assert len(two) == 8
    assert np.abs(one - f32).max() > 1e-4  # FP8 really ran
    if layout:
        np.testing.assert_allclose(two, one, rtol=1e-5)
    else:
        np.testing.assert_allclose(two, one, rtol=2e-3)
        assert np.abs(two - one).max() < np.abs(one - f32).max()
