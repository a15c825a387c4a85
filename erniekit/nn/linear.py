"""nn.Linear whose eager forward on Paddle's CPU build calls the linear kernel directly.

Why: `F.linear` reads a global flag (`paddle.get_flags`, which checks the flag name is public)
and asks whether Paddle was built with CUDA on every call, ~13 us of Python around a kernel that
takes ~8 us at decode sizes (a [1, 64] x [64, 64] product, one thread): ~4% of a dense-1024
decode step's wall time (cProfile). On that build F.linear's dynamic-mode branch is exactly
`_C_ops.linear(x, weight, bias)`, so this is the same op with the same bits; GPU builds and
static graphs keep F.linear (its CUDA path may fuse the bias into the GEMM).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import _C_ops, nn

from erniekit.nn import small_gemm

_CPU_BUILD = not paddle.is_compiled_with_cuda()


def linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """x @ weight + bias, as F.linear computes it."""
    if _CPU_BUILD and paddle.in_dynamic_mode():
        if small_gemm.takes_kn(x, weight, bias):  # decode steps: a few rows, no gradient
            return small_gemm.matmul_kn(x, weight, bias)
        return _C_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and state dict) through `linear`."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return linear(x, self.weight, self.bias)
