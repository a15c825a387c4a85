"""Hidden-state distillation (TinyBERT's hidden-layer loss, in DistilBERT's scale-free form).

A student layer's output learns the output of a teacher layer (`distill_hidden_layer_map`). On a
one-answer task the teacher's soft labels are its hard labels (docs/distillation.md), while its
hidden states still say how it computes the answer; this is the signal that loss carries.

Both sides are RMS-normalised over the hidden dimension before the squared error (no learned scale),
so a token's error is 2 (1 - cos) for equal widths and does not grow with the residual stream:

    L_hidden = sum over real tokens of the mean over mapped layers of  |n(h_s W) - n(h_t)|^2 / H_t
    n(h) = h / sqrt(mean(h^2) + eps)

A sum over tokens, like the other loss terms, so a batch split over ranks or micro-batches adds up
to the same total.

W is a learned [H_s, H_t] map shared by all layers (TinyBERT's W_h) when the widths differ, the
identity otherwise. The outputs are captured by forward hooks on the decoder layers, so the models
stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import paddle
import paddle.nn as nn

_EPS = 1e-6


@contextmanager
def layer_outputs(model, indices: list[int]) -> Iterator[dict[int, paddle.Tensor]]:
    """Within the block, the outputs of `model`'s decoder layers `indices` from its last forward."""
    out: dict[int, paddle.Tensor] = {}
    layers = model.model.layers
    handles = []
    for i in sorted(set(indices)):

        def hook(layer, inputs, output, i=i):
            out[i] = output

        handles.append(layers[i].register_forward_post_hook(hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def _rms_normed(h: paddle.Tensor) -> paddle.Tensor:
    return h * paddle.rsqrt((h * h).mean(-1, keepdim=True) + _EPS)


def layer_loss_sum(
    student: list[paddle.Tensor],
    teacher: list[paddle.Tensor],
    segment_ids: np.ndarray,
    proj: nn.Layer | None = None,
) -> paddle.Tensor:
    """The sum over the batch's real tokens (segment_ids > 0) of the mean over layer pairs of the
    per-token squared error of the normalised states."""
    real = paddle.to_tensor((np.asarray(segment_ids) > 0).astype(np.float32))  # [B, S]
    total = None
    for hs, ht in zip(student, teacher):
        hs = (proj(hs) if proj is not None else hs).astype("float32")  # float32 under AMP too
        d = _rms_normed(hs) - _rms_normed(ht.detach().astype("float32"))
        term = ((d * d).mean(-1) * real).sum()
        total = term if total is None else total + term
    return total / len(student)


class HiddenProjection(nn.Layer):
    """TinyBERT's W_h: the student's width to the teacher's, shared by every mapped layer; trained
    with the student, not part of the saved student."""

    def __init__(self, student_hidden: int, teacher_hidden: int, std: float):
        super().__init__()
        self.linear = nn.Linear(student_hidden, teacher_hidden, bias_attr=False)
        nn.initializer.Normal(0.0, std)(self.linear.weight)

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        return self.linear(h)
