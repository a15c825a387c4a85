"""AdamW (erniekit/train/optim.py) against the formula in float64, on both of its paths: the numpy
update for dense float32 CPU tensors and the Paddle-op update every other tensor takes."""

import numpy as np
import paddle
import pytest

from erniekit.train import optim
from erniekit.utils.dtensor import host_view


def _reference(p0, grads, lr, b1, b2, eps, wd, mult, decay):
    p, m, v = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        plr = lr * mult
        if decay:
            p = p * (1 - plr * wd)
        p = p - plr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("numpy_path", [True, False])
def test_adamw_follows_the_formula(monkeypatch, numpy_path):
    if not numpy_path:
        monkeypatch.setattr(optim, "_numpy_step", lambda *a: False)
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "norm": (7,), "lora_B": (3, 4)}
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    grads = {n: [rng.standard_normal(s).astype(np.float32) * 10.0**-k for k in range(4)] for n, s in shapes.items()}
    params = {n: paddle.create_parameter(list(s), "float32") for n, s in shapes.items()}
    for n, p in params.items():
        p.set_value(paddle.to_tensor(init[n]))
    opt = optim.AdamW(
        list(params.items()), lr=3e-2, weight_decay=0.1, no_decay={"norm"}, lr_mult={"lora_B": 4.0}, epsilon=1e-6
    )
    for k in range(4):
        for n, p in params.items():
            (p * paddle.to_tensor(grads[n][k])).sum().backward()
        opt.step()
        opt.clear_grad()
    for n, p in params.items():
        want = _reference(init[n], grads[n], 3e-2, 0.9, 0.999, 1e-6, 0.1, 4.0 if n == "lora_B" else 1.0, n != "norm")
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-6, atol=1e-7)
        assert not np.allclose(p.numpy(), init[n])
    assert opt.state_dict()["w::exp_avg"].shape == [5, 7]


def test_numpy_path_only_takes_dense_float32_cpu_tensors():
    assert host_view(paddle.ones([2, 3])) is not None
    assert host_view(paddle.ones([2, 3], "float64")) is None
    p = paddle.create_parameter([2, 2], "float32")
    view = host_view(p)
    view += 1.0  # writes through to the parameter: no copy
    np.testing.assert_array_equal(view, p.numpy())
