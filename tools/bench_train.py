#!/usr/bin/env python
"""Training throughput and MFU of erniekit models on this machine, written as JSON.

Peak: the best float32 GEMM rate Paddle reaches in this process (square matmuls), and numpy's
(the machine's BLAS) for reference. Models (pick with --models):

  tiny-moe   the embedded default: preset tiny-moe, batch 64 of the bundled arithmetic SFT
             data (examples/data/arithmetic/train.jsonl, chat template, ~20 tokens a row,
             right-padded per batch as the trainer does)
  0.3b-2l    ERNIE-4.5-0.3B shapes (hidden 1024, 16 q / 2 kv heads of 128, MLP 3072) cut to
             2 layers and vocab 8192, random ids, batch 4 x seq 256

A timed step is what erniekit's trainer does per optimizer step: forward, summed cross-entropy
(erniekit.train.losses.causal_lm_loss_sum) / tokens + router aux loss, backward, global-norm
clip, AdamW step, clear grads.

Model FLOPs per token = 6 * N_active + 12 * L * A * S, where N_active counts non-embedding
parameters with only the moe_k routed + shared experts of a MoE layer, L = layers,
A = num_attention_heads * head_dim (the attention width; = hidden_size when heads*head_dim =
hidden) and S = sequence length. The tied LM head (2 * hidden * vocab per token forward) is
left out, as embeddings are; `mfu_incl_lm_head` counts it. MFU = achieved / Paddle peak.

Paddle reads OMP_NUM_THREADS at import (and sets it to 1 if unset), so the script re-executes
itself with OMP_NUM_THREADS = cpu count when it is not set.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("tiny-moe", "0.3b-2l")
DEFAULT_STEPS = {"tiny-moe": 30, "0.3b-2l": 6}  # timed steps; well under 2 minutes on 2 cores
DEFAULT_WARMUP = {"tiny-moe": 3, "0.3b-2l": 1}  # the first step allocates the AdamW moments


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default=os.path.join("bench_results", "train_bench.json"), help="JSON output (default: %(default)s)"
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)} (default: all)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per model (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps before timing (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_WARMUP.items()) + ")",
    )
    p.add_argument("--peak-sizes", default="1024,2048", help="square matmul sizes for the peak (default: %(default)s)")
    p.add_argument("--peak-repeats", type=int, default=5, help="best of N per matmul size (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="parameter init / data seed (default: %(default)s)")
    ns = p.parse_args(argv)
    ns.models = [m.strip() for m in ns.models.split(",") if m.strip()]
    unknown = [m for m in ns.models if m not in MODELS]
    if unknown or not ns.models:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if ns.steps is not None and ns.steps < 1:
        p.error("--steps must be >= 1")
    if (ns.warmup is not None and ns.warmup < 0) or ns.peak_repeats < 1:
        p.error("--warmup must be >= 0 and --peak-repeats >= 1")
    ns.peak_sizes = [int(s) for s in ns.peak_sizes.split(",") if s.strip()]
    return ns


def _reexec_with_threads() -> None:
    """Paddle fixes its OpenMP pool at import: set the thread count before it is imported."""
    if "OMP_NUM_THREADS" not in os.environ:
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


# ---------------------------------------------------------------------------- peak GEMM
def _best_of(fn, repeats: int) -> float:
    fn()  # warm up (allocations, thread pool)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peaks(sizes: list[int], repeats: int) -> dict:
    """GFLOP/s of float32 n x n x n matmuls (2 n^3 flops), best of `repeats`, Paddle and numpy."""
    import numpy as np
    import paddle

    out: dict = {"paddle": {}, "numpy": {}}
    rng = np.random.default_rng(0)
    for n in sizes:
        a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
        pa, pb = paddle.to_tensor(a), paddle.to_tensor(b)
        flops = 2.0 * n**3
        out["paddle"][str(n)] = round(
            flops / _best_of(lambda pa=pa, pb=pb: paddle.matmul(pa, pb).numpy(), repeats) / 1e9, 2
        )
        out["numpy"][str(n)] = round(flops / _best_of(lambda a=a, b=b: a @ b, repeats) / 1e9, 2)
    out["paddle_peak_gflops"] = max(out["paddle"].values())
    out["numpy_peak_gflops"] = max(out["numpy"].values())
    return out


# ---------------------------------------------------------------------------- model FLOPs
def active_params(config) -> dict[str, int]:
    """Non-embedding parameters touched per token: all dense ones, moe_k routed + shared experts."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    bias = 1 if config.use_bias else 0
    attn = h * q + 2 * h * kv + q * h + bias * (q + 2 * kv + h)
    norms = 2 * h
    total = active = 0
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            sizes, counts = config.expert_sizes, config.experts_per_modality  # one entry per modality
            expert = 3 * h * sizes[0]
            shared = expert * config.moe_num_shared_experts
            router = h * config.total_experts
            total += attn + norms + router + shared + sum(3 * h * s * n for s, n in zip(sizes, counts))
            active += attn + norms + router + shared + expert * config.moe_k  # a text token
        else:
            mlp = 3 * h * config.intermediate_size
            total += attn + norms + mlp
            active += attn + norms + mlp
    total += h  # final norm
    active += h
    return {"non_embedding_total": total, "non_embedding_active": active, "embedding": config.vocab_size * h}


