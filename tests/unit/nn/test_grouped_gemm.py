"""The experts' grouped GEMM through MKL's batched sgemm: the same bits as the eager per-expert loop
it replaces (split, matmul per expert, concat), forward and every gradient, in the MoE block too."""

import numpy as np
import paddle
import pytest

from erniekit.nn import grouped_gemm
from erniekit.nn.moe import StackedExperts
from erniekit.nn.rows import concat_rows, split_rows

pytestmark = pytest.mark.skipif(grouped_gemm._mkl() is None, reason="no MKL batched GEMM in this Paddle wheel")


def _loop(x, ws, sizes, used):
    xs = split_rows(x, sizes)
    return [concat_rows([paddle.matmul(g, paddle.unbind(w)[e]) for g, e in zip(xs, used)]) for w in ws]


def _leaves(seed, M, E, K, Ns):
    rng = np.random.default_rng(seed)
    x = paddle.to_tensor(rng.standard_normal((M, K), dtype=np.float32), stop_gradient=False)
    ws = [paddle.to_tensor(rng.standard_normal((E, K, n), dtype=np.float32), stop_gradient=False) for n in Ns]
    dys = [rng.standard_normal((M, n), dtype=np.float32) for n in Ns]
    return x, ws, dys


def _run(fn, x, ws, dys, sizes, used):
    outs = fn(x, ws, sizes, used)
    paddle.add_n([(o * paddle.to_tensor(d)).sum() for o, d in zip(outs, dys)]).backward()
    got = [o.numpy() for o in outs], x.grad.numpy(), [w.grad.numpy() for w in ws]
    x.clear_gradient()
    for w in ws:
        w.clear_gradient()
    return got


@pytest.mark.parametrize(
    "sizes, used, Ns",
    [
        ([5, 17, 1, 40], [0, 2, 3, 5], [24, 24]),  # gate and up sharing x; experts 1 and 4 get no token
        ([64], [3], [16]),  # one group (no split in the loop)
        ([3, 9, 2, 7, 11, 2], [0, 1, 2, 3, 4, 5], [8]),  # every expert used, the down projection's shape
    ],
)
def test_grouped_matmuls_equal_the_per_expert_loop_bit_for_bit(sizes, used, Ns, bits):
    x, ws, dys = _leaves(0, sum(sizes), 6, 32, Ns)
    want = _run(_loop, x, ws, dys, sizes, used)
    got = _run(grouped_gemm.grouped_matmuls, x, ws, dys, sizes, used)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(got[1]), bits(want[1]))
    for a, b in zip(got[2], want[2]):
        np.testing.assert_array_equal(bits(a), bits(b))
    unused = [e for e in range(6) if e not in used]
    assert all(not g[e].any() for g in got[2] for e in unused)  # an expert without tokens: zero gradient


def test_frozen_weights_get_no_gradient_and_x_still_does():
    x, ws, dys = _leaves(1, 12, 3, 8, [4])
    ws[0].stop_gradient = True
    y = grouped_gemm.grouped_matmuls(x, ws, [5, 7], [0, 2])[0]
    (y * paddle.to_tensor(dys[0])).sum().backward()
    assert ws[0].grad is None and x.grad is not None
    w = ws[0].numpy()
    want = np.concatenate([dys[0][:5] @ w[0].T, dys[0][5:] @ w[2].T])
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)


def test_an_input_changed_in_place_after_the_forward_is_refused():
    x, ws, _ = _leaves(2, 6, 2, 4, [4])
    y = grouped_gemm.grouped_matmuls(x, ws, [6], [1])[0]
    with paddle.no_grad():
        ws[0].scale_(2.0)
    with pytest.raises((RuntimeError, OSError), match="grouped_matmul: an input was modified in place"):
        y.sum().backward()


def test_experts_layer_takes_it_and_gives_the_loops_result(monkeypatch, bits):
    """StackedExperts through the batched GEMM and with it unavailable (the eager loop): same bits."""
    paddle.seed(0)
    layer = StackedExperts(num_experts=4, hidden_size=16, intermediate_size=8)
    x = paddle.randn([20, 16])
    x.stop_gradient = False
    idx = paddle.to_tensor(np.random.default_rng(0).integers(0, 3, size=(20, 2)))  # expert 3 idle
    wt = paddle.full([20, 2], 0.5)

    def run():
        y = layer(x, idx, wt)
        y.sum().backward()
        got = [y.numpy(), x.grad.numpy(), *(p.grad.numpy() for p in layer.parameters())]
        layer.clear_gradients()
        x.clear_gradient()
        return got

    calls = []
    real = grouped_gemm.grouped_matmuls
    monkeypatch.setattr(grouped_gemm, "grouped_matmuls", lambda *a: calls.append(1) or real(*a))
    fast = run()
    assert len(calls) == 2  # gate + up in one call, down in another
    monkeypatch.setattr(grouped_gemm, "usable", lambda *a: False)
    slow = run()
    assert len(calls) == 2
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(bits(a), bits(b))
