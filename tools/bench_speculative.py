"""Benchmark greedy self-speculative decoding (erniekit/infer/speculative.py) against plain greedy.

For each prompt of an SFT eval set, both decoders run one after the other (interleaved, so load
from other processes hits both alike) at batch size 1; the outputs must be identical. Reported:
acceptance (mean accepted drafts per verify step), trunk forwards per generated token, and
tokens/s of each. Two settings: chat replies (stop at sep/eos) and fixed-length continuations
(no stop tokens). Writes JSON (default bench_results/speculative_bench.json).

    python tools/bench_speculative.py MODEL_DIR [MODEL_DIR ...] [--data eval.jsonl] [--samples N] [--out PATH]

MODEL_DIR needs MTP heads, e.g. from
    erniekit train examples/configs/tiny/sft.yaml model_overrides.num_nextn_predict_layers=2 max_steps=400
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import paddle  # noqa: E402

from erniekit.data.formats import load_sft_examples  # noqa: E402
from erniekit.infer.generate import SamplingParams, generate  # noqa: E402
from erniekit.infer.speculative import SpeculativeStats, speculative_generate  # noqa: E402
from erniekit.models.ernie4_5.checkpoint import from_pretrained  # noqa: E402
from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer  # noqa: E402
from erniekit.train.evaluation import prompt_ids  # noqa: E402


def run_setting(model, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Both decoders on every prompt; times summed over prompts (best of 2 per prompt)."""
    stats = SpeculativeStats()
    t_plain = t_spec = 0.0
    for p in prompts:
        best_plain = best_spec = float("inf")
        for rep in range(2):
            t = time.perf_counter()
            want = generate(model, [p], params)[0]
            best_plain = min(best_plain, time.perf_counter() - t)
            t = time.perf_counter()
            got = speculative_generate(model, p, params, stats if rep == 0 else None)
            best_spec = min(best_spec, time.perf_counter() - t)
            if got != want:
                raise SystemExit(f"speculative output differs from greedy on prompt {p}: {got} vs {want}")
        t_plain, t_spec = t_plain + best_plain, t_spec + best_spec
    n_tokens = stats.emitted  # generated tokens, stop tokens included (both decoders compute them)
    return {
        "prompts": len(prompts),
        "max_new_tokens": params.max_new_tokens,
        "stop_tokens": bool(params.stop_token_ids),
        "generated_tokens": n_tokens,
        "verify_steps": stats.verify_steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_mean_accepted_per_verify": round(stats.acceptance, 4),
        "draft_accept_rate": round(stats.accepted / max(stats.drafted, 1), 4),
        "trunk_forwards_per_token_speculative": round((stats.verify_steps + len(prompts)) / max(n_tokens, 1), 4),
        "greedy_tokens_per_s": round(n_tokens / t_plain, 1),
        "speculative_tokens_per_s": round(n_tokens / t_spec, 1),
        "speedup": round(t_plain / t_spec, 3),
        "outputs_identical": True,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR")
    ap.add_argument("--data", default=str(ROOT / "examples/data/arithmetic/eval.jsonl"))
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--long-samples", type=int, default=15)
    ap.add_argument("--long-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench_results/speculative_bench.json"))
    a = ap.parse_args()
    paddle.set_device("cpu")
    convs = load_sft_examples(a.data)
    models = {}
    for path in a.model_dirs:
        model = from_pretrained(path)
        model.eval()
        tok = ErnieTokenizer.from_pretrained(path)
        prompts = [prompt_ids(c, tok) for c in convs]
        stops = sorted({tok.sep_token_id, tok.eos_token_id, *model.config.eos_token_ids})
        models[path] = {
            "num_nextn_predict_layers": model.config.num_nextn_predict_layers,
            "chat_replies": run_setting(
                model, prompts[: a.samples], SamplingParams(max_new_tokens=8, stop_token_ids=stops)
            ),
            "fixed_length": run_setting(model, prompts[: a.long_samples], SamplingParams(max_new_tokens=a.long_tokens)),
            "load_avg_1min_after": round(os.getloadavg()[0], 2),
        }
    result = {
        "what": "greedy self-speculative decoding with MTP heads vs plain greedy generate, batch 1, CPU, "
        "outputs checked identical; times: best of 2 per prompt, summed",
        "data": a.data,
        "machine": {
            "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "paddle": paddle.__version__,
            "python": platform.python_version(),
        },
        "models": models,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(models, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