def flops_per_token(config, seq: int) -> dict[str, float]:
    p = active_params(config)
    attn_width = config.num_attention_heads * config.head_dim
    model = 6 * p["non_embedding_active"] + 12 * config.num_hidden_layers * attn_width * seq
    lm_head = 6 * config.hidden_size * config.vocab_size
    return {"model": float(model), "lm_head": float(lm_head), **{k: float(v) for k, v in p.items()}}


# ---------------------------------------------------------------------------- workloads
def tiny_moe_batches(seed: int, batch_size: int = 64, n_batches: int = 8):
    """Real embedded-default batches: arithmetic SFT rows through the chat template, as the trainer sees them."""
    from erniekit.data.encode import encode_conversations
    from erniekit.data.formats import load_sft_examples
    from erniekit.models.ernie4_5 import get_preset
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.train.batching import MicroBatches

    tok = default_tokenizer()
    convs = load_sft_examples(os.path.join(ROOT, "examples", "data", "arithmetic", "train.jsonl"))
    convs = convs[: batch_size * n_batches]
    pairs = encode_conversations(convs, tok, max_seq_len=32)
    import numpy as np

    rows = [{"input_ids": np.asarray(i, np.int64), "labels": np.asarray(l, np.int64)} for i, l in pairs]
    mb = MicroBatches(rows, batch_size, seed, tok.pad_token_id)
    return get_preset("tiny-moe"), [mb.get(i) for i in range(n_batches)]


def dense_03b_batches(seed: int, batch_size: int = 4, seq: int = 256, n_batches: int = 2):
    """ERNIE-4.5-0.3B layer shapes, 2 layers, vocab 8192; random ids, every token trained."""
    import numpy as np

    from erniekit.data.encode import pad_batch
    from erniekit.models.ernie4_5 import get_preset

    config = get_preset("ERNIE-4.5-0.3B").replace(num_hidden_layers=2, vocab_size=8192)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n_batches):
        ids = rng.integers(3, config.vocab_size, size=(batch_size, seq))
        batches.append(pad_batch([(r, r) for r in ids], pad_id=0))
    return config, batches


WORKLOADS = {"tiny-moe": tiny_moe_batches, "0.3b-2l": dense_03b_batches}


