"""MoE routing statistics and pictures during training.

The trainer calls `after_forward` after every micro-batch forward (with the batch's padding
mask), `scalars()` when it logs (token-level entropy / imbalance of the logging window), and
`maybe_write_pictures` after every optimizer step. For a dense model every call returns at once.

Two windows are kept, both as counts only (erniekit.routing.stats.RoutingAccumulator):
one for the scalars (reset at each log) and one for the pictures (reset at each picture), so
each picture shows the routing of the steps since the previous one.
"""

from __future__ import annotations

import os
from typing import Any

from erniekit.routing.stats import RoutingAccumulator, moe_blocks, read_routing


class RoutingMonitor:
    """Routing scalars for the logger and load / modality heatmaps under `output_dir/routing/`."""

    def __init__(self, model: Any, output_dir: str, every_steps: int = 0):
        """every_steps: write pictures every that many optimizer steps (<= 0: only at the end)."""
        self.blocks = moe_blocks(model)
        self.enabled = bool(self.blocks)
        self.dir = os.path.join(output_dir, "routing")
        self.every_steps = int(every_steps)
        # modality-isolated routing: per-modality imbalance over each modality's own experts
        groups = (
            self.blocks[0][1].modality_experts()
            if self.blocks and hasattr(self.blocks[0][1], "modality_experts")
            else None
        )
        self.window = RoutingAccumulator(groups)  # for scalars(), reset at each call
        self.picture = RoutingAccumulator(groups)  # for pictures, reset at each picture
        # names of the MoE modalities (ERNIE-4.5-VL: text, vision), for the pictures
        self.modality_names = list(getattr(model, "moe_modality_names", ()))
        self.picture_start: int | None = None  # first step of the picture window (for the title)
        self.last_picture_step = -1

    def after_forward(self, valid: Any = None) -> None:
        """Accumulate the routing of the forward that just ran; `valid` = non-padding mask
        (e.g. `batch["segment_ids"] > 0`, numpy or paddle, [B, S] or [B*S]); None counts all."""
        if not self.enabled:
            return
        routing = read_routing(self.blocks)
        self.window.add_routing(routing, valid)
        self.picture.add_routing(routing, valid)

    def scalars(self, prefix: str = "routing/") -> dict[str, float]:
        """Token-level routing scalars since the previous call (then the window restarts)."""
        if not self.enabled:
            return {}
        out = self.window.scalars(prefix)
        self.window.reset()
        return out

    def maybe_write_pictures(self, step: int, writer: Any = None, final: bool = False) -> list[str]:
        """Write `routing/step-{step:06d}-load.png` (+ with more than one modality: `-modality.png`
        and each modality's `-load-NAME.png` over its own experts)
        when `step` is a multiple of every_steps, or when final (end of training) and something
        was routed since the last picture; log them to VisualDL when a LogWriter is given.
        Returns the paths written (empty when nothing was due)."""
        if not self.enabled or self.picture.empty or step == self.last_picture_step:
            return []
        if self.picture_start is None:  # first step of this window (called after every step)
            self.picture_start = step
        due = final or (self.every_steps > 0 and step % self.every_steps == 0)
        if not due:
            return []
        paths = self.write_pictures(step, writer)
        self.picture.reset()
        self.picture_start = None
        self.last_picture_step = step
        return paths

    def write_pictures(self, step: int, writer: Any = None) -> list[str]:
        """Write the pictures of the current picture window now (see maybe_write_pictures)."""
        from erniekit.routing.plots import log_images_to_visualdl, save_load_heatmap, save_modality_usage

        acc = self.picture
        span = f"steps {self.picture_start}-{step}" if self.picture_start is not None else f"up to step {step}"
        base = os.path.join(self.dir, f"step-{step:06d}")
        paths = [save_load_heatmap(acc.load_matrix(), f"{base}-load.png", f"expert load, {span}", acc.layer_ids)]
        tags = ["routing/expert_load"]
        if acc.num_modalities > 1:
            names = [
                self.modality_names[m] if m < len(self.modality_names) else f"modality {m}"
                for m in range(acc.num_modalities)
            ]
            paths.append(
                save_modality_usage(
                    acc.modality_matrix(),
                    f"{base}-modality.png",
                    f"expert usage per modality (all MoE layers), {span}",
                    names,
                )
            )
            tags.append("routing/modality_usage")
            for m, name in enumerate(names):  # each modality's load over its own experts, layer by layer
                if not acc.counts[:, m].any():
                    continue
                load, experts = acc.modality_load_matrix(m)
                slug = name.replace(" ", "")
                paths.append(
                    save_load_heatmap(
                        load, f"{base}-load-{slug}.png", f"{name} tokens: expert load, {span}", acc.layer_ids, experts
                    )
                )
                tags.append(f"routing/expert_load_{slug}")
        if writer is not None:
            for tag, path in zip(tags, paths):
                log_images_to_visualdl(writer, tag, path, step)
        return paths
