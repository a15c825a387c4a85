"""`erniekit plan` and `parallel: auto` keep to the layouts `erniekit train` runs for the config
planned: the layouts train refuses (config/checks.py layout_refusal, the check train runs) are left
out of the ranking with a count and the reasons, `--all` lists them marked, and auto never picks one."""

import json
import os
from pathlib import Path

import pytest

from erniekit.cli import main
from erniekit.config import load_config, validate
from erniekit.distributed import planner as P
from erniekit.errors import ConfigError
from erniekit.utils.device import cuda_visible

ROOT = str(Path(__file__).resolve().parents[3])
SFT = os.path.join(ROOT, "examples/configs/tiny/sft.yaml")
EVAL_GENERATION = "pipeline_parallel_degree=2 evaluates the held-out loss only"


def _cluster(tmp_path, extra: str = "") -> str:
    """Two devices of the kind this machine trains on (what validate checks against)."""
    f = tmp_path / "cluster.yaml"
    kind = "gpu" if cuda_visible() else "cpu"
    f.write_text(f"devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: 1.2e10\ndevice: {kind}\n{extra}")
    return str(f)


def _train_checks(cfg) -> None:
    """What `erniekit train` checks before any process starts (train/start.py): the config, then the
    model-dependent checks of a multi-process launch (check_model_fits with the FP8 block)."""
    from erniekit.train.model_checks import check_model_before_launch

    check_model_before_launch(validate(cfg))


def _plan_rows(tmp_path, capsys, *args) -> tuple[list[dict], str]:
    out = tmp_path / "plans.json"
    assert main(["plan", SFT, f"cluster={_cluster(tmp_path)}", "--json", str(out), *args]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_plan_leaves_out_the_pipeline_layouts_train_refuses_for_the_config_and_says_why(tmp_path, capsys):
    """The tiny SFT config evaluates by generation: train refuses pp=2 for it, so the plan does too;
    with eval_generation=false the same layouts are ranked."""
    rows, text = _plan_rows(tmp_path, capsys)
    assert rows and not any(r["plan"]["pp"] > 1 or r["refused"] for r in rows)
    left_out = text.split("left out ", 1)[1]
    assert left_out.startswith(tuple(f"{n} layouts that `erniekit train` refuses" for n in range(1, 1000)))
    assert EVAL_GENERATION in left_out and "set eval_generation=false" in left_out
    rows, text = _plan_rows(tmp_path, capsys, "eval_generation=false")
    assert any(r["plan"]["pp"] == 2 for r in rows) and EVAL_GENERATION not in text


def test_every_layout_plan_lists_is_refused_or_run_by_train_exactly_as_it_says(tmp_path, capsys, monkeypatch):
    """--all marks each refused layout with train's own one-line error: checking the config with
    that layout applied as train does raises exactly it, and passes for every layout left unmarked."""
    monkeypatch.chdir(ROOT)  # the config's data paths
    rows, _ = _plan_rows(tmp_path, capsys, "--all")
    layouts = {}
    for r in rows:  # the degrees decide; recompute and micro-batch do not
        p = r["plan"]
        layouts.setdefault((p["dp"], p["tp"], p["pp"], p["ep"], p["sharding_stage"]), r)
    assert any(r["refused"] for r in layouts.values()) and any(not r["refused"] for r in layouts.values())
    base = load_config(SFT, ["nproc_per_node=2", f"output_dir={tmp_path / 'o'}"])
    for r in layouts.values():
        cfg = P.with_plan(base, P.Plan(**r["plan"]))
        if r["refused"]:
            with pytest.raises(ConfigError) as e:
                _train_checks(cfg)
            assert str(e.value) == r["refused"], r["layout"]
        else:
            _train_checks(cfg)


FP8_TP2 = "fp8_block_size 128 does not divide moe_intermediate_size 128 / tensor_parallel_degree 2 = 64"


def test_plan_refuses_tp_where_the_fp8_block_does_not_tile_each_ranks_slice_of_the_experts(
    tmp_path, capsys, monkeypatch
):
    """The tiny SFT config runs tiny-moe's experts in FP8 with 128-wide blocks; tp=2 splits each
    expert to 64 columns, which train refuses before any process starts (layout.check_model_fits).
    The plan marks those layouts with train's line; with 64-wide blocks it ranks them."""
    rows, text = _plan_rows(tmp_path, capsys, "--all")
    tp2 = [r for r in rows if r["plan"]["tp"] == 2]
    assert tp2 and all(r["refused"].startswith(FP8_TP2) for r in tp2)
    assert not any(FP8_TP2 in r["refused"] for r in rows if r["plan"]["tp"] == 1)
    monkeypatch.chdir(ROOT)  # the config's data paths
    cfg = P.with_plan(load_config(SFT, ["nproc_per_node=2", f"output_dir={tmp_path / 'o'}"]), P.Plan(**tp2[0]["plan"]))
    with pytest.raises(ConfigError) as e:
        _train_checks(cfg)
    assert str(e.value) == tp2[0]["refused"]
    rows, _ = _plan_rows(tmp_path, capsys, "--all", "fp8_block_size=64")
    assert any(r["plan"]["tp"] == 2 and not r["refused"] for r in rows)
    assert not any("fp8_block_size" in r["refused"] for r in rows)


def test_parallel_auto_picks_the_fastest_layout_train_runs(tmp_path):
    """LoRA on CPU: a slow link makes tp=2 the fastest prediction, but train refuses LoRA with tp on
    CPU; auto takes the fastest layout it runs (data parallel or, since LoRA runs in a pipeline,
    pipeline stages) instead of failing on the refusal."""
    if cuda_visible():
        pytest.skip("LoRA with tensor parallelism runs on a CUDA build; the refusal is the CPU build's")
    cluster = _cluster(tmp_path, "intra_node_bandwidth: 1.0e6\n")
    args = ["model_name_or_path=tiny-dense", "fine_tuning=LoRA", "per_device_train_batch_size=1", "max_seq_len=16"]
    args += ["nproc_per_node=2", f"cluster={cluster}", f"output_dir={tmp_path / 'o'}"]
    ranked = P.plan(P.model_config_of(load_config(None, args)), P.load_cluster(cluster), P.Workload(2, 16))
    assert next(r for r in ranked if r.plan.pp == 1).plan.tp == 2  # the cost model's choice without a pipeline
    cfg = validate(load_config(None, [*args, "parallel=auto"]))
    assert cfg.tensor_parallel_degree == 1


def test_parallel_auto_names_the_refusal_when_train_refuses_every_layout(tmp_path):
    """credibility_loss_weight runs in one process: on 2 devices auto says so, not that no layout
    splits the model or fits."""
    args = ["model_name_or_path=tiny-dense", "credibility_loss_weight=0.1", "nproc_per_node=2", "parallel=auto"]
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*args, f"cluster={_cluster(tmp_path)}", f"output_dir={tmp_path / 'o'}"]))
    assert str(e.value).startswith("erniekit train refuses every layout of 2 devices for this config: ")
    assert "credibility_loss_weight > 0 runs in one process" in str(e.value)