def bench_model(name: str, steps: int, warmup: int, seed: int, peaks: dict) -> dict:
    """Time `steps` full training steps after `warmup` ones; throughput, FLOPs and MFU."""
    from types import SimpleNamespace

    import numpy as np
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM
    from erniekit.train.losses import causal_lm_loss_sum, count_target_tokens
    from erniekit.train.optim import build_optimizer, clip_grad_norm_
    from erniekit.train.stage import model_inputs

    config, batches = WORKLOADS[name](seed)
    paddle.seed(seed)
    model = Ernie4_5ForCausalLM(config)
    model.train()
    opt_cfg = SimpleNamespace(learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.01)
    optimizer = build_optimizer(model, opt_cfg)
    params = [p for p in model.parameters() if not p.stop_gradient]
    coef = config.router_aux_loss_coef if config.is_moe else 0.0

    def step(batch) -> tuple[float, list[float]]:
        """One optimizer step; returns the loss and the end times of forward+loss, backward, update.

        Eager CPU kernels run synchronously, so the phase clocks need no extra sync; float()
        of the loss and of a parameter makes sure nothing is pending on a GPU either."""
        out = model(**model_inputs(batch))
        loss = causal_lm_loss_sum(out.logits, batch["labels"]) / max(count_target_tokens(batch), 1)
        if out.aux_loss is not None and coef > 0:
            loss = loss + coef * out.aux_loss
        value = float(loss)
        marks = [time.perf_counter()]
        loss.backward()
        marks.append(time.perf_counter())
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.clear_grad()
        float(params[0].sum())
        marks.append(time.perf_counter())
        return value, marks

    for i in range(warmup):
        step(batches[i % len(batches)])
    times, real_tokens, padded_tokens, flops, flops_head, losses = [], 0, 0, 0.0, 0.0, []
    phases = np.zeros(3)
    for i in range(steps):
        b = batches[(warmup + i) % len(batches)]
        t0 = time.perf_counter()
        value, marks = step(b)
        losses.append(value)
        times.append(marks[-1] - t0)
        phases += np.diff([t0, *marks])
        B, S = b["input_ids"].shape
        real_tokens += int((b["segment_ids"] > 0).sum())
        padded_tokens += B * S
        f = flops_per_token(config, S)
        flops += B * S * f["model"]
        flops_head += B * S * (f["model"] + f["lm_head"])
    total = sum(times)
    achieved = flops / total / 1e9
    seqs = sorted({int(b["input_ids"].shape[1]) for b in batches})
    f = flops_per_token(config, seqs[-1])
    return {
        "model": name,
        "config": {
            k: getattr(config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "moe_num_experts",
                "moe_k",
                "moe_intermediate_size",
                "moe_num_shared_experts",
                "tie_word_embeddings",
            )
        },
        "batch_size": int(batches[0]["input_ids"].shape[0]),
        "seq_lens": seqs,
        "params": {k: int(v) for k, v in f.items() if k not in ("model", "lm_head")},
        "flops_per_token_at_max_seq": f["model"],
        "steps_timed": steps,
        "warmup_steps": warmup,
        "step_time_s_mean": round(total / steps, 4),
        "step_time_s_median": round(statistics.median(times), 4),
        "step_time_s_min": round(min(times), 4),
        "phase_s_mean": {
            k: round(float(v) / steps, 4) for k, v in zip(("forward_loss", "backward", "clip_adamw"), phases)
        },
        "tokens_per_s": round(real_tokens / total, 1),  # non-padding tokens, as the trainer logs
        "padded_tokens_per_s": round(padded_tokens / total, 1),  # tokens computed (incl. right padding)
        "achieved_gflops": round(achieved, 3),
        "mfu": round(achieved / peaks["paddle_peak_gflops"], 4),
        "mfu_vs_numpy_peak": round(achieved / peaks["numpy_peak_gflops"], 4),
        "mfu_incl_lm_head": round(flops_head / total / 1e9 / peaks["paddle_peak_gflops"], 4),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "finite_loss": bool(np.isfinite(losses).all()),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if argv is None:
        _reexec_with_threads()
    sys.path.insert(0, ROOT)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")
        import paddle

    from erniekit.utils.io import atomic_write_json

    paddle.set_device("cpu")
    t_start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    peaks = matmul_peaks(args.peak_sizes, args.peak_repeats)
    print(
        f"peak float32 GEMM: paddle {peaks['paddle_peak_gflops']} GFLOP/s, numpy {peaks['numpy_peak_gflops']} GFLOP/s",
        flush=True,
    )
    results = []
    for name in args.models:
        warmup = DEFAULT_WARMUP[name] if args.warmup is None else args.warmup
        r = bench_model(name, args.steps or DEFAULT_STEPS[name], warmup, args.seed, peaks)
        results.append(r)
        print(
            f"{name}: {r['tokens_per_s']} tokens/s, {r['step_time_s_mean']} s/step, "
            f"{r['achieved_gflops']} GFLOP/s, MFU {r['mfu']:.1%} of paddle peak, "
            f"{r['mfu_vs_numpy_peak']:.1%} of numpy peak",
            flush=True,
        )
    # same GEMM again after the optimizer steps: a drop here is thread-pool interference, not the model
    after = matmul_peaks(args.peak_sizes[:1], args.peak_repeats)["paddle"]
    report = {
        "tool": "tools/bench_train.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": {
            "cpu_count": os.cpu_count(),
            "omp_num_threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
            "threading_env": {
                k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")
            },
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "paddle": paddle.__version__,
            "device": paddle.device.get_device(),
            # other busy processes distort CPU timings (and OpenMP barriers suffer most): check these
            "loadavg_1_5_15_before": load_before,
            "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        },
        "peak": {
            **peaks,
            "method": "float32 n x n @ n x n, 2 n^3 flops, best of --peak-repeats after one warm-up",
            "paddle_after_training": after,
        },
        "flops_formula": (
            "model FLOPs/token = 6 * N_active + 12 * L * A * S; N_active = non-embedding params with "
            "only moe_k routed + shared experts per MoE layer (router included), L = layers, "
            "A = num_attention_heads * head_dim, S = padded sequence length of the batch; tied LM head "
            "(6 * hidden * vocab) excluded, counted only in mfu_incl_lm_head"
        ),
        "mfu_definition": "achieved model GFLOP/s (padded tokens) / paddle_peak_gflops; mfu_vs_numpy_peak uses numpy's",
        "step": (
            "forward + causal_lm_loss_sum / tokens (+ router aux loss) + backward + clip_grad_norm_(1.0) "
            "+ erniekit.train.optim.build_optimizer AdamW step, as the trainer does"
        ),
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
