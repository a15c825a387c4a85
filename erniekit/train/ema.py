"""Exponential moving average of the trainable weights (ERNIE 4.5: EMA in place of LR decay).

With a constant learning rate the weights keep moving around the optimum; their EMA averages
that noise away the way a decaying LR would, without deciding the decay horizon in advance.

    ema_t = d_t * ema_{t-1} + (1 - d_t) * w_t,   d_t = min(ema_decay, (1 + t) / (10 + t))

The warm-up of d_t (as TensorFlow's ExponentialMovingAverage with num_updates) keeps the first
steps from being dominated by the initial weights; the copies are float32 whatever the weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import paddle


class WeightEMA:
    def __init__(self, named_params: list[tuple[str, paddle.Tensor]], decay: float):
        self.decay = decay
        self.params = dict(named_params)
        self.shadow = {n: p.detach().astype("float32").clone() for n, p in self.params.items()}
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @paddle.no_grad()
    def update(self) -> None:
        d = self.current_decay()
        for n, p in self.params.items():
            s = self.shadow[n]
            s.set_value(s * d + p.detach().astype("float32") * (1.0 - d))
        self.updates += 1

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily load the EMA weights into the model (for eval or saving)."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            with paddle.no_grad():
                for n, p in self.params.items():
                    p.set_value(self.shadow[n].astype(p.dtype))
            yield
        finally:
            with paddle.no_grad():
                for n, p in self.params.items():
                    p.set_value(backup[n])

    def state_dict(self) -> dict[str, paddle.Tensor]:
        return {**self.shadow, "__updates__": paddle.to_tensor([self.updates], dtype="int64")}

    def load_state_dict(self, sd: dict[str, paddle.Tensor], where: str) -> None:
        from erniekit.errors import CheckpointError

        missing = set(self.shadow) - set(sd)
        if missing:
            raise CheckpointError(
                f"{where}: EMA state has no entry for {sorted(missing)[0]}; resume with the "
                "same fine_tuning / model settings, or remove the file to restart the EMA"
            )
        loaded = {n: _checked(n, sd[n], self.shadow[n].shape, where) for n in self.shadow}
        self.shadow.update(loaded)  # only once every entry passed: a bad file leaves the EMA as it was
        self.updates = _updates(sd.get("__updates__"), where)


def _checked(name: str, t: paddle.Tensor, shape: list[int], where: str) -> paddle.Tensor:
    """The float32 EMA entry `name`, refusing a wrong shape (it would broadcast into the average
    silently) and NaN/inf (they would spread into the saved model)."""
    from erniekit.errors import CheckpointError

    if list(t.shape) != list(shape):
        raise CheckpointError(
            f"{where}: EMA entry {name} has shape {list(t.shape)}, the model's is {list(shape)}; resume with "
            "the same model settings, or remove the file to restart the EMA"
        )
    t = t.astype("float32")
    if not bool(paddle.isfinite(t).all()):
        raise CheckpointError(f"{where}: EMA entry {name} holds NaN or inf; remove the file to restart the EMA")
    return t


def _updates(t: paddle.Tensor | None, where: str) -> int:
    """The EMA's update count (0 when the file predates it); one non-negative integer."""
    from erniekit.errors import CheckpointError

    if t is None:
        return 0
    values = t.numpy().reshape(-1)
    if values.size != 1 or values.dtype.kind not in "iu" or values[0] < 0:
        raise CheckpointError(
            f"{where}: __updates__ must be one integer >= 0, got {values[:4].tolist()}; remove the file to restart the EMA"
        )
    return int(values[0])
