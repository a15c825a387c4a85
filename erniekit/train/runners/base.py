"""The step-runner interface: how one optimizer step's forward, backward, gradient reduction and
clipping run on this process's topology. The loop (erniekit/train/loop.py) is the same for every
topology; a runner is the only part that differs between a single process or data/tensor
parallel ranks (local), pipeline stages (pipeline) and parameter-server workers (ps).

A runner is also what checkpoints ask when the process holds only part of the model: it gathers
the full tensors onto the writing rank and keeps the ranks together around a save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import paddle


@dataclass
class StepSums:
    """A step's sums over its micro-batches (divided by the trained units by the loop)."""

    loss_sum: float = 0.0  # the full model's loss, summed over units
    aux_sum: float = 0.0  # router losses, already weighted, averaged over micro-batches
    metrics: dict[str, float] = field(default_factory=dict)  # a stage's extras, already per unit
    elastic: dict[str, float] = field(default_factory=dict)  # the smaller sub-model's pass (sandwich)


class StepRunner:
    """Single-process behaviour by default; subclasses override what their topology changes."""

    name = "local"
    data_ranks = 1  # the global batch is split over this many ranks
    partial = False  # this process holds only part of the model (a pipeline stage, a PS worker)
    optimizer_state_placements = None  # (param) -> placements of its moments over the mesh (ZeRO-1)

    def bind(self, trainer) -> None:
        """Called once by the loop, after it built its optimizer: the model's trainable parameters
        by name (what pipeline segments and PS workers reduce and clip)."""
        self.named_params = [(n, p) for n, p in trainer.model.named_parameters() if not p.stop_gradient]

    def forward_backward(self, trainer, micro: list[dict], n_units: int, specs: list) -> StepSums:
        raise NotImplementedError

    def clip(self, trainer, max_norm: float, lr: float) -> tuple[float, dict | None]:
        """(gradient norm before clipping, the reduced gradients the optimizer applies or None:
        each parameter's own .grad)."""
        raise NotImplementedError

    def after_update(self, step: int, final: bool = False) -> None:
        """After the optimizer update of `step` (1-based), before the next step."""

    def cluster_share(self, micro: list[dict], n_units: int, normalizer) -> tuple[list[dict], int]:
        """This cluster's rows of a step's global micro-batches and the count its loss is divided by
        (training across clusters: erniekit/train/runners/cross_cluster.py); one cluster: all of them."""
        return micro, n_units

    def agree_resume(self, path: str | None) -> str | None:
        """The checkpoint to resume from, agreed with whoever must resume from the same step."""
        return path

    def save_state(self, path: str) -> None:
        """Before checkpoint `path` is written: state this process keeps beside it."""

    def load_state(self, path: str) -> None:
        """After the loop resumed from checkpoint `path`."""

    def agree_stop(self, local: int) -> int:
        """The stop signal of any process of the job, the same on every rank (0: go on)."""
        return local

    def before_stop(self, step: int) -> None:
        """The loop ends early after `step` on a stop request (a checkpoint follows)."""

    def eval_loss(self, trainer) -> dict[str, float] | None:
        """Held-out scores when this topology computes them itself (None: the stage's evaluate)."""
        return None

    def finish(self) -> dict:
        """The run ended: release peers; returns figures for train_results.json."""
        return {}

    # ---- checkpoints -------------------------------------------------------------------------
    def model_state(self, model) -> dict[str, paddle.Tensor] | None:
        """The full HF-layout state on the writing rank (None: the model's own state)."""
        return None

    def full_tensors(self, tensors: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        """Named tensors of every part of the model on the writing rank (names are global)."""
        return tensors

    def optimizer_state(self, state: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
        return self.full_tensors(state)

    def sync(self) -> None:
        """Every process of the job waits here (after a checkpoint: no rank runs ahead of it)."""
        from erniekit.utils.dtensor import barrier

        barrier()
