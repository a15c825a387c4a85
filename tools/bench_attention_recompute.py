"""The CPU attention kernel with its probabilities saved against recomputed from the rows' softmax
statistics (erniekit/nn/fused_attention.py, nn/kernel_memory.py): forward + backward time per shape,
one process alternating both ways (causal mask, GQA 16 -> 2 heads unless the shape says otherwise).

    OMP_NUM_THREADS=2 python tools/bench_attention_recompute.py [--out bench_results/attention_recompute.json]

Each shape: the median of its calls for each way, alternated twice; the minimum of the two medians is
reported. The ratio is recomputed / saved time (> 1: recomputing is slower)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [  # B, S, heads, kv heads, head width
    (64, 32, 8, 2, 16),  # the embedded default's attention
    (4, 256, 16, 2, 64),  # dense-1024
    (8, 256, 16, 2, 64),
    (2, 512, 16, 2, 64),
    (2, 256, 16, 2, 128),  # ERNIE-4.5-0.3B's heads
    (1, 1024, 16, 2, 64),
    (1, 2048, 16, 2, 64),
    (1, 4096, 16, 2, 64),
]


def measure(shape, calls: int) -> dict:
    import numpy as np
    import paddle

    from erniekit.nn import fused_attention as fa
    from erniekit.nn import kernel_memory

    B, S, H, KVH, D = shape
    rng = np.random.default_rng(0)
    q, k, v = (
        paddle.to_tensor(rng.standard_normal((B, S, h, D)).astype("float32"), stop_gradient=False)
        for h in (H, KVH, KVH)
    )
    causal = np.arange(S)[:, None] < np.arange(S)[None, :]
    bias = paddle.to_tensor(np.where(causal, np.float32(-1e30), np.float32(0))[None, None].astype("float32"))
    do = paddle.to_tensor(rng.standard_normal((B, S, H, D)).astype("float32"))
    best, limit = {}, kernel_memory.KEEP_PROBS_BYTES
    for way in ("saved", "recomputed") * 2:
        kernel_memory.KEEP_PROBS_BYTES = 1 << 62 if way == "saved" else -1
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fa.fused_attention(q, k, v, bias, D**-0.5).backward(do)
            times.append(time.perf_counter() - t0)
            for t in (q, k, v):
                t.clear_grad()
        best[way] = min(best.get(way, float("inf")), float(np.median(times)))
    kernel_memory.KEEP_PROBS_BYTES = limit
    return {
        "shape": {"batch": B, "seq": S, "heads": H, "kv_heads": KVH, "head_dim": D},
        "probs_mib": B * H * S * S * 4 / 2**20,
        "saved_s": best["saved"],
        "recomputed_s": best["recomputed"],
        "ratio": best["recomputed"] / best["saved"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq", type=int, default=4096, help="skip shapes longer than this")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "attention_recompute.json"))
    a = p.parse_args(argv)
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    rows = []
    for shape in SHAPES:
        if shape[1] > a.max_seq:
            continue
        row = measure(shape, calls=20 if shape[1] <= 512 else 6 if shape[1] <= 1024 else 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    out = Path(a.out)
    record = json.loads(out.read_text()) if out.is_file() else {"what": __doc__.split("\n")[0], "runs": []}
    record["runs"].append({"threads": threads, "rows": rows})
    out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
