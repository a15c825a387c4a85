"""lm-evaluation-harness against a live `erniekit server` (issue #28): its `local-completions`
model runs the bundled loglikelihood task (examples/lm_eval/erniekit_arith) through the server's
echo + logprobs and its remote tokenizer (/tokenize, /tokenizer_info), and every per-example
loglikelihood equals a direct computation with our model on the same tokens within 1e-4."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import paddle
import pytest
from launched_jobs import free_port, serve

from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

pytestmark = pytest.mark.e2e
lm_eval = pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "lm_eval"
MODEL = "tiny-eval"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lmeval") / "ckpt")
    paddle.seed(3)
    save_pretrained(Ernie4_5ForCausalLM(get_preset("tiny-moe")), path, tokenizer=default_tokenizer())
    return path


@pytest.fixture(scope="module")
def base(ckpt):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["server", ckpt, "--port", str(port), "--max-batch", "8", "--max-model-len", "256"]
    for _ in serve([*args, "--served-model-name", MODEL], url + "/health", str(ROOT)):
        yield url


def _direct(model, tok, context: str, continuation: str) -> float:
    """lm-eval's own split (trailing spaces of the context move to the continuation; the
    continuation's tokens are those of the whole text past the context's), scored by one forward."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    cont = whole[len(ctx) :]
    with paddle.no_grad():
        z = model(paddle.to_tensor([whole])).logits[0].astype("float32").numpy().astype(np.float64)
    z -= z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(lp[np.arange(len(ctx) - 1, len(whole) - 1), cont].sum())


def test_lm_eval_local_completions_loglikelihoods_equal_our_model(base, ckpt):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from erniekit.models.registry import load_model, load_tokenizer

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    out = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{base}/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "remote",
            "batch_size": 4,  # four prompts per request: the token-id-list form
            "max_retries": 1,
        },
        tasks=["erniekit_arith"],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )
    samples = out["samples"]["erniekit_arith"]
    assert len(samples) == 12
    acc = out["results"]["erniekit_arith"]["acc,none"]
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    model.eval()
    got, want = [], []
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            got.append(resp[0][0])
            want.append(_direct(model, tok, context, continuation))
    assert len(got) == 48
    np.testing.assert_allclose(got, want, atol=1e-4)
    # the task's accuracy is lm-eval's argmax over those same loglikelihoods
    picks = [int(np.argmax([r[0][0] for r in s["resps"]])) == s["target"] for s in samples]
    assert acc == pytest.approx(np.mean(picks))


def test_erniekit_eval_lm_eval_reports_the_accuracy_our_model_gives(ckpt, tmp_path):
    """`erniekit eval CKPT --lm-eval erniekit_arith --limit 6`: the printed table and the results file
    carry the accuracy a direct scoring of those 6 questions with our model gives."""
    import json
    import subprocess
    import sys

    from erniekit.models.registry import load_model, load_tokenizer

    out = tmp_path / "ev"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "erniekit",
            "eval",
            ckpt,
            "--lm-eval",
            "erniekit_arith",
            "--limit",
            "6",
            "--out",
            str(out),
        ],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "erniekit_arith" in r.stdout and "acc" in r.stdout
    acc = json.loads((out / "lm_eval_results.json").read_text())["results"]["erniekit_arith"]["acc,none"]
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    model.eval()
    docs = [json.loads(line) for line in (TASKS / "erniekit_arith" / "erniekit_arith.jsonl").read_text().splitlines()]
    hits = []
    for d in docs[:6]:
        context = f"Question: {d['question']}\nAnswer:"
        scores = [_direct(model, tok, context, " " + c) for c in d["choices"]]
        hits.append(int(np.argmax(scores)) == d["label"])
    assert acc == pytest.approx(np.mean(hits))


def test_erniekit_eval_lm_eval_names_an_unknown_task_in_one_line(ckpt):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "erniekit", "eval", ckpt, "--lm-eval", "no_such_task"],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "no task no_such_task" in r.stderr and len(r.stderr.strip().splitlines()) == 1
