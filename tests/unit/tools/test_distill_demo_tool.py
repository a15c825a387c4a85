"""tools/distill_demo.py: the plain-SFT leg stays teacherless whatever the overrides, and the
recorded teacher is the one the run used."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import distill_demo  # noqa: E402


def test_a_teacher_override_reaches_the_distill_leg_only(monkeypatch, tmp_path):
    cmds = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or SimpleNamespace(returncode=1, stdout="", stderr="x")
    )
    for method in ("distill", "sft"):
        distill_demo.run_cell(
            distill_demo.CONFIG, ["teacher_name_or_path=/t", "max_steps=5"], method, 1, 1, tmp_path / method
        )
    distill, sft = cmds
    assert "teacher_name_or_path=/t" in distill and "stage=SFT" not in distill
    # later keys win in the CLI: the SFT leg's own keys come after the user's
    assert sft.index("teacher_name_or_path=null") > sft.index("teacher_name_or_path=/t")
    assert sft[-4:] == distill_demo.METHODS["sft"] and "max_steps=5" in sft


def test_the_plain_sft_leg_of_the_shipped_config_is_a_valid_sft_run():
    """The comparison drops every Distill-only key (the hidden-state loss included): the CLI refuses
    them outside stage Distill."""
    from erniekit.config import load_config, validate

    cfg = validate(load_config(str(distill_demo.ROOT / distill_demo.CONFIG), distill_demo.METHODS["sft"]))
    assert cfg.stage == "SFT" and cfg.teacher_name_or_path is None and cfg.distill_hidden_weight == 0


def test_the_recorded_teacher_follows_an_override(tmp_path):
    (tmp_path / "train_results.json").write_text(
        json.dumps({"eval": {"exact_match": 0.9, "loss": 0.1}, "global_step": 7})
    )
    rec = distill_demo.teacher_record(distill_demo.CONFIG, [f"teacher_name_or_path={tmp_path}"])
    assert rec == {"path": str(tmp_path), "exact_match": 0.9, "eval_loss": 0.1, "global_step": 7}
    assert distill_demo.teacher_record(distill_demo.CONFIG)["path"] == "output/tiny-sft"


def test_the_config_key_follows_values_not_comments(tmp_path, monkeypatch):
    monkeypatch.setattr(distill_demo, "ROOT", tmp_path)
    (tmp_path / "c.yaml").write_text("# a comment\nmax_steps: 600\nseed: 42\n")
    first = distill_demo.config_sha256("c.yaml")
    (tmp_path / "c.yaml").write_text("seed: 42   # reordered, commented\nmax_steps: 600\n")
    assert distill_demo.config_sha256("c.yaml") == first
    (tmp_path / "c.yaml").write_text("max_steps: 601\nseed: 42\n")
    assert distill_demo.config_sha256("c.yaml") != first


def test_the_comparison_the_shipped_config_documents_is_a_valid_run():
    """The header's plain-SFT command (the same student by SFT) validates as written."""
    import shlex

    from erniekit.config import load_config, validate

    text = (distill_demo.ROOT / distill_demo.CONFIG).read_text()
    line = next(ln for ln in text.splitlines() if "stage=SFT" in ln)
    args = shlex.split(line.lstrip("#").strip())
    assert args[:3] == ["erniekit", "train", distill_demo.CONFIG]
    cfg = validate(load_config(str(distill_demo.ROOT / args[2]), args[3:]))
    assert cfg.stage == "SFT" and cfg.distill_hidden_weight == 0
