"""One worker of tests/e2e/test_expert_exchange.py (run by paddle.distributed.launch, 2 processes):
expert-parallel StackedExperts against the same layer run whole in this process, for several
routings; writes the largest differences to OUT/rank{r}.json."""

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

E, H, I, T, K = 8, 16, 24, 12, 2  # T tokens per rank


def routing(case: str, rank: int, rng: np.random.Generator) -> np.ndarray:
    """[2T, K] expert ids of the whole batch (rank r has rows [rT, (r+1)T))."""
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(2 * T)])
    if case == "local_only":  # every token stays on its own rank: nothing crosses
        idx = np.stack([rng.choice(4, K, replace=False) + (4 if t >= T else 0) for t in range(2 * T)])
    elif case == "one_way":  # rank 0's tokens all go to rank 1's experts, rank 1's stay home
        idx = np.stack([rng.choice(4, K, replace=False) + 4 for _ in range(2 * T)])
    return idx


def make(kind: str):
    paddle.seed(7)
    layer = StackedExperts(E, H, I)
    if kind == "dora":
        layer = LoraStackedExperts(layer, LoraConfig(r=4, lora_alpha=8, use_dora=True))
        for n, p in layer.named_parameters():  # B starts at 0: move it so adapters matter
            if "lora_B" in n:
                p.set_value(paddle.randn(p.shape) * 0.1)
    return layer


def main(out: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    ctx = ParallelContext(Layout(dp=2, ep=2))
    result = {}
    for kind in ("plain", "dora"):
        for case in ("random", "local_only", "one_way", "capacity"):
            rng = np.random.default_rng(0)
            x = paddle.to_tensor(rng.standard_normal((2 * T, H)).astype("float32"))
            idx = paddle.to_tensor(routing(case, rank, rng))
            w = paddle.to_tensor(rng.random((2 * T, K)).astype("float32"))
            keep = None
            if case == "capacity":  # a capacity computed per rank, as MoEBlock does on its rows
                keep = paddle.concat([capacity_keep(idx[:T], E, 2), capacity_keep(idx[T:], E, 2)])

            ref = make(kind)
            xr, wr = x.clone(), w.clone()
            xr.stop_gradient = wr.stop_gradient = False
            y_ref = ref(xr, idx, wr, keep)
            (y_ref * y_ref).sum().backward()

            ep = make(kind)
            ctx.shard_model(ep)
            assert ep.expert_parallel is not None and ep.gate_proj._local_value().shape[0] == E // 2
            place = ctx.place_batch
            xd, wd = place(x), place(w)
            xd.stop_gradient = wd.stop_gradient = False
            y = ep(xd, place(idx), wd, None if keep is None else place(keep))
            (y * y).sum().backward()

            def full(t):
                return dist.reshard(t, ctx.mesh, [dist.Replicate()] * 4).numpy()

            diffs = {
                "y": np.abs(full(y) - y_ref.numpy()).max(),
                "x.grad": np.abs(full(xd.grad) - xr.grad.numpy()).max(),
                "weight.grad": np.abs(full(wd.grad) - wr.grad.numpy()).max(),
            }
            for n, p in ref.named_parameters():
                if not p.stop_gradient:
                    q = dict(ep.named_parameters())[n]
                    if q.grad is None:
                        raise AssertionError(f"{kind}/{case}: no gradient reached {n}")
                    diffs[f"{n}.grad"] = np.abs(full(q.grad) - p.grad.numpy()).max()
            result[f"{kind}/{case}"] = {k: float(v) for k, v in diffs.items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
