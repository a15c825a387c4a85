"""Deploy benchmark (issue #9): weight-only export sizes and accuracy, and the built-in engine's
decode speed and time to first token against transformers `generate` on the same checkpoint.

    python tools/bench_deploy.py [--model output/tiny-sft] [--out bench_results/deploy_bench.json]

The model defaults to the embedded default's result (README's first command writes it).
1. Exports the model as hf, wint8 and wint4; reports weight bytes, the --verify figures and the
   held-out exact match of each (examples/data/arithmetic/eval.jsonl, greedy).
2. Decoding, both engines in this process on the same threads: one request (time to first token,
   decode tokens/s after it), then `--concurrent` requests at once (mean time to first token,
   total generated tokens/s). The built-in engine takes requests as they come (continuous
   batching); transformers runs the concurrent prompts as one left-padded `generate` batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def weight_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


def quant_report(model_dir: str, data: str, samples: int) -> list[dict]:
    from erniekit.data.formats import load_sft_examples
    from erniekit.export.hf import export_hf, verify
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer
    from erniekit.models.registry import load_model_or_adapter
    from erniekit.train.evaluation import exact_match_eval

    convs = load_sft_examples(data)[:samples]
    tok = ErnieTokenizer.from_pretrained(model_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("hf", "wint8", "wint4"):
            out = os.path.join(tmp, fmt)
            export_hf(model_dir, out, fmt=fmt)
            v = verify(out)
            model = load_model_or_adapter(out)
            model.eval()
            em = exact_match_eval(model, tok, convs, 64, 16)
            rows.append(
                {
                    "format": fmt,
                    "weight_bytes": weight_bytes(out),
                    "exact_match": em,
                    "max_abs_logit_diff": v["max_abs_diff"],
                    "greedy_agreement": v["same_greedy"],
                }
            )
            print(rows[-1], flush=True)
        base = rows[0]
        for r in rows:
            r["size_vs_hf"] = r["weight_bytes"] / base["weight_bytes"]
            r["exact_match_change"] = r["exact_match"] - base["exact_match"]
    return rows


def prompts_of(tok, n: int) -> list[list[int]]:
    from erniekit.infer.chat import chat_prompt_ids

    return [chat_prompt_ids(tok, [{"role": "user", "content": f"{i + 3}+{2 * i + 1}="}]) for i in range(n)]


def engine_speed(model_dir: str, new_tokens: int, concurrent: int) -> dict:
    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.engine import Engine, Request
    from erniekit.infer.sampling import SamplingParams

    model, tok = load_chat_model(model_dir)
    engine = Engine(model, tok, max_batch=concurrent, max_model_len=256)  # no stop ids: fixed lengths

    def run(prompts):
        first, end, done = {}, {}, threading.Event()
        left = [len(prompts)]
        lock = threading.Lock()
        reqs = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):

            def emit(delta, finish, i=i):
                now = time.perf_counter()
                first.setdefault(i, now)
                if finish is not None:
                    end[i] = now
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            done.set()

            r = Request(p, SamplingParams(max_new_tokens=new_tokens), emit)
            reqs.append(r)
            engine.submit(r)
        done.wait(600)
        wall = max(end.values()) - t0
        tokens = sum(len(r.completion) for r in reqs)
        ttft = [first[i] - t0 for i in range(len(prompts))]
        return tokens, wall, ttft, [(end[i] - first[i]) for i in range(len(prompts))], reqs

    try:
        ps = prompts_of(tok, concurrent)
        run(ps[:1])  # warm-up
        tokens, wall, ttft, decode, reqs = run(ps[:1])
        single = {"ttft_s": ttft[0], "decode_tokens_per_s": (len(reqs[0].completion) - 1) / decode[0]}
        tokens, wall, ttft, _, _ = run(ps)
        conc = {"mean_ttft_s": sum(ttft) / len(ttft), "tokens_per_s": tokens / wall, "wall_s": wall}
    finally:
        engine.close()
    return {"single": single, "concurrent": conc}


def transformers_speed(hf_dir: str, new_tokens: int, concurrent: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

    torch.set_num_threads(threads)
    tok = ErnieTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id or 0

    def gen(prompts, n):
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - t0, int((out.shape[1] - L) * len(prompts))

    ps = prompts_of(tok, concurrent)
    gen(ps[:1], 2)  # warm-up
    t1, _ = gen(ps[:1], 1)
    tn, _ = gen(ps[:1], new_tokens)
    single = {"ttft_s": t1, "decode_tokens_per_s": (new_tokens - 1) / max(tn - t1, 1e-9)}
    t1c, _ = gen(ps, 1)
    tnc, tokens = gen(ps, new_tokens)
    return {"single": single, "concurrent": {"mean_ttft_s": t1c, "tokens_per_s": tokens / tnc, "wall_s": tnc}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "output", "tiny-sft"))
    ap.add_argument("--data", default=os.path.join(ROOT, "examples", "data", "arithmetic", "eval.jsonl"))
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "deploy_bench.json"))
    a = ap.parse_args()
    if not os.path.isdir(a.model):
        sys.exit(f"{a.model}: no model; run README's first command (erniekit train examples/configs/tiny/sft.yaml)")
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    report = {"model": a.model, "threads": threads, "new_tokens": a.new_tokens, "concurrent": a.concurrent}
    report["quantization"] = quant_report(a.model, a.data, a.samples)
    from erniekit.export.hf import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        hf = export_hf(a.model, os.path.join(tmp, "hf"))
        report["erniekit_engine"] = engine_speed(hf, a.new_tokens, a.concurrent)
        print(report["erniekit_engine"], flush=True)
        report["transformers_generate"] = transformers_speed(hf, a.new_tokens, a.concurrent, threads)
        print(report["transformers_generate"], flush=True)
    e, t = report["erniekit_engine"], report["transformers_generate"]
    report["ratios_engine_over_transformers"] = {
        "single_decode_tokens_per_s": e["single"]["decode_tokens_per_s"] / t["single"]["decode_tokens_per_s"],
        "single_ttft": e["single"]["ttft_s"] / t["single"]["ttft_s"],
        "concurrent_tokens_per_s": e["concurrent"]["tokens_per_s"] / t["concurrent"]["tokens_per_s"],
        "concurrent_mean_ttft": e["concurrent"]["mean_ttft_s"] / t["concurrent"]["mean_ttft_s"],
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["ratios_engine_over_transformers"], indent=1))


if __name__ == "__main__":
    main()
