"""Build a model whose weights are about to be overwritten without drawing random ones first.

Random init costs more than the load itself: ERNIE-4.5-0.3B's 0.36B parameters took 6.7 s to
build (Paddle's creation-time initializer, then the model's own Normal draws) against 1.6 s to read
from safetensors on 2 cores. Inside `skip_random_init()` every parameter is created zero-filled
(a memset) and `init_weights` methods that consult `random_init_skipped()` draw nothing. Only for
builds whose every parameter is then assigned (a checkpoint load that refuses a missing tensor, a
sub-model copied from its parent): a parameter left alone would stay zero."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import paddle
from paddle.base import initializer as _paddle_init

_depth = 0


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Zero-filled parameters and no `init_weights` draws while the block builds a model."""
    global _depth
    prev = (_paddle_init._global_weight_initializer(), _paddle_init._global_bias_initializer())
    zero = paddle.nn.initializer.Constant(0.0)
    paddle.nn.initializer.set_global_initializer(zero, zero)  # wins over a layer's default_initializer
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        paddle.nn.initializer.set_global_initializer(*prev)


def random_init_skipped() -> bool:
    """True inside `skip_random_init()`: a model's init_weights returns without drawing."""
    return _depth > 0
