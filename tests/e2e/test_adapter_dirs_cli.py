"""`erniekit chat` / `export` / `server` on a PEFT-saved adapter directory (no tokenizer, no
config.json): each answers as PEFT's merged model does; --base-model overrides the adapter's
base_model_name_or_path; a base that cannot be found is a one-line error."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import paddle
import pytest
from launched_jobs import free_port, serve
from peft_adapters import QUESTION, make_peft_adapter, set_base

from erniekit.infer.chat import ChatSession, load_chat_model, stop_ids
from erniekit.infer.sampling import SamplingParams

pytest.importorskip("peft")
ROOT = str(Path(__file__).resolve().parents[2])
MAX_NEW = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    d = make_peft_adapter(str(root))
    d["moved"] = str(root / "moved")  # the same adapter naming a base that is not there
    subprocess.run(["cp", "-r", d["adapter"], d["moved"]], check=True)
    set_base(d["moved"], "/nowhere/ERNIE-4.5-base")
    return d


@pytest.fixture(scope="module")
def reference(dirs):
    """PEFT's merged model, answered in-process as chat answers."""
    model, tok = load_chat_model(dirs["merged"])
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stop_ids(model, tok))
    return ChatSession(model, tok, params).reply(QUESTION)


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "erniekit", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _chat(model_dir, *flags):
    return _cli("chat", model_dir, "--prompt", QUESTION, "--max-new-tokens", str(MAX_NEW), *flags)


def test_chat_on_peft_adapter_equals_merged(dirs, reference):
    r = _chat(dirs["adapter"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == reference.strip() and reference.strip()


def test_chat_base_model_flag_and_missing_base(dirs, reference):
    r = _chat(dirs["moved"], "--base-model", dirs["base"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == reference.strip()
    r = _chat(dirs["moved"])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "/nowhere/ERNIE-4.5-base" in lines[0] and "--base-model" in lines[0], r.stderr
    r = _chat(dirs["merged"], "--base-model", dirs["base"])  # a full checkpoint takes no base
    assert r.returncode == 2 and "no adapter_config.json" in r.stderr


def test_export_of_peft_adapter_equals_merged(dirs, tmp_path):
    out = str(tmp_path / "export")
    r = _cli("export", dirs["moved"], "-o", out, "--base-model", dirs["base"])
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(os.path.join(out, "tokenizer.model"))  # the base's tokenizer travels along
    ids = paddle.to_tensor([[3, 281, 971, 949, 958, 959, 979, 964]])
    got = load_chat_model(out)[0](ids).logits.numpy()
    want = load_chat_model(dirs["merged"])[0](ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    r = _cli("export", "--verify", out, "--base-model", dirs["base"])
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = _cli("export", "--verify", out)  # the base the export was made on is recorded in export_info.json
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_server_on_peft_adapter_with_base_model_flag(dirs, reference):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["server", dirs["moved"], "--base-model", dirs["base"], "--port", str(port), "--max-model-len", "128"]
    for _ in serve(args, url + "/health", ROOT):
        body = {
            "model": "moved",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_NEW,
            "temperature": 0,
        }
        req = urllib.request.Request(
            url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
        assert reply["choices"][0]["message"]["content"] == reference
