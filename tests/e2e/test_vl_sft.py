"""stage VL-SFT through `erniekit train`: a tiny ERNIE-4.5-VL model on synthetic pictures learns
(loss falls, held-out exact match above the majority answer), 2 data-parallel, expert-parallel,
tensor-parallel or ZeRO-1 sharded processes follow the 1-process curve, and freezing keeps the
vision encoder and resampler as initialised."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import train

ROOT = str(Path(__file__).resolve().parents[2])


def _args(out, steps=12, batch=8, n=256):
    return [
        "examples/configs/tiny/vl_sft.yaml",
        f"train_dataset_path=synthetic:shapes/train?n={n}",
        "eval_dataset_path=synthetic:shapes/eval?n=16",
        f"per_device_train_batch_size={batch}",
        f"max_steps={steps}",
        "warmup_steps=2",
        "logging_steps=1",
        f"save_steps={steps}",
        f"eval_steps={steps}",
        "eval_max_samples=16",
        "disable_tqdm=true",
        f"output_dir={out}",
    ]


def _train(args):
    return train(args, ROOT)


def _scalars(out, key):
    rows = [json.loads(line) for line in open(os.path.join(out, "vdl_log", "scalars.jsonl"))]
    return np.array([r[key] for r in rows if key in r])


def _losses(out):
    return _scalars(out, "train/loss")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl1")
    r = _train(_args(out))
    return out, r


def test_vl_sft_learns_and_reports_exact_match(one):
    out, r = one
    losses = _losses(out)
    assert len(losses) == 12 and losses[-3:].mean() < losses[:3].mean() - 0.5
    assert "held-out exact match:" in r.stdout and "majority-answer baseline" in r.stdout
    cfg = json.load(open(out / "config.json"))
    assert cfg["model_type"] == "ernie4_5_vl_moe" and "vision_config" in cfg
    size = json.load(open(out / "preprocessor_config.json"))["size"]  # served with the sizes it trained on
    assert size == {"shortest_edge": 3136, "longest_edge": 7056}
    pictures = os.listdir(out / "routing")  # text and vision tokens' load, each over its own experts
    assert {"step-000012-modality.png", "step-000012-load-text.png", "step-000012-load-vision.png"} <= set(pictures)


def test_two_data_parallel_processes_follow_one(one, tmp_path):
    out, _ = one
    r = _train(_args(tmp_path / "two", batch=4) + ["nproc_per_node=2"])
    assert "data parallelism: 2 whole-model replicas" in r.stdout
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(out), rtol=1e-5)


def test_two_expert_parallel_processes_follow_one(one, tmp_path):
    """Text and vision experts split over 2 processes (each holds half of every group's experts,
    tokens exchanged all-to-all): the same losses and gradient norms as one process, which a
    token reaching its expert once per rank would double."""
    out, _ = one
    r = _train(_args(tmp_path / "ep", batch=4) + ["nproc_per_node=2", "expert_parallel_degree=2"])
    assert "ep=2" in r.stdout
    np.testing.assert_allclose(_losses(tmp_path / "ep"), _losses(out), rtol=1e-5)
    norms = _scalars(tmp_path / "ep", "train/grad_norm")
    assert len(norms) == 12
    np.testing.assert_allclose(norms, _scalars(out, "train/grad_norm"), rtol=1e-4)


def test_expert_parallel_with_a_rank_whose_experts_get_no_rows(tmp_path):
    """At step 5 of this data one layer sends every row of an expert set to rank 0, so rank 1's slice
    gets none and its graph has another shape; Paddle's autograd then ran the text and vision sets'
    backward all-to-alls in another order on each rank, and both waited in a recv until gloo timed
    out. The sets are chained (MoEBlock._after): the run follows one process."""
    from launched_jobs import concurrently

    one, ep = tmp_path / "one", tmp_path / "ep"
    concurrently(
        lambda: _train(_args(one, steps=6, n=64)),
        lambda: _train(_args(ep, steps=6, batch=4, n=64) + ["nproc_per_node=2", "expert_parallel_degree=2"]),
    )
    np.testing.assert_allclose(_losses(ep), _losses(one), rtol=1e-5)
    assert len(_losses(ep)) == 6


@pytest.mark.parametrize(
    "name, batch, extra, local",
    [
        # text model split over tp (the vision experts of 64 too: up by columns, down by rows), the
        # vision transformer and resampler whole on both ranks, the batch whole on both
        ("tp", 8, ["tensor_parallel_degree=2"], [[64, 192], [256, 256], [8, 128, 32], [8, 32, 128]]),
        # ZeRO-1: data parallel over 2 sharding ranks, every parameter whole, the moments split
        ("zero1", 4, ["sharding=stage1"], [[64, 192], [256, 256], [8, 128, 64], [8, 64, 128]]),
    ],
)
def test_tensor_parallel_and_sharded_processes_follow_one(one, tmp_path, name, batch, extra, local):
    """2 processes against 1: the losses and gradient norms, the local shapes of a vision
    transformer, a resampler and two vision-expert parameters, the saved model's logits for a
    prompt with a picture; tp: its step-6 checkpoint finishes in one process on the same curve."""
    out, _ = one
    r = _train(_args(tmp_path, batch=batch) + ["nproc_per_node=2", "save_steps=6", *extra])
    np.testing.assert_allclose(_losses(tmp_path), _losses(out), rtol=1e-5)
    np.testing.assert_allclose(_scalars(tmp_path, "train/grad_norm"), _scalars(out, "train/grad_norm"), rtol=1e-4)
    plan = json.load(open(tmp_path / "parallel_plan.json"))["parameters"]
    names = ("vision_model.blocks.0.attn.qkv.weight", "resampler_model.spatial_linear.fc1.weight")
    names += ("model.layers.1.mlp.experts_1.up_proj", "model.layers.1.mlp.experts_1.down_proj")
    assert [plan[n]["local_shape"] for n in names] == local
    assert _picture_logits_differ(tmp_path, out) < 1e-4
    if name == "zero1":
        assert "optimizer state on rank 0:" in r.stdout and "(50%)" in r.stdout
    else:
        resume = [f"resume_from_checkpoint={tmp_path / 'checkpoint-6'}", "do_eval=false"]
        _train(_args(tmp_path / "resumed") + resume)
        np.testing.assert_allclose(_losses(tmp_path / "resumed"), _losses(out)[6:], rtol=1e-5)


def _picture_logits_differ(a, b) -> float:
    """Largest |difference| of two saved VL models' logits for a prompt with a picture, over their
    largest |logit|: rank 0 saves the whole model (a tp rank's slice left out would show)."""
    from erniekit.export.vl_check import our_logits, vl_probe
    from erniekit.models.registry import load_model, load_tokenizer

    ma, mb = load_model(str(a)), load_model(str(b))
    probe = vl_probe(ma, load_tokenizer(str(a)))
    la, lb = our_logits(ma, probe), our_logits(mb, probe)
    return float(np.abs(la - lb).max() / np.abs(lb).max())


@pytest.mark.parametrize("encoder, resampler", [(True, True), (True, False), (False, True)])
def test_frozen_vision_parts_keep_their_initial_weights(tmp_path, encoder, resampler):
    """Each option freezes its own part and only that one."""
    import paddle
    from safetensors.numpy import load_file

    from erniekit.models.ernie4_5_vl.checkpoint import hf_state_dict
    from erniekit.models.registry import load_model

    flags = [f"freeze_vision_encoder={str(encoder).lower()}", f"freeze_resampler={str(resampler).lower()}"]
    _train(_args(tmp_path, steps=3) + flags + ["do_eval=false"])
    paddle.seed(42)
    init = {k: v.numpy() for k, v in hf_state_dict(load_model("tiny-vl")).items()}
    saved = load_file(str(tmp_path / "model.safetensors"))
    for part, frozen in ((".vision_model.", encoder), (".resampler_model.", resampler)):
        keys = [k for k in saved if part in k]
        same = [np.array_equal(saved[k], init[k]) for k in keys]
        assert keys and (all(same) if frozen else not any(same)), part
    text = [k for k in saved if k.startswith("model.layers.")]
    assert any(not np.array_equal(saved[k], init[k]) for k in text)  # the rest trained


def test_lora_trains_adapters_of_the_text_model(tmp_path):
    from safetensors.numpy import load_file

    _train(_args(tmp_path, steps=2) + ["fine_tuning=LoRA", "do_eval=false"])
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(".self_attn." in k for k in adapter) and not any("vision_model" in k for k in adapter)
