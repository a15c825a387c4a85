"""Auxiliary-layer distillation (ERNIE 3.0 Titan's ALD, in hidden-state form; docs/online_distillation.md).

During distillation a student carries one extra decoder layer on top of its final (normed) hidden
states, with its own final norm and, when the widths differ, a linear map to its teacher's width.
That path is trained to reproduce the teacher's final normed hidden states (a FitNets-style hint
with one layer of slack, so the student's own last layer is not forced to equal the teacher's
representation); the student's own head keeps learning the teacher's soft labels. The layer lives
beside the student, never inside it: the saved student is the student alone.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn

from erniekit.train.distill_losses import gather_positions, trained_positions


class AuxiliaryLayer(nn.Layer):
    def __init__(self, student, target_hidden: int):
        """student: the model it sits on (its layer class, width and rope); target_hidden: the width
        of the hidden states it reproduces (its teacher's hidden_size)."""
        super().__init__()
        config = student.config.replace(moe_num_experts=0, num_nextn_predict_layers=0)  # one dense layer
        self.layer = type(student.model.layers[0])(config, 0)
        self.norm = type(student.model.norm)(config.hidden_size, config.rms_norm_eps)
        self.proj = (
            nn.Linear(config.hidden_size, target_hidden, bias_attr=False)
            if target_hidden != config.hidden_size
            else None
        )
        init = nn.initializer.Normal(0.0, config.initializer_range)  # as the model's own matrices
        for p in self.parameters():
            if p.ndim >= 2:
                init(p)

    def forward(self, student, h: paddle.Tensor, inputs: dict) -> paddle.Tensor:
        """h: the student's final normed hidden states [B, S, H]; inputs: the batch's model inputs."""
        cos, sin, mask = student.model.rope_and_mask(inputs["input_ids"], inputs["position_ids"], inputs["segment_ids"])
        x = self.norm(self.layer(h, cos, sin, mask, None))
        return self.proj(x) if self.proj is not None else x


def hidden_loss_sum(
    pred: paddle.Tensor, target: paddle.Tensor, labels: np.ndarray, segment_ids: np.ndarray | None = None
) -> paddle.Tensor:
    """Mean squared error over the hidden width, summed over the trained positions (the positions
    the LM and distillation losses count, so the loop's per-token average applies); no gradient
    reaches `target`."""
    flat = trained_positions(labels, segment_ids)
    if len(flat) == 0:
        return pred.sum() * 0.0
    diff = gather_positions(pred, flat) - gather_positions(target.detach(), flat)
    return paddle.mean(paddle.square(diff), axis=-1).sum()
