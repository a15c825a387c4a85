"""Step runners, one per topology (erniekit/train/runners/base.py says what a runner does)."""

from __future__ import annotations

from erniekit.train.runners.base import StepRunner, StepSums


def default_runner(model, stage) -> StepRunner:
    """The runner of this process in a single-process or collective job: pipeline ranks when the
    job joined with pipeline stages, else local (PS workers are built by the run, with their worker)."""
    from erniekit.distributed.runtime import active

    ctx = active()
    if ctx is not None and ctx.pipeline is not None:
        from erniekit.train.runners.pipeline import PipelineRunner

        return PipelineRunner(ctx, model, stage.token_balance)
    from erniekit.train.runners.local import LocalRunner

    return LocalRunner(ctx)


__all__ = ["StepRunner", "StepSums", "default_runner"]
