"""tools/bench_train.py: runs end to end with tiny settings and reports sane throughput/MFU; FLOP counting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import bench_train  # noqa: E402


def test_bench_tool_writes_positive_throughput_and_mfu(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the tool must set it itself
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_train.py"),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--models",
            "tiny-moe",
            "--peak-sizes",
            "512",
            "--peak-repeats",
            "3",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["machine"]["omp_num_threads"] == os.cpu_count()
    assert rep["peak"]["paddle_peak_gflops"] > 0 and rep["peak"]["numpy_peak_gflops"] > 0
    (r,) = rep["results"]
    assert r["model"] == "tiny-moe" and r["batch_size"] == 64 and r["steps_timed"] == 2
    assert r["tokens_per_s"] > 0 and r["step_time_s_mean"] > 0
    assert 0 < r["mfu"] <= 1
    # numpy's peak only > 0: with the other pytest worker busy, OpenBLAS' spinning threads can
    # measure far below the real peak for a moment, so a bound of 1 would test the neighbours
    assert r["mfu_vs_numpy_peak"] > 0
    assert r["finite_loss"]
    assert "6 * N_active" in rep["flops_formula"]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_parameter_count_matches_the_model(preset):
    """The FLOP formula's parameter count equals the real model's (all experts counted in the total)."""
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset

    config = get_preset(preset)
    model = Ernie4_5ForCausalLM(config)
    real = sum(
        int(p.numel())
        for n, p in model.named_parameters()
        if "embed_tokens" not in n and "e_score_correction_bias" not in n
    )
    counted = bench_train.active_params(config)
    assert counted["non_embedding_total"] == real
    if config.is_moe:
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        unused = (config.moe_num_experts - config.moe_k) * per_expert * moe_layers
        assert counted["non_embedding_active"] == real - unused
    else:
        assert counted["non_embedding_active"] == real
