"""erniekit.nn.linear: the same op as nn.Linear (bits, gradients, state dict, to_static), and the
models build their projections from it."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.nn import linear as lin


@pytest.mark.parametrize("bias", [True, False])
def test_the_same_bits_and_gradients_as_nn_linear(bias):
    paddle.seed(0)
    ref = paddle.nn.Linear(24, 40, bias_attr=None if bias else False)
    ours = lin.Linear(24, 40, bias_attr=None if bias else False)
    ours.set_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = paddle.randn([3, 5, 24])
    outs = []
    for layer in (ref, ours):
        xi = x.clone()
        xi.stop_gradient = False
        y = layer(xi)
        (y * y).sum().backward()
        outs.append([y.numpy(), xi.grad.numpy(), layer.weight.grad.numpy()])
        outs[-1] += [layer.bias.grad.numpy()] if bias else []
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_the_kernel_is_called_directly_on_the_cpu_build(monkeypatch):
    """The point of the module: on Paddle's CPU build no call goes through F.linear (its flag read)."""
    if not lin._CPU_BUILD:
        pytest.skip("a CUDA build takes F.linear on purpose")
    calls = []
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1))
    layer = lin.Linear(8, 4)
    assert list(layer(paddle.randn([2, 8])).shape) == [2, 4] and not calls


@pytest.mark.parametrize("full_graph", [False, True])
def test_a_layer_using_it_converts_with_to_static(full_graph):
    layer = lin.Linear(16, 8)
    x = paddle.randn([2, 16])
    want = layer(x).numpy()
    got = paddle.jit.to_static(lin.Linear(16, 8), full_graph=full_graph)
    got.set_state_dict(layer.state_dict())
    np.testing.assert_allclose(got(x).numpy(), want, rtol=1e-6, atol=1e-6)


def test_the_models_project_through_it():
    from erniekit.models.registry import load_model

    model = load_model("tiny-moe", {"tie_word_embeddings": False})
    linears = {n: m for n, m in model.named_sublayers() if isinstance(m, paddle.nn.Linear)}
    assert "lm_head" in "".join(linears) and any(n.endswith("q_proj") for n in linears)
    assert all(isinstance(m, lin.Linear) for m in linears.values()), [
        n for n, m in linears.items() if type(m) is paddle.nn.Linear
    ]
