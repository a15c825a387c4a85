"""One worker of tests/e2e/test_tp_experts.py (run by paddle.distributed.launch, 2 processes):
StackedExperts split over tp=2 (gate/up column-parallel, down row-parallel, adapters with their
base) against the same layer run whole in this process; writes the largest differences to
OUT/rank{r}.json. The gradient of the gate weights is the router's: a tp rank that got only its
half of it would move its (replicated) router away from the other's."""

import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.distributed.collective.layout import Layout
from erniekit.distributed.collective.runtime import ParallelContext
from erniekit.nn.lora import LoraConfig, LoraStackedExperts
from erniekit.nn.moe import StackedExperts, capacity_keep

E, H, I, T, K = 8, 32, 64, 12, 2  # FP8 blocks of 32: each tp half of I is whole blocks


def make(kind: str):
    paddle.seed(7)
    layer = StackedExperts(E, H, I, fp8_block=32 if kind == "fp8" else 0)
    if kind in ("lora", "dora"):
        layer = LoraStackedExperts(layer, LoraConfig(r=4, lora_alpha=8, use_dora=kind == "dora"))
        for n, p in layer.named_parameters():  # B starts at 0: move it so adapters matter
            if "lora_B" in n:
                p.set_value(paddle.randn(p.shape) * 0.1)
    return layer


def full(t, ctx) -> np.ndarray:
    return dist.reshard(t, ctx.mesh, [dist.Replicate()] * 4).numpy()


def compare(kind: str, case: str, ctx: ParallelContext) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((T, H)).astype("float32"))
    idx = paddle.to_tensor(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]))
    w = paddle.to_tensor(rng.random((T, K)).astype("float32"))
    keep = capacity_keep(idx, E, 2) if case == "capacity" else None

    ref = make(kind)
    xr, wr = x.clone(), w.clone()
    xr.stop_gradient = wr.stop_gradient = False
    y_ref = ref(xr, idx, wr, keep)
    (y_ref * y_ref).sum().backward()

    tp = make(kind)
    ctx.shard_model(tp)
    assert tp.gate_proj._local_value().shape == [E, H, I // 2], tp.gate_proj._local_value().shape
    assert tp.down_proj._local_value().shape == [E, I // 2, H], tp.down_proj._local_value().shape
    place = ctx.place_batch
    xd, wd = place(x), place(w)
    xd.stop_gradient = wd.stop_gradient = False
    y = tp(xd, place(idx), wd, None if keep is None else place(keep))
    (y * y).sum().backward()

    diffs = {  # each rank's own copy of the replicated tensors
        "y": rel(y._local_value(), y_ref),
        "x.grad": rel(xd.grad._local_value(), xr.grad),
        "weight.grad": rel(wd.grad._local_value(), wr.grad),
    }
    mine = dict(tp.named_parameters())
    for n, p in ref.named_parameters():
        if not p.stop_gradient:
            if mine[n].grad is None:
                raise AssertionError(f"{kind}/{case}: no gradient reached {n}")
            diffs[f"{n}.grad"] = rel(full(mine[n].grad, ctx), p.grad)
    return diffs


def rel(got, want) -> float:
    """Largest difference relative to the largest magnitude of `want`."""
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(out: str) -> None:
    dist.init_parallel_env()
    ctx = ParallelContext(Layout(tp=2))
    result = {f"{k}/{c}": compare(k, c, ctx) for k in ("plain", "lora", "dora", "fp8") for c in ("random", "capacity")}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
