"""tools/make_onpolicy_pairs.py: pairs of (right answer, the model's own wrong answer)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import paddle

from erniekit.data.preference import load_preference_pairs
from erniekit.data.synthetic import answer
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

ROOT = str(Path(__file__).resolve().parents[3])


def test_onpolicy_pairs_are_valid_preferences(tmp_path):
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1, initializer_range=0.2))
    save_pretrained(model, str(tmp_path / "m"), tokenizer=default_tokenizer())
    out = tmp_path / "pairs.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "tools/make_onpolicy_pairs.py",
            str(tmp_path / "m"),
            "--problems",
            "30",
            "--samples",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr
    pairs = load_preference_pairs(str(out))  # validates the ERNIEKit format, chosen != rejected
    assert pairs and all(p.chosen == answer(p.prompt) != p.rejected for p in pairs)
    assert all(json.loads(line)["sort"] == [1, 0] for line in out.read_text().splitlines())


def test_matrix_runs_every_cell_within_the_cores_and_never_idles_a_core_behind_a_wide_run():
    """tools/embedded_default_matrix.run_all: threads in use never exceed the cores; while a
    2-thread run waits for both cores, 1-thread runs still start two at a time."""
    import threading
    import time

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from embedded_default_matrix import run_all

    lock, busy, peak, log = threading.Lock(), [0], [0], []

    def run(cell):
        with lock:
            busy[0] += cell[1]
            peak[0] = max(peak[0], busy[0])
            log.append(("start", cell, busy[0]))
        time.sleep(0.05)
        with lock:
            busy[0] -= cell[1]
        return {"cell": cell}

    cells = [(1, 2, "a"), (2, 2, "a"), (1, 1, "a"), (2, 1, "a"), (3, 1, "a"), (4, 1, "a")]
    got = []
    run_all(cells, capacity=2, jobs=2, run=run, done=lambda rec: got.append(rec["cell"]))
    assert sorted(got) == sorted(cells) and peak[0] == 2
    one_thread = [b for kind, c, b in log if c[1] == 1]
    # the four 1-thread runs went two at a time (a third 2 when one of a pair ends before the other)
    assert one_thread.count(2) >= 2 and max(one_thread) == 2
    # a cell wider than the machine still runs, alone
    got.clear()
    run_all([(1, 4, "a"), (2, 1, "a")], capacity=2, jobs=2, run=run, done=lambda rec: got.append(rec["cell"]))
    assert sorted(got) == [(1, 4, "a"), (2, 1, "a")]
