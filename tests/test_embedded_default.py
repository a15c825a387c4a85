"""README's first command, end to end: the embedded default must learn arithmetic from scratch.

This is the slowest test (about 5 minutes on 2 cores); it runs exactly the shipped config.
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_embedded_default_reaches_accuracy(tmp_path):
    out = tmp_path / "tiny-sft"
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "train", "examples/configs/tiny/sft.yaml", f"output_dir={out}",
         "disable_tqdm=true"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = re.search(r"held-out exact match: ([\d.]+) \(majority-answer baseline ([\d.]+)\)", r.stdout)
    assert m, r.stdout[-2000:]
    acc, base = float(m[1]), float(m[2])
    assert acc >= 0.4 and acc >= 10 * base, (acc, base)  # measured 0.684 vs 0.010
    results = json.loads((out / "train_results.json").read_text())
    assert results["eval"]["exact_match"] == acc
    for f in ("config.json", "model.safetensors", "tokenizer.model", "generation_config.json"):
        assert (out / f).exists()
    assert any(f.startswith("vdlrecords") for f in os.listdir(out / "vdl_log"))
