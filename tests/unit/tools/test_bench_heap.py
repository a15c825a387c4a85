"""tools/bench_heap.py: the live-allocation sampler sees a block while it lives, and one run of the
tool reports each framework's figures and what lies beyond the live peak."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import bench_heap  # noqa: E402

from erniekit.utils.malloc import mallinfo  # noqa: E402

pytestmark = pytest.mark.skipif(mallinfo() is None, reason="glibc >= 2.33 (mallinfo2)")


def test_the_sampler_sees_a_block_while_it_lives():
    sampler = bench_heap.LivePeak()
    base = sampler.live()
    sampler.restart()
    block = np.ones(48 << 18, np.float32)  # 48 MiB through malloc
    time.sleep(0.05)
    del block
    assert sampler.stop() - base >= 48 << 20
    assert sampler.live() - base < 8 << 20  # and no longer once it is freed


def test_one_run_reports_both_frameworks(tmp_path):
    out = tmp_path / "heap.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_heap.py"), "--model", "tiny-moe", "--steps", "1"]
    cmd += ["--threads", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["model"] == "tiny-moe" and rec["batch"] == [64, 32] and rec["malloc_mmap_mb"] is None
    assert rec["mib"]["erniekit"]["weights_in_malloc"]  # erniekit copies the weights into malloc'd memory
    for fw in ("torch", "erniekit"):
        m = rec["mib"][fw]
        assert 0 < m["import_rss"] <= m["loaded_rss"] <= m["load_peak_rss"] <= m["peak_rss"], (fw, m)
        assert m["live_peak"] > m["live_import"], (fw, m)
        growth = m["live_peak"] - m["live_import"] + (0 if m["weights_in_malloc"] else m["params"])
        assert (
            abs(m["live_growth"] - growth) < 0.5
            and abs(m["beyond_live"] - (m["peak_rss"] - m["import_rss"] - growth)) < 0.5
        )
