"""GPAS, gradient-preserving activation scaling (Chen et al., 2025) of the residual stream.

Pre-LN transformers let the residual stream grow with depth, so late layers must produce ever
larger updates to matter. GPAS scales a layer's output down in the forward pass while leaving the
gradient that flows back through the residual path untouched:

    x' = x - SiLU(alpha) * stop_gradient(x)

Forward value: (1 - SiLU(alpha)) * x. d x'/d x = I (gradient preserved);
d L/d alpha = -SiLU'(alpha) * <stop_gradient(x), dL/dx'>. alpha starts at 0, where SiLU(0) = 0,
so a fresh GPAS layer is the identity.
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


class GPAS(nn.Layer):
    """One learnable scalar alpha per layer (parameter `model.layers.N.gpas.alpha`)."""

    def __init__(self):
        super().__init__()
        self.alpha = self.create_parameter([1], dtype="float32", default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x - F.silu(self.alpha).astype(x.dtype) * x.detach()
