"""Data-parallel ranks as whole-model replicas (erniekit/distributed/collective/replicas.py): each
rank runs its rows of every micro-batch as one process would, then the gradients and the step's
sums are added up over the ranks."""

from __future__ import annotations

from erniekit.train.optim import clip_grad_norm_
from erniekit.train.runners.base import StepSums
from erniekit.train.runners.local import LocalRunner

_SIGNALS = 65  # stop votes by signal number (0: none); Linux numbers them below 65


class ReplicaRunner(LocalRunner):
    name = "replicas"

    def __init__(self, ctx, precision=None, distill_weight: float = 0.0):
        super().__init__(ctx, precision, distill_weight)
        self.replicas = ctx.replicas
        self.optimizer_state_placements = None  # plain tensors: each rank keeps the whole state
        self.agreed = 0  # the stop signal the last step's all-reduce agreed on

    def rows(self, batch: dict) -> tuple[dict, float]:
        return self.replicas.local_rows(batch)

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        from erniekit.utils.run_control import stop_signal

        sums = super().forward_backward(trainer, micro, n_units, specs)
        keys = [*sums.metrics, *sums.elastic]
        votes = [0.0] * _SIGNALS  # this rank's stop request, one-hot by signal number
        votes[min(stop_signal(), _SIGNALS - 1)] = 1.0
        values = [sums.loss_sum, sums.aux_sum, *sums.metrics.values(), *sums.elastic.values(), *votes]
        vals = self.replicas.all_reduce(trainer.params, values)
        sums.loss_sum, sums.aux_sum = vals[0], vals[1]
        for k, v in zip(keys, vals[2 : 2 + len(keys)]):
            (sums.metrics if k in sums.metrics else sums.elastic)[k] = v
        counts = vals[2 + len(keys) :]
        self.agreed = max((s for s in range(1, _SIGNALS) if counts[s] > 0.5), default=0)
        return sums

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        """The gradients are already the sums over the ranks, the same on each: clip them in place."""
        return clip_grad_norm_(trainer.clip_params, max_norm), None

    def agree_stop(self, local: int) -> int:
        """The highest stop signal any rank had when the step's all-reduce ran (the same on every
        rank, without a collective of its own): a request that comes later is in the next step's."""
        return self.agreed
