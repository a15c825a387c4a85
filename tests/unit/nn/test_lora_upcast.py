"""A LoRA base held in bf16 on the CPU: the forward upcasts each frozen weight, and the backward
must upcast it again rather than keep the float32 copy (erniekit/nn/lora.py `_UpcastMatmul`),
with the same bits as autograd through `matmul(x, w.astype(float32))`."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from erniekit.nn import lora
from erniekit.nn.lora import LoraConfig, LoraLinear, LoraStackedExperts
from erniekit.nn.moe import StackedExperts
from erniekit.utils import malloc


def _autograd_mm(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """The path before _UpcastMatmul: autograd keeps the float32 copy of w for the backward."""
    if w.dtype == x.dtype:
        return paddle.matmul(x, w)
    return paddle.matmul(x, w.astype(x.dtype))


def _frozen_base(layer: paddle.nn.Layer) -> None:
    for n, p in layer.named_parameters():
        p.stop_gradient = "lora_" not in n


def _linear(dora: bool, fan_in: int = 48, fan_out: int = 40, base_dtype: str = "bfloat16") -> LoraLinear:
    paddle.seed(1)
    layer = LoraLinear(paddle.nn.Linear(fan_in, fan_out), LoraConfig(r=4, use_dora=dora, base_dtype=base_dtype))
    with paddle.no_grad():  # B != 0, so the adapter's path and DoRA's scale take part
        layer.lora_B.set_value(paddle.randn(layer.lora_B.shape) * 0.1)
    _frozen_base(layer)
    return layer


def _experts(dora: bool, hidden: int = 32, inter: int = 24) -> LoraStackedExperts:
    paddle.seed(2)
    layer = LoraStackedExperts(StackedExperts(4, hidden, inter), LoraConfig(r=4, use_dora=dora, base_dtype="bfloat16"))
    with paddle.no_grad():
        for p in layer.projs:
            b = getattr(layer, f"{p}_lora_B")
            b.set_value(paddle.randn(b.shape) * 0.1)
    _frozen_base(layer)
    return layer


def _run(layer: paddle.nn.Layer, x: paddle.Tensor, *route: paddle.Tensor) -> list[np.ndarray]:
    """Output, then the gradients of x and of every trainable parameter, for a fixed upstream grad."""
    x = x.detach()
    x.stop_gradient = False
    y = layer(x, *route)
    paddle.seed(3)
    dy = paddle.randn(y.shape)
    params = [p for p in layer.parameters() if not p.stop_gradient]
    grads = paddle.grad(y, [x, *params], dy)
    return [y.numpy(), *(g.numpy() for g in grads)]


def _route(tokens: int, experts: int = 4, k: int = 2) -> tuple[paddle.Tensor, paddle.Tensor]:
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
    return paddle.to_tensor(idx, dtype="int64"), paddle.to_tensor(rng.random((tokens, k)), dtype="float32")


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize(
    "kind, base", [("linear", "bfloat16"), ("experts", "bfloat16"), ("linear", "float16"), ("linear", "numpy")]
)
def test_16_bit_base_gives_autograds_bits(kind, base, dora, monkeypatch):
    """bf16 is upcast into a reused float32 buffer by kernels/bf16_upcast.c (or numpy without a
    compiler), float16 by Paddle's cast: all with the bits of the path before."""
    if base == "numpy":
        monkeypatch.setattr(lora.native, "function", lambda *a: None)
    layer = _experts(dora) if kind == "experts" else _linear(dora, base_dtype=base.replace("numpy", "bfloat16"))
    paddle.seed(4)
    if kind == "linear":
        x, route = paddle.randn([2, 5, 48]), ()
    else:
        x, route = paddle.randn([9, 32]), _route(9)
    new = _run(layer, x, *route)
    monkeypatch.setattr(lora, "_UpcastMatmul", None)  # the new path must not run for the reference
    monkeypatch.setattr(lora, "_upcasts", lambda x, w: False)
    monkeypatch.setattr(lora, "_mm", _autograd_mm)
    old = _run(layer, x, *route)
    assert len(new) == len(old) == 2 + len([p for p in layer.parameters() if not p.stop_gradient])
    for a, b in zip(new, old):
        assert np.array_equal(a, b)


def test_bf16_base_keeps_no_float32_copy_for_the_backward():
    """malloc's live bytes over the forward: the old path kept 4 bytes per adapted base element
    (2 MiB + 1.5 MiB here); what is left is the activations (a few KiB)."""
    if malloc.live_bytes() is None:
        pytest.skip("glibc mallinfo2 is not available")
    lin, ex = _linear(False, 512, 1024), _experts(False, 256, 512)
    x, xe, route = paddle.randn([4, 512]), paddle.randn([8, 256]), _route(8)
    x.stop_gradient = xe.stop_gradient = False
    upcast = 4 * (512 * 1024 + 3 * 4 * 256 * 512)  # every float32 copy the old path keeps (experts: all used)
    assert sorted(set(route[0].numpy().ravel().tolist())) == [0, 1, 2, 3]
    for _ in range(2):  # the first run warms kernels and allocator caches
        before = malloc.live_bytes()
        y, ye = lin(x), ex(xe, *route)
        grown = malloc.live_bytes() - before
        (y.sum() + ye.sum()).backward()
        del y, ye
    assert grown < upcast / 8, f"the forward kept {grown} bytes; the float32 upcasts are {upcast}"
    assert x.grad is not None and xe.grad is not None


def test_a_double_backward_does_not_read_the_shared_upcast_buffer():
    """Under create_graph the backward's GEMM is recorded; its weight must be a copy, not the buffer
    every later upcast writes (another layer's backward would change this one's second derivative)."""
    a = paddle.randn([4, 4]).astype("bfloat16")
    other = paddle.randn([4, 4]).astype("bfloat16")

    def second_derivative(matmul, interfere):
        x = paddle.ones([3, 4])
        x.stop_gradient = False
        y = matmul(x)
        (g,) = paddle.grad((y * y).sum(), [x], create_graph=True)
        if interfere:
            lora._upcast(other, None, paddle.float32)  # as the next layer's backward does
        (gg,) = paddle.grad(g.sum(), [x])
        return gg.numpy()

    want = second_derivative(lambda x: paddle.matmul(x, a.astype("float32")), False)
    np.testing.assert_array_equal(second_derivative(lambda x: lora._UpcastMatmul.apply(x, a), True), want)
