"""README's first command, end to end: the embedded default must learn arithmetic from scratch to
README's floor, and GRPO from its result must learn from its rewards (README's RL command, shortened).

This is the slowest test (several minutes on 2 cores); it runs exactly the shipped config, so the
main job exercises the FP8 expert GEMMs (sft.yaml sets fp8: true). Its floor is README's: the
matrix of seeds x thread counts x CPU kernels (tools/embedded_default_matrix.py,
bench_results/embedded_default_matrix.json) never went below it, whatever the machine's last bits.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
README_FLOOR = 0.70  # README: "at least 0.70 on any seed, thread count or CPU kernel set"


def test_readme_states_the_floor_this_test_asserts():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"at least {README_FLOOR:.2f}" in readme
    matrix = json.load(open(os.path.join(ROOT, "bench_results", "embedded_default_matrix.json")))
    assert matrix["key"]["config"] == "examples/configs/tiny/sft.yaml" and not matrix["key"]["overrides"]
    scores = [r["exact_match"] for r in matrix["runs"]]
    assert len(scores) >= 12 and min(scores) >= README_FLOOR, scores
    assert {"native", "avx2"} <= {r["isa"] for r in matrix["runs"]} and {r["threads"] for r in matrix["runs"]} == {1, 2}
    assert {r["seed"] for r in matrix["runs"]} >= {1, 2, 3, 42}


def _train(env: dict, *args: str) -> subprocess.CompletedProcess:
    """`erniekit train ARGS` as README runs it, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_embedded_default_reaches_accuracy(tmp_path):
    out = tmp_path / "tiny-sft"
    # One thread: beside the other pytest worker a second thread only oversubscribes the cores (this
    # run took 701 s at 2 threads in the suite, against ~350 s alone at 1 or 2). The floor holds at
    # either thread count (bench_results/embedded_default_matrix.json).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = _train(env, "examples/configs/tiny/sft.yaml", f"output_dir={out}", "disable_tqdm=true")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = re.search(r"held-out exact match: ([\d.]+) \(majority-answer baseline ([\d.]+)\)", r.stdout)
    assert m, r.stdout[-2000:]
    acc, base = float(m[1]), float(m[2])
    assert acc >= README_FLOOR and acc >= 10 * base, (acc, base)
    results = json.loads((out / "train_results.json").read_text())
    assert results["eval"]["exact_match"] == acc
    run_config = (out / "run_config.yaml").read_text()
    assert "\nfp8: true" in run_config and "\nfp8_grad_format: e5m2" in run_config  # the main job runs FP8 experts
    for f in ("config.json", "model.safetensors", "tokenizer.model", "generation_config.json"):
        assert (out / f).exists()
    assert any(f.startswith("vdlrecords") for f in os.listdir(out / "vdl_log"))

    # GRPO from the SFT result (README's RL command, 50 of its 200 steps). The default's model
    # answers nearly every problem (README's range), so GRPO has almost nothing left to gain here;
    # the test asserts what README's command promises: it loads the SFT result and starts where SFT
    # ended, it does not unlearn, and it logs its rewards and KL. That GRPO learns is tested on a
    # task with a known optimum (tests/unit/rl/test_rl.py).
    r = _train(
        env,
        "examples/configs/tiny/grpo.yaml",
        f"model_name_or_path={out}",
        f"output_dir={tmp_path / 'tiny-grpo'}",
        "max_steps=50",
        "logging_steps=5",
        "disable_tqdm=true",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = re.search(r"held-out exact match: ([\d.]+) \(start ([\d.]+), gain ([-+][\d.]+)\)", r.stdout)
    assert m, r.stdout[-2000:]
    # SFT evaluates with its FP8 expert GEMMs on; GRPO reloads the saved model in full precision
    # (FP8 is a training-time setting), so the starting score may differ by a few of the 500 examples.
    assert abs(float(m[2]) - acc) <= 0.02, (m[0], acc)
    assert float(m[1]) >= float(m[2]) - 0.02, m[0]
    logged = [json.loads(line) for line in open(tmp_path / "tiny-grpo" / "vdl_log" / "scalars.jsonl")]
    rewards = [row["train/reward"] for row in logged if "train/reward" in row]
    assert len(rewards) == 10 and all("train/kl" in row for row in logged if "train/reward" in row)
    assert all(0.0 <= x <= 1.1 for x in rewards), rewards  # accuracy (0/1) + 0.1 x format, averaged
    assert any(row.get("eval/exact_match") == float(m[1]) for row in logged)


def test_every_recorded_matrix_of_the_shipped_default_meets_the_floor():
    """Each recorded run of the shipped config, on any machine or commit (bench_results/
    embedded_default_matrix*.json: the AMD EPYC matrix above, the Intel Xeon one, those of earlier
    speed-ups), finished at or above README's floor."""
    import glob

    runs = []
    for path in glob.glob(os.path.join(ROOT, "bench_results", "embedded_default_matrix*.json")):
        matrix = json.load(open(path))
        key = matrix["key"]  # a newer matrix also names its training data's hash
        if (key["config"], key["overrides"]) == ("examples/configs/tiny/sft.yaml", []):
            runs += [(os.path.basename(path), r) for r in matrix["runs"]]
    assert len({name for name, _ in runs}) >= 2, runs
    assert all(r["returncode"] == 0 and r["exact_match"] >= README_FLOOR for _, r in runs), [
        (name, r["seed"], r["threads"], r["exact_match"]) for name, r in runs if r["exact_match"] < README_FLOOR
    ]
