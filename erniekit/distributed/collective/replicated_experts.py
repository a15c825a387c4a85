"""Routed experts replicated over data-parallel (and tensor-parallel) ranks, run on local tensors.

Without expert parallelism every data rank holds all the experts (Replicate) and routes its own
tokens. Running the grouped expert GEMMs on DistTensors would need every op of the dispatch to
have an SPMD rule, and the FP8 GEMM (erniekit/nn/fp8.py) quantises numpy copies of its operands,
which only exist for local tensors. So a MoE layer's experts run inside `dist.local_map` on this
process's tokens and the whole weights; each trainable weight's local gradient (a sum over this
rank's tokens) is all-reduced over the data ranks on its way out, so it leaves as the Replicate
gradient of the global loss, as Paddle's own data parallelism would give it. Over tensor-parallel
ranks the activations are replicated (a partial sum is reduced first) and each tp rank holds a
slice of every expert's width: outputs and input gradients are summed over the tp ranks
(local_experts.py).

With FP8 the weight-gradient GEMM's token-run tiles hold this rank's tokens only (as any data-
parallel FP8 training quantises its local GEMM), so its scales, and the last bits of the curve,
differ from one process on the whole batch; every other tile is per token or per weight block.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from erniekit.distributed.collective.local_experts import TensorParallelExperts, run_local


class ReplicatedExperts:
    def __init__(self, mesh, group, size: int, tensor: TensorParallelExperts | None = None):
        """group: the process group of this rank's data ranks (None: the whole job); size: how many
        they are (1: nothing to sum, e.g. tensor parallelism alone); tensor: the tp ranks that
        split the experts' width (None: no tensor parallelism)."""
        self.mesh, self.group, self.size, self.tensor = mesh, group, size, tensor

    def _sum_over_data_ranks(self, grad: paddle.Tensor) -> paddle.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=self.group)
        return grad

    def _hook_weights(self, weights: list[paddle.Tensor]) -> None:
        for w in weights:
            if not w.stop_gradient:
                w.register_hook(self._sum_over_data_ranks)

    def run(self, fn, x, topk_idx, topk_weight, keep, params: dict) -> paddle.Tensor:
        """fn(x, topk_idx, topk_weight, keep, params) on local tensors; the result is placed as x."""
        if self.size > 1 and self.group is None:  # summed in the optimizer's bucketed all-reduce
            for w in params.values():
                w.grad_sums_over_ranks = True
        hook = self._hook_weights if self.size > 1 and self.group is not None else None  # a subgroup
        return run_local(fn, self.mesh, x, topk_idx, topk_weight, keep, params, on_weights=hook, tensor=self.tensor)
