"""A dense ERNIE 4.5 model's decode step (one new token per sequence against a KV cache, under
no_grad) as direct calls of the layers' C kernels on buffers of its own.

Why: in a batch-1 decode step of the dense-1024 benchmark model the kernels' products stream the
weights in ~20 ms, and the layer-by-layer forward spent ~7 ms more around them: ~30 small Paddle ops
and Python calls a layer (module calls, shape checks, output allocations, the KV cache's slice
copies). Here a layer is ~15 kernel calls on preallocated buffers, and the attention reads the KV
cache's buffers in place.

Same bits: every operation is the one the layer-by-layer forward runs on the same inputs. The same
kernels with the same arguments (nn/norm.py, nn/small_gemm.py, nn/rope.py, nn/fused_attention.py,
nn/swiglu.py), the embedding's rows copied, numpy's float32 add for the residual adds (one rounding,
as Paddle's), and the model's own `rope_and_mask` for the positions and the mask. Tests compare the
two bit for bit. Whatever the step does not cover takes the layers: MoE layers, adapters, hooks,
GPAS, elastic depth, GPU or half precision, a projection Paddle's GEMM would take (which sums in
its own order), a prefill, a gradient, `ERNIEKIT_NATIVE_KERNELS=0`.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import paddle

from erniekit.nn import fused_attention, native, norm, rope, small_gemm, swiglu
from erniekit.utils.dtensor import host_view

_F32 = np.float32


@functools.cache
def _layer_types() -> tuple:
    from erniekit.models.ernie4_5 import modeling  # it imports this module

    return modeling.DecoderLayer, modeling.Attention, modeling.MLP, modeling.RMSNorm


class _Buffers:
    """One cache's step buffers: the activations (rows for the most sequences seen so far) and
    numpy views of the cache's key / value buffers (kept while those buffers are the cache's)."""

    def __init__(self) -> None:
        self.shape: tuple = ()
        self.views: dict[int, tuple[paddle.Tensor, np.ndarray]] = {}

    def activations(self, rows: int, H: int, Hq: int, Hkv: int, inter: int) -> dict[str, np.ndarray]:
        if not self.shape or rows > self.shape[0] or self.shape[1:] != (H, Hq, Hkv, inter):
            widths = {"h": H, "x": H, "a": H, "q": Hq, "qr": Hq, "o": Hq, "k": Hkv, "kr": Hkv, "v": Hkv}
            widths.update(g=inter, u=inter, s=inter, r=1)
            self.arrays = {name: np.zeros((rows, w), _F32) for name, w in widths.items()}
            self.ptrs = {name: a.ctypes.data for name, a in self.arrays.items()}
            self.shape = (rows, H, Hq, Hkv, inter)
        return self.arrays

    def view(self, t: paddle.Tensor) -> np.ndarray:
        entry = self.views.get(id(t))
        if entry is None or entry[0] is not t:
            entry = self.views[id(t)] = (t, host_view(t))
        return entry[1]

    def keep_only(self, live: list[paddle.Tensor]) -> None:
        """Drop the views of buffers the cache no longer holds (it grew): they would keep them alive."""
        if len(self.views) > len(live):
            ids = {id(t) for t in live}
            self.views = {i: e for i, e in self.views.items() if i in ids}


_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Buffers


def _no_hooks(*layers) -> bool:
    return not any(layer._forward_pre_hooks or layer._forward_post_hooks for layer in layers)


def _plain_layer(layer, types) -> bool:
    """A decoder layer the step reproduces: dense SwiGLU MLP, no GPAS, plain projections, no hooks."""
    decoder, attention, mlp, rms = types
    if type(layer) is not decoder or type(layer.self_attn) is not attention or type(layer.mlp) is not mlp:
        return False
    if (
        layer.gpas is not None
        or type(layer.input_layernorm) is not rms
        or type(layer.post_attention_layernorm) is not rms
    ):
        return False
    a, m = layer.self_attn, layer.mlp
    projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    return _no_hooks(layer, a, m, layer.input_layernorm, layer.post_attention_layernorm, *projections)


def _cache_buffers_fit(cache, layers: int, B: int, end: int, KVH: int, D: int) -> bool:
    if not (hasattr(cache, "reserve") and len(cache.k) == layers == len(cache.v)):
        return False
    for t in (*cache.k, *cache.v):
        s = t.shape
        if not (native.dense_cpu_float32(t) and t.is_contiguous() and len(s) == 4 and s[0] >= B and s[1] >= end):
            return False
        if s[2] != KVH or s[3] != D:
            return False
    return True


def _products(layer, B: int, H: int, Hq: int, Hkv: int) -> list | None:
    """The layer's seven products as the kernels' calls for B rows, in the order q, k, v, o, gate,
    up, down; None where a weight has another shape or `matmul_kn` would not take it."""
    a, m = layer.self_attn, layer.mlp
    inter = m.gate_proj.weight.shape[-1]
    shapes = [(a.q_proj, H, Hq), (a.k_proj, H, Hkv), (a.v_proj, H, Hkv), (a.o_proj, Hq, H)]
    shapes += [(m.gate_proj, H, inter), (m.up_proj, H, inter), (m.down_proj, inter, H)]
    calls = []
    for p, K, N in shapes:
        call = small_gemm.product(p.weight, p.bias, B) if list(p.weight.shape) == [K, N] else None
        if call is None:
            return None
        calls.append(call)
    return calls


def _covered(model) -> bool:
    """Whether every module the step stands in for is the plain one it reproduces."""
    types = _layer_types()
    emb = model.embed_tokens
    if type(emb) is not paddle.nn.Embedding or emb._padding_idx is not None or emb._max_norm is not None:
        return False
    if type(model.norm) is not types[3] or not _no_hooks(emb, model.norm) or model.active_layers is not None:
        return False
    norms = [model.norm.weight] + [
        n.weight for l in model.layers for n in (l.input_layernorm, l.post_attention_layernorm)
    ]
    weights = [emb.weight, *norms]
    return (
        all(_plain_layer(layer, types) for layer in model.layers)
        and native.dense_cpu_float32(*weights)
        and all(w.is_contiguous() for w in weights)
    )


def run(model, input_ids: paddle.Tensor, attention_mask: paddle.Tensor | None, cache) -> paddle.Tensor | None:
    """`model`'s (an Ernie4_5Model) final normed hidden states [B, 1, H] for `input_ids` [B, 1] after
    `cache.length` cached tokens, updating the cache as the layers do; None where the step does not
    apply (nothing is changed then, and the caller runs the layers)."""
    if not (native.cpu_build() and paddle.in_dynamic_mode()) or paddle.is_grad_enabled() or model.training:
        return None
    if input_ids.ndim != 2 or input_ids.shape[1] != 1 or not _covered(model):
        return None
    c = model.config
    B, D, KVH, past = input_ids.shape[0], c.head_dim, c.num_key_value_heads, cache.length
    kernels = (norm.forward_kernel(), rope.forward_kernel(), swiglu.forward_kernel())
    if None in kernels or not fused_attention.decode_ready(D):
        return None
    if not _cache_buffers_fit(cache, len(model.layers), B, past, KVH, D):
        return None
    Hq, Hkv = c.num_attention_heads * D, KVH * D
    steps = [_products(layer, B, c.hidden_size, Hq, Hkv) for layer in model.layers]
    if None in steps or len({layer.mlp.gate_proj.weight.shape[-1] for layer in model.layers}) > 1:
        return None
    ids = input_ids.numpy().reshape(B)
    if ids.size and (ids.min() < 0 or ids.max() >= model.embed_tokens.weight.shape[0]):
        return None  # the layers' embedding reports it
    cos, sin, mask = model.rope_and_mask(input_ids, None, None, attention_mask, past)
    bias, Sk = (mask[1] if isinstance(mask, tuple) else None), past + 1
    if bias is None or not native.dense_cpu_float32(bias, cos, sin):
        return None
    if list(bias.shape) not in ([1, 1, 1, Sk], [B, 1, 1, Sk]) or not list(cos.shape) == list(sin.shape) == [B, 1, 1, D]:
        return None
    cache.reserve(Sk)  # may grow the buffers (KVCache), or refuse a step past max_len as `update` does
    return _layers(model, steps, ids, cos.contiguous(), sin.contiguous(), bias.contiguous(), cache, kernels)


def _layers(model, steps, ids, cos, sin, bias, cache, kernels) -> paddle.Tensor:
    c, layers = model.config, list(model.layers)
    B, H, D, heads, KVH = len(ids), c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inter = layers[0].mlp.gate_proj.weight.shape[-1] if layers else H
    buf = _BUFFERS.get(cache)
    if buf is None:
        buf = _BUFFERS[cache] = _Buffers()
    arr = buf.activations(B, H, heads * D, KVH * D, inter)
    buf.keep_only([*cache.k, *cache.v])
    P = buf.ptrs
    rms, rot, act = kernels
    h = arr["h"][:B]
    np.take(host_view(model.embed_tokens.weight), ids, axis=0, out=h)
    past = cache.length
    scale, batched = D**-0.5, bias.shape[0] > 1
    cs, sn, mb = cos.data_ptr(), sin.data_ptr(), bias.data_ptr()
    kr, vv = arr["kr"][:B].reshape(B, KVH, D), arr["v"][:B].reshape(B, KVH, D)
    for i, (layer, (q, k, v, o, gate, up, down)) in enumerate(zip(layers, steps)):
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        native.over_chunks(rms, B, B * H * 4, P["h"], n1.weight.data_ptr(), P["x"], P["r"], H, n1.eps)
        q(P["x"], P["q"])
        k(P["x"], P["k"])
        v(P["x"], P["v"])
        native.over_chunks(rot, B, B * heads * D * 4, P["q"], cs, sn, P["qr"], heads, D)
        native.over_chunks(rot, B, B * KVH * D * 4, P["k"], cs, sn, P["kr"], KVH, D)
        kbuf, vbuf = cache.k[i], cache.v[i]
        buf.view(kbuf)[:B, past] = kr
        buf.view(vbuf)[:B, past] = vv
        kv = (kbuf.data_ptr(), vbuf.data_ptr(), mb, P["o"], B, past + 1, kbuf.shape[1])
        fused_attention.decode_forward(P["qr"], *kv, heads, KVH, D, scale, batched)
        o(P["o"], P["a"])
        np.add(h, arr["a"][:B], out=h)
        native.over_chunks(rms, B, B * H * 4, P["h"], n2.weight.data_ptr(), P["x"], P["r"], H, n2.eps)
        gate(P["x"], P["g"])
        up(P["x"], P["u"])
        native.over_chunks(act, B * inter, 4 * B * inter, P["g"], P["u"], P["s"])
        down(P["s"], P["a"])
        np.add(h, arr["a"][:B], out=h)
    cache.length = past + 1
    out = paddle.empty([B, 1, H], dtype="float32")
    f = model.norm
    native.over_chunks(rms, B, B * H * 4, P["h"], f.weight.data_ptr(), out.data_ptr(), P["r"], H, f.eps)
    return out
