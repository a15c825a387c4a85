"""tools/make_onpolicy_pairs.py: pairs of (right answer, the model's own wrong answer)."""

import json
import os
import subprocess
import sys

import paddle

from erniekit.data.preference import load_preference_pairs
from erniekit.data.synthetic import answer
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_onpolicy_pairs_are_valid_preferences(tmp_path):
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1, initializer_range=0.2))
    save_pretrained(model, str(tmp_path / "m"), tokenizer=default_tokenizer())
    out = tmp_path / "pairs.jsonl"
    r = subprocess.run([sys.executable, "tools/make_onpolicy_pairs.py", str(tmp_path / "m"), "--problems", "30",
                        "--samples", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    pairs = load_preference_pairs(str(out))  # validates the ERNIEKit format, chosen != rejected
    assert pairs and all(p.chosen == answer(p.prompt) != p.rejected for p in pairs)
    assert all(json.loads(line)["sort"] == [1, 0] for line in out.read_text().splitlines())
