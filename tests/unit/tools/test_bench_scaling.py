"""tools/bench_scaling.py's weak-scaling record (with the training runs replaced by fixed step
times), and the docs' weak-scaling table against the record it quotes."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import bench_scaling as BS  # noqa: E402

STEP = {"one": 0.050, "shm": 0.054, "gloo": 0.064, "whole": 0.070, "pair": 0.052}  # seconds a step


def _fake_run(calls):
    def run(model, procs, extra, steps, out, threads=1, batch=BS.B, env=None):
        if out.endswith("-1x2"):
            kind = "whole"
        elif "-pair-" in out:
            kind = "pair"
            calls.append(("pair-start", model, time.perf_counter()))
            time.sleep(0.2)  # the two independent runs must overlap
        elif procs == 2:
            kind = "gloo" if env == BS.GLOO else "shm"
        else:
            kind = "one"
        calls.append((kind, model, time.perf_counter()))
        return {"bytes": 0, "step_s": STEP[kind] * (1.1 if model == "tiny-moe" else 1.0)}

    return run


def test_weak_scaling_records_median_and_range_of_every_figure(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(BS, "run", _fake_run(calls))
    got = BS.weak_scaling(25, 2, str(tmp_path))
    assert set(got) == {"tiny-dense", "tiny-moe"}
    r = got["tiny-dense"]
    assert r["weak_scaling_efficiency"]["median"] == pytest.approx(0.050 / 0.054)
    assert r["weak_scaling_efficiency_gloo"]["runs"] == pytest.approx([0.050 / 0.064] * 2)
    assert r["independent_processes_ceiling"]["max"] == pytest.approx(0.050 / 0.052)
    assert r["two_processes_vs_one_with_2_threads"]["min"] == pytest.approx(0.070 / 0.054)
    assert r["tokens_per_s_2proc"]["median"] == pytest.approx(2 * BS.B * BS.S / 0.054)
    # every repeat runs every kind of both models, interleaved
    assert [k for k, m, _ in calls if m == "tiny-moe" and k != "pair-start"] == [
        "one",
        "shm",
        "gloo",
        "whole",
        "pair",
        "pair",
    ] * 2
    starts = [t for k, m, t in calls if k == "pair-start"][:2]
    ends = [t for k, m, t in calls if k == "pair"][:2]
    assert max(starts) < min(ends)  # the second started before the first ended: they ran at the same time


def _docs_row(model: str) -> list[str]:
    text = (ROOT / "docs" / "distributed.md").read_text()
    section = text[text.index("**Data-parallel weak scaling") : text.index("**Communication volume per step.**")]
    rows = [line for line in section.splitlines() if line.startswith(f"| {model} |")]
    assert len(rows) == 1
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_the_docs_table_quotes_its_record(model):
    rec = json.loads((ROOT / "bench_results" / "scaling_bench_weak_5repeats.json").read_text())["weak_scaling"][model]
    cells = _docs_row(model)

    def nums(cell):
        return [float(x) for x in re.findall(r"\d+\.\d+|\d+", cell)]

    assert nums(cells[1]) == [round(rec["tokens_per_s_1proc_1thread"]["median"])]
    assert nums(cells[2]) == [round(rec["tokens_per_s_2proc"]["median"])]
    for cell, key in zip(
        cells[3:], ["weak_scaling_efficiency", "weak_scaling_efficiency_gloo", "independent_processes_ceiling"]
    ):
        s = rec[key]
        assert nums(cell) == [round(s["median"], 2), round(s["min"], 2), round(s["max"], 2)], (key, cell)
