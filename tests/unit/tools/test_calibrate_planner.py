"""tools/calibrate_planner.py: a record's measurements predicted again (--measured), and the
dense-1024 memory table of docs/planner.md against its records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import calibrate_planner as C  # noqa: E402

from erniekit.distributed import planner as P  # noqa: E402


def _table_rows(section: str) -> list[list[str]]:
    return [r.split("|")[1:-1] for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]


def test_measured_predicts_a_records_layouts_again_without_training(tmp_path):
    rec = ROOT / "bench_results" / "planner_calibration_gradients_run3.json"
    out = tmp_path / "again.json"
    assert C.main(["--layouts", "gradients", "--measured", str(rec), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    measured = {(r["model"], r["processes"], r["layout"]): r for r in json.loads(rec.read_text())["rows"]}
    clusters = {
        n: P.load_cluster(str(ROOT / "examples" / "clusters" / f))
        for n, f in ((1, "cpu-2core-1proc.yaml"), (2, "cpu-2core.yaml"))
    }
    assert got["measurements_from"] == str(rec) and len(got["rows"]) == len(C.GRADIENT_LAYOUTS)
    for row, (model, procs, plan) in zip(got["rows"], C.GRADIENT_LAYOUTS):
        old = measured[(model, procs, plan.describe())]
        assert (row["measured_memory"], row["measured_step_s"]) == (old["measured_memory"], old["measured_step_s"])
        g = plan.micro_batch * plan.accumulation * plan.dp
        want = P.predict(C.model_config(model), clusters[procs], P.Workload(g, C.S, fused_head=True), plan)
        assert row["predicted_memory"] == want.memory and row["predicted_step_s"] == want.step_s
    assert got["workload"]["steps"] == json.loads(rec.read_text())["workload"]["steps"]
    with pytest.raises(SystemExit, match="no row for"):  # the default layouts are not in that record
        C.main(["--measured", str(rec), "--out", str(tmp_path / "x.json")])
    for args in (["--measured", str(rec)], ["--measured", str(out), "--out", str(out)]):  # never over a record
        before = out.read_text()
        with pytest.raises(SystemExit):
            C.main(args)
        assert out.read_text() == before


def test_the_planner_gradient_memory_table_quotes_its_records():
    """docs/planner.md's dense-1024 memory table: both predictions and every run's measurement."""
    text = (ROOT / "docs" / "planner.md").read_text()
    section = text.split("### Memory where the gradients weigh", 1)[1].split("\n### ", 1)[0]
    rows = _table_rows(section.split("\n\n- ", 1)[0])
    res = ROOT / "bench_results"
    now = {
        (r["processes"], r["layout"]): r
        for r in json.loads((res / "planner_calibration_gradients.json").read_text())["rows"]
    }
    before = {
        (r["processes"], r["layout"]): r["predicted_memory"]
        for r in json.loads((res / "planner_calibration_gradients_before.json").read_text())["rows"]
    }
    runs = [json.loads((res / f"planner_calibration_gradients_run{i}.json").read_text())["rows"] for i in (1, 2, 3)]
    assert len(rows) == len(now) == 8
    for row, (key, r) in zip(rows, now.items()):
        measured = [x["measured_memory"] for run in runs for x in run if (x["processes"], x["layout"]) == key]
        assert row[0].strip().split()[-1] == key[1].split()[-1] and int(row[1]) == key[0], row
        assert int(row[2]) == round(before[key] / 1e6) and int(row[3]) == round(r["predicted_memory"] / 1e6), row
        assert row[4].strip() == " / ".join(str(round(m / 1e6)) for m in measured), row
        lo, hi = min(measured), max(measured)
        assert row[5].strip() == f"{before[key] / hi:.2f}-{before[key] / lo:.2f}", row
        assert row[6].strip() == f"{r['predicted_memory'] / hi:.2f}-{r['predicted_memory'] / lo:.2f}", row
        assert r["predicted_memory"] >= 0.995 * hi  # the claim: no run above the prediction now
