"""tools/embedded_default_matrix.py records the sha256 of the training file in a matrix's key, so
a matrix of other data never resumes into, or stands in for, one of the bundled data."""

import hashlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_matrix_key_fingerprints_the_training_file_the_runs_read(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from embedded_default_matrix import train_data_sha256

    config = "examples/configs/tiny/sft_tools.yaml"
    bundled = hashlib.sha256((ROOT / "examples/data/tools/train.jsonl").read_bytes()).hexdigest()
    assert train_data_sha256(config, []) == bundled
    other = tmp_path / "train.jsonl"
    other.write_text('{"messages": []}\n')
    overridden = train_data_sha256(config, ["seed=1", f"train_dataset_path={other}"])
    assert overridden == hashlib.sha256(other.read_bytes()).hexdigest() != bundled
    assert train_data_sha256(config, [f"train_dataset_path={tmp_path / 'missing.jsonl'}"]) is None


def test_a_record_of_another_matrix_is_never_overwritten(tmp_path, capsys, monkeypatch):
    """The data's hash joined the key, so every older record's key differs: resuming into one reset
    it to no runs (16 recorded runs lost at the first finished cell)."""
    import json

    import pytest

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import embedded_default_matrix
    from embedded_default_matrix import main

    def no_training(*args, **kwargs):
        raise AssertionError("a run started over another matrix's record")

    monkeypatch.setattr(embedded_default_matrix, "run_cell", no_training)
    out = tmp_path / "matrix.json"
    old = {"key": {"config": "examples/configs/tiny/sft_tools.yaml", "overrides": []}, "runs": [{"seed": 1}]}
    out.write_text(json.dumps(old))
    with pytest.raises(SystemExit) as e:
        main(["--config", "examples/configs/tiny/sft_tools.yaml", "--seeds", "5", "--out", str(out)])
    assert e.value.code == 2 and "holds 1 runs of another matrix" in capsys.readouterr().err
    assert json.loads(out.read_text()) == old
