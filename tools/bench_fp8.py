"""Benchmark block-scaled FP8 matmul (erniekit/nn/fp8.py) against the plain float32 GEMM.

One process, CPU by default: forward+backward wall time (best of N) of paddle.matmul and of
fp8_matmul on expert-sized shapes, the overhead ratio, and the relative Frobenius error of the
output and of both gradients against float32. Writes JSON (default bench_results/fp8_bench.json).

    OMP_NUM_THREADS=1 python tools/bench_fp8.py [--out PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from erniekit.nn.fp8 import fp8_backend, fp8_grouped_matmul, fp8_matmul  # noqa: E402
from erniekit.utils.malloc import keep_freed_memory  # noqa: E402

# (name, M tokens, K, N, block)
SHAPES = [
    ("tiny-moe expert", 512, 128, 128, 128),
    ("tiny-moe expert, block 64", 512, 128, 128, 64),
    ("large expert", 2048, 1024, 1536, 128),
]


def _leaves(M: int, K: int, N: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    g = rng.standard_normal((M, N), dtype=np.float32)
    return x, w, g


def _step(fn, x_np, w_np, g):
    """One forward + backward; returns (y, dx, dw) as numpy."""
    x, w = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    y = fn(x, w)
    y.backward(g)
    return y.numpy(), x.grad.numpy(), w.grad.numpy()


def _best_ms(fn, x_np, w_np, g, repeats: int) -> float:
    x, w = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    best = float("inf")
    for _ in range(repeats + 1):  # first run warms up
        x.clear_gradient()
        w.clear_gradient()
        t = time.perf_counter()
        fn(x, w).backward(g)
        _ = (x.grad.numpy(), w.grad.numpy())  # force completion
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def bench(repeats: int) -> list[dict]:
    rows = []
    for name, M, K, N, block in SHAPES:
        x, w, g_np = _leaves(M, K, N, seed=M + K + N)
        g = paddle.to_tensor(g_np)
        fp8 = lambda a, b, block=block: fp8_matmul(a, b, block=block)  # noqa: E731
        ref, got = _step(paddle.matmul, x, w, g), _step(fp8, x, w, g)
        n = repeats if M * K * N < 1e8 else max(2, repeats // 3)
        t32, t8 = _best_ms(paddle.matmul, x, w, g, n), _best_ms(fp8, x, w, g, n)
        rows.append(
            {
                "shape": name,
                "M": M,
                "K": K,
                "N": N,
                "block": block,
                "repeats": n,
                "fp32_fwd_bwd_ms": round(t32, 3),
                "fp8_fwd_bwd_ms": round(t8, 3),
                "overhead_x": round(t8 / t32, 2),
                "rel_err_y": round(_rel(got[0], ref[0]), 5),
                "rel_err_dx": round(_rel(got[1], ref[1]), 5),
                "rel_err_dw": round(_rel(got[2], ref[2]), 5),
            }
        )
    return rows


# One tiny-moe expert projection over a batch: 3072 routed rows in 8 unequal groups.
GROUP_SIZES = [900, 700, 500, 400, 250, 150, 100, 72]


def bench_grouped(repeats: int) -> dict:
    """All experts of one projection: a float32 GEMM per expert, fp8_matmul per expert (each
    operand quantised per expert) and fp8_grouped_matmul (each operand quantised once)."""
    E, K, N, M = len(GROUP_SIZES), 128, 128, sum(GROUP_SIZES)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((M, K), dtype=np.float32)
    w_np = (rng.standard_normal((E, K, N)) / np.sqrt(K)).astype(np.float32)
    g = paddle.to_tensor(rng.standard_normal((M, N), dtype=np.float32))
    experts = list(range(E))

    def loop(mm):
        def f(x, w):
            ws, xs = paddle.unbind(w), paddle.split(x, GROUP_SIZES)
            return paddle.concat([mm(a, ws[e]) for a, e in zip(xs, experts)])

        return f

    fns = {
        "fp32_loop": loop(paddle.matmul),
        "fp8_loop": loop(fp8_matmul),
        "fp8_grouped": lambda x, w: fp8_grouped_matmul(x, w, GROUP_SIZES, experts),
    }
    ms = {k: _best_ms(f, x_np, w_np, g, repeats) for k, f in fns.items()}
    return {
        "shape": f"tiny-moe projection, {E} experts, {M} rows",
        "groups": GROUP_SIZES,
        **{f"{k}_fwd_bwd_ms": round(v, 3) for k, v in ms.items()},
        "grouped_vs_loop_x": round(ms["fp8_loop"] / ms["fp8_grouped"], 2),
        "grouped_overhead_x": round(ms["fp8_grouped"] / ms["fp32_loop"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results/fp8_bench.json", help="JSON output path")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per small shape (best is kept)")
    args = ap.parse_args(argv)
    paddle.set_device("cpu")
    keep_freed_memory()  # as `erniekit train` does
    rows = bench(args.repeats)
    grouped = bench_grouped(args.repeats)
    result = {
        "what": "fp8_matmul (block-scaled e4m3, all 3 GEMMs) vs float32 paddle.matmul, forward+backward, best of N",
        "backend": fp8_backend() if paddle.device.get_device().startswith("gpu") else "emulated",
        "machine": {
            "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "paddle": paddle.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "grouped": grouped,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'shape':28s} {'M':>5s} {'K':>5s} {'N':>5s} {'blk':>4s} {'fp32 ms':>9s} {'fp8 ms':>9s} "
        f"{'x':>5s} {'err y':>7s} {'err dx':>7s} {'err dw':>7s}"
    )
    for r in rows:
        print(
            f"{r['shape']:28s} {r['M']:5d} {r['K']:5d} {r['N']:5d} {r['block']:4d} {r['fp32_fwd_bwd_ms']:9.2f} "
            f"{r['fp8_fwd_bwd_ms']:9.2f} {r['overhead_x']:5.2f} {r['rel_err_y']:7.4f} {r['rel_err_dx']:7.4f} "
            f"{r['rel_err_dw']:7.4f}"
        )
    print(
        f"grouped ({grouped['shape']}): fp32 loop {grouped['fp32_loop_fwd_bwd_ms']:.2f} ms, fp8 loop "
        f"{grouped['fp8_loop_fwd_bwd_ms']:.2f} ms, fp8 grouped {grouped['fp8_grouped_fwd_bwd_ms']:.2f} ms "
        f"({grouped['grouped_vs_loop_x']}x faster than the loop, {grouped['grouped_overhead_x']}x fp32)"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
