"""Row groups of a [M, ...] tensor: the expert-sorted token groups MoE dispatch and the FP8
grouped GEMM both cut and join (one home, so neither module imports the other for it)."""

from __future__ import annotations

import paddle


def split_rows(x: paddle.Tensor, sizes: list[int]) -> list[paddle.Tensor]:
    """x [M, ...] cut into consecutive row groups of the given sizes (one group: no split op)."""
    return paddle.split(x, sizes, axis=0) if len(sizes) > 1 else [x]


def concat_rows(ts: list[paddle.Tensor]) -> paddle.Tensor:
    """Inverse of split_rows."""
    return paddle.concat(ts, axis=0) if len(ts) > 1 else ts[0]
