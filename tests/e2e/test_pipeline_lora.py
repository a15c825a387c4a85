"""LoRA under pipeline parallelism (pipeline_parallel_degree=2, the 1F1B schedule): DoRA adapters on
a 4-layer model split 2 + 2 follow the 1-process curve, the run writes the whole model's adapter
(gathered from the stages, as the 1-process run writes it), a resume from its checkpoint continues
the curve at pp=2 x dp=2 and at 1 process, and `erniekit export` merges its adapter as a 1-process
one. Two multi-process runs; the stages' parts are unit-tested in tests/unit/train/test_pipeline_lora_parts.py."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import concurrently, erniekit, head_of, train
from safetensors import safe_open
from safetensors.numpy import load_file

ROOT = str(Path(__file__).resolve().parents[2])
DATA = os.path.join(ROOT, "examples", "data", "arithmetic")
PP = ["nproc_per_node=2", "pipeline_parallel_degree=2"]
PP4 = ["nproc_per_node=4", "pipeline_parallel_degree=2"]  # pp=2 x dp=2


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A 4-layer random base checkpoint: what the adapters adapt and `erniekit export` merges into."""
    import paddle

    from erniekit.models import registry

    paddle.seed(5)
    model = registry.load_model("tiny-dense", {"num_hidden_layers": 4})
    out = str(tmp_path_factory.mktemp("base") / "dense")
    registry.save_model(model, out, tokenizer=registry.family_of("tiny-dense").default_tokenizer())
    return out


def _args(base: str, out: Path, batch: int = 2) -> list[str]:
    """12 steps of 4 micro-batches of 2 global rows (per device `batch`), checkpoints at 6 and 12. The
    last stage takes the loss through the whole logits; so does the 1-process run. Call it before
    `concurrently`: head_of makes its copy once per process."""
    return [
        f"model_name_or_path={base}",
        "fine_tuning=LoRA",
        "use_dora=true",
        "lora_rank=4",
        "fused_head_loss=false",
        f"train_dataset_path={head_of(os.path.join(DATA, 'train.jsonl'), 2000)}",
        f"eval_dataset_path={os.path.join(DATA, 'eval.jsonl')}",
        "eval_generation=false",
        "eval_steps=1000",
        "max_seq_len=32",
        f"per_device_train_batch_size={batch}",
        "gradient_accumulation_steps=4",
        "max_steps=12",
        "learning_rate=3e-3",
        "logging_steps=1",
        "save_steps=6",
        "disable_tqdm=true",
        f"output_dir={out}",
    ]


def _curve(out: Path, key: str = "train/loss") -> np.ndarray:
    rows = [json.loads(line) for line in open(out / "vdl_log" / "scalars.jsonl")]
    by_step = {r["step"]: r[key] for r in rows if key in r}
    return np.array([by_step[s] for s in sorted(by_step)])


def _same_adapter(a: Path, b: Path) -> None:
    assert json.loads((a / "adapter_config.json").read_text()) == json.loads((b / "adapter_config.json").read_text())
    x, y = (load_file(str(d / "adapter_model.safetensors")) for d in (a, b))
    assert sorted(x) == sorted(y)
    assert any(".layers.3." in k and k.endswith("lora_magnitude_vector") for k in x)  # the last stage's DoRA
    for k in x:
        np.testing.assert_allclose(y[k], x[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_pipeline_lora_follows_one_process_and_its_adapter_resumes_and_merges(base, tmp_path):
    one, pp = tmp_path / "one", tmp_path / "pp"
    runs = _args(base, one), _args(base, pp) + PP
    _, r = concurrently(*(lambda a=a: train(a, ROOT) for a in runs))
    assert "pipeline stage 1/2: layers 0-1" in r.stdout and r.stdout.count("step 12/12") == 1
    np.testing.assert_allclose(_curve(pp), _curve(one), rtol=1e-5)
    # the norm over both stages' adapters only (frozen base weights have no gradient to count)
    np.testing.assert_allclose(_curve(pp, "train/grad_norm"), _curve(one, "train/grad_norm"), rtol=1e-5)
    evals = [json.loads((d / "train_results.json").read_text())["eval"]["loss"] for d in (one, pp)]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5)
    for sub in ("checkpoint-6", "."):
        _same_adapter(one / sub, pp / sub)
        assert not (pp / sub / "model.safetensors").exists()
    # the optimizer state of both stages, adapters only (frozen base parameters are not trained)
    keys = []
    for d in (one, pp):
        with safe_open(str(d / "checkpoint-6" / "optimizer.safetensors"), "numpy") as f:
            keys.append(sorted(f.keys()))
    assert keys[1] == keys[0] and all(".lora_" in k for k in keys[0] if k != "__step__")

    # the pipeline's checkpoint at pp=2 x dp=2 (4 processes) and at 1 process: steps 7-12 as uninterrupted
    resume = f"resume_from_checkpoint={pp / 'checkpoint-6'}"
    runs = _args(base, tmp_path / "to_one") + [resume], _args(base, tmp_path / "to_pp_dp", batch=1) + [resume] + PP4
    concurrently(*(lambda a=a: train(a, ROOT) for a in runs))
    for run in ("to_one", "to_pp_dp"):
        np.testing.assert_allclose(_curve(tmp_path / run), _curve(one)[6:], rtol=1e-5, err_msg=run)

    # `erniekit export` merges the pipeline's adapter into its base as the 1-process adapter merges
    merged = tmp_path / "merged"
    erniekit("export", [str(pp), "-o", str(merged)], ROOT, timeout=300)
    import paddle

    from erniekit.models.ernie4_5 import from_pretrained
    from erniekit.models.registry import load_model_or_adapter

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, (2, 12)))
    got = from_pretrained(str(merged))(input_ids=ids).logits.numpy()
    want = load_model_or_adapter(str(one))(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, from_pretrained(base)(input_ids=ids).logits.numpy(), atol=1e-3)  # it trained
