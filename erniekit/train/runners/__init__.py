"""Step runners, one per topology (erniekit/train/runners/base.py says what a runner does)."""

from __future__ import annotations

from erniekit.train.runners.base import StepRunner, StepSums


def collective_runner(ctx, model, stage, precision=None, distill_weight: float = 0.0) -> StepRunner:
    """The runner of a single process (ctx None) or a collective job's rank: pipeline segments when
    the job has them, whole-model replicas when it only splits the batch, else local (PS workers get theirs with their connection to the servers)."""
    if ctx is not None and ctx.pipeline is not None:
        from erniekit.train.runners.pipeline import PipelineRunner

        return PipelineRunner(ctx, model, stage.token_balance, precision)
    if ctx is not None and ctx.replicas is not None:
        from erniekit.train.runners.replicas import ReplicaRunner

        return ReplicaRunner(ctx, precision, distill_weight)
    from erniekit.train.runners.local import LocalRunner

    return LocalRunner(ctx, precision, distill_weight)


__all__ = ["StepRunner", "StepSums", "collective_runner"]
