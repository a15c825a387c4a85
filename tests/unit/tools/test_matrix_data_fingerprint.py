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
