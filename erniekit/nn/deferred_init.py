"""Build a model whose weights are about to be overwritten without drawing random ones first.

Random init cost more than the load itself (Paddle's creation-time initializer, then the model's own
Normal draws): dense-1024 loaded in 1.81 s with them and 0.30 s without, on 2 cores
(docs/performance.md, fourteenth round). Inside `skip_random_init()`
every parameter is created zero-filled (a memset) and `init_weights` methods that consult
`random_init_skipped()` draw nothing. Only for builds whose every parameter is then assigned (a
checkpoint load that refuses a missing tensor, a sub-model copied from its parent): a parameter
left alone would stay zero. The setting is process-wide (Paddle's global initializer): a model
another thread builds meanwhile is zero-filled too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import paddle
from paddle.base import initializer as _paddle_init

_lock = threading.Lock()
_depth = 0
_saved: tuple = (None, None)  # Paddle's global initializers before the outermost block


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Zero-filled parameters and no `init_weights` draws while the block builds a model. Blocks may
    nest or overlap across threads: the first to enter sets the zero initializer, the last to leave
    puts Paddle's back."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = (_paddle_init._global_weight_initializer(), _paddle_init._global_bias_initializer())
            zero = paddle.nn.initializer.Constant(0.0)
            paddle.nn.initializer.set_global_initializer(zero, zero)  # wins over a layer's default_initializer
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                paddle.nn.initializer.set_global_initializer(*_saved)


def random_init_skipped() -> bool:
    """True inside `skip_random_init()`: a model's init_weights returns without drawing."""
    return _depth > 0
