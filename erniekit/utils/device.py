"""Which device erniekit computes on, decided once for training, the planner, FP8 and serving."""

from __future__ import annotations


def cuda_visible() -> bool:
    """Whether this Paddle build has CUDA and sees a GPU: erniekit then trains and serves there."""
    import paddle

    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
