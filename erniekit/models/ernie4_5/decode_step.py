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
as Paddle's), and the rows of a table of the model's own `rope_cos_sin` for the positions (with the
mask's two values for its bias, `_rope_rows`). Tests compare the two bit for bit. Whatever the step
does not cover takes the layers: MoE layers, adapters, hooks, GPAS, elastic depth, GPU or half
precision, a projection Paddle's GEMM would take (which sums in its own order), a prefill, a
gradient, `ERNIEKIT_NATIVE_KERNELS=0`.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import paddle

from erniekit.nn import fused_attention, native, norm, rope, small_gemm, swiglu
from erniekit.nn.attention import rope_cos_sin, use_fused_attention
from erniekit.utils.dtensor import host_view

_F32 = np.float32


class _Buffers:
    """One cache's step buffers: the activations (rows for the most sequences seen so far) and
    numpy views of the cache's key / value buffers (kept while those buffers are the cache's)."""

    def __init__(self) -> None:
        self.shape: tuple = ()
        self.views: dict[int, tuple[paddle.Tensor, int, list, np.ndarray]] = {}

    def activations(self, rows: int, H: int, Hq: int, Hkv: int, inter: int) -> dict[str, np.ndarray]:
        if not self.shape or rows > self.shape[0] or self.shape[1:] != (H, Hq, Hkv, inter):
            widths = {"h": H, "x": H, "a": H, "q": Hq, "qr": Hq, "o": Hq, "k": Hkv, "kr": Hkv, "v": Hkv}
            widths.update(g=inter, u=inter, s=inter, r=1)
            self.arrays = {name: np.zeros((rows, w), _F32) for name, w in widths.items()}
            self.ptrs = {name: a.ctypes.data for name, a in self.arrays.items()}
            self.shape = (rows, H, Hq, Hkv, inter)
        return self.arrays

    def view(self, t: paddle.Tensor) -> np.ndarray:
        """A numpy view of t's memory, made again when t is another tensor or was given new storage
        in place (`paddle.assign(..., output=t)` moves it)."""
        entry = self.views.get(id(t))
        ptr, shape = t.data_ptr(), t.shape
        if entry is None or entry[0] is not t or entry[1] != ptr or entry[2] != shape:
            entry = self.views[id(t)] = (t, ptr, shape, host_view(t))
        return entry[3]

    def keep_only(self, live: list[paddle.Tensor]) -> None:
        """Drop the views of buffers the cache no longer holds (it grew): they would keep them alive."""
        if len(self.views) > len(live):
            ids = {id(t) for t in live}
            self.views = {i: e for i, e in self.views.items() if i in ids}


_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Buffers


def _no_hooks(*layers) -> bool:
    return not any(layer._forward_pre_hooks or layer._forward_post_hooks for layer in layers)


def _parts(layer, types) -> tuple | None:
    """(input norm, post-attention norm, the seven projections q, k, v, o, gate, up, down) of a
    decoder layer the step reproduces (dense SwiGLU MLP, no GPAS, plain Linear projections: no
    adapter, no quantized layer; no hooks), else None. Read from the Layers' own dicts: Paddle's
    Layer.__getattr__ costs ~2 us an access, and this runs every step."""
    decoder, attention, mlp, rms, linear = types
    subs = layer._sub_layers if type(layer) is decoder else {}
    a, m = subs.get("self_attn"), subs.get("mlp")
    n1, n2 = subs.get("input_layernorm"), subs.get("post_attention_layernorm")
    if type(a) is not attention or type(m) is not mlp or type(n1) is not rms or type(n2) is not rms:
        return None
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    projections = tuple((a if i < 4 else m)._sub_layers.get(name) for i, name in enumerate(names))
    if any(type(p) is not linear for p in projections) or layer.gpas is not None:
        return None
    return (n1, n2, *projections) if _no_hooks(layer, a, m, n1, n2, *projections) else None


def _cache_buffers_fit(cache, layers: int, B: int, end: int, KVH: int, D: int) -> bool:
    """Float32 buffers [rows, >= end, KVH, D] per layer, rows = B (KVCache's `update` writes every
    row) or, for a cache whose `update` writes the first B (`first_rows`, the engine's), rows >= B."""
    if not (hasattr(cache, "reserve") and len(cache.k) == layers == len(cache.v)):
        return False
    fewer = getattr(cache, "first_rows", False)
    for t in (*cache.k, *cache.v):
        s = t.shape
        if not (native.dense_cpu_float32(t) and t.is_contiguous() and len(s) == 4 and s[1] >= end):
            return False
        if s[0] < B or (s[0] > B and not fewer):
            return False
        if s[2] != KVH or s[3] != D:
            return False
    return True


def _weights(parts: list[tuple]) -> tuple:
    """Every projection's (weight, bias, packed copy, weight's address, bias's address) in the
    order of `_products`' calls."""
    out = []
    for layer in parts:
        for p in layer[2:]:
            w, b = p._parameters["weight"], p._parameters.get("bias")
            # the addresses too: the calls hold them, and a tensor may be given new storage in place
            out.append((w, b, small_gemm.packed_of(w), w.data_ptr(), None if b is None else b.data_ptr()))
    return tuple(out)


def _products(weights: tuple, B: int, H: int, Hq: int, Hkv: int, inter: int) -> list | None:
    """Each layer's seven products as the kernels' calls for B rows (q, k, v, o, gate, up, down);
    None where a weight has another shape or `matmul_kn` would not take it."""
    shapes = [(H, Hq), (H, Hkv), (H, Hkv), (Hq, H), (H, inter), (H, inter), (inter, H)]
    calls = []
    for i, (w, bias, *_) in enumerate(weights):
        call = small_gemm.product(w, bias, B) if list(w.shape) == list(shapes[i % 7]) else None
        if call is None:
            return None
        calls.append(call)
    return [calls[i : i + 7] for i in range(0, len(calls), 7)]


# model -> (key, weak references to every projection's weight, bias and packed copy, the calls):
# the calls stand while those are the same tensors at the same addresses (building them is ~0.5 ms
# a step, checking ~60 us). One plan per model, held weakly: `unpack_weights` frees the packed copies.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refs(weights: tuple) -> tuple:
    return tuple((*(None if t is None else weakref.ref(t) for t in entry[:3]), *entry[3:]) for entry in weights)


def _held(refs: tuple, now: tuple) -> bool:
    """Whether `refs` (from `_refs`) are the tensors of `now`: a freed one never matches."""
    for r, t in zip(refs[:3], now[:3]):
        if (r is None) != (t is None) or (r is not None and r() is not t):
            return False
    return refs[3:] == now[3:]


def _calls(model, parts: list[tuple], B: int, inter: int) -> list | None:
    weights = _weights(parts)
    key = (B, small_gemm.KN_ROWS, small_gemm.PACKED_ROWS, small_gemm.KN_MIN_BYTES)  # (the limits: tests set them)
    plan = _PLANS.get(model)
    if plan is not None and plan[0] == key and len(plan[1]) == len(weights):
        if all(_held(a, b) for a, b in zip(plan[1], weights)):
            return plan[2]
    _PLANS.pop(model, None)
    c = model.config
    D = c.head_dim
    calls = _products(weights, B, c.hidden_size, c.num_attention_heads * D, c.num_key_value_heads * D, inter)
    if calls is not None:
        _PLANS[model] = (key, _refs(weights), calls)
    return calls


def _covered(model) -> list[tuple] | None:
    """Each layer's `_parts` when every module the step stands in for is the plain one it reproduces."""
    types = getattr(type(model), "decode_step_types", None)  # modeling.py's classes (it imports this module)
    if types is None:
        return None
    emb, final = model._sub_layers.get("embed_tokens"), model._sub_layers.get("norm")
    if type(emb) is not paddle.nn.Embedding or emb._padding_idx is not None or emb._max_norm is not None:
        return None
    if type(final) is not types[3] or not _no_hooks(emb, final) or model.active_layers is not None:
        return None
    parts = [_parts(layer, types) for layer in model._sub_layers["layers"]]
    if None in parts:
        return None
    weights = [emb._parameters["weight"], final._parameters["weight"]]
    weights += [n._parameters["weight"] for p in parts for n in p[:2]]
    return parts if native.dense_cpu_float32(*weights) and all(w.is_contiguous() for w in weights) else None


@native.eager_only  # a static program (the export) calls it unconverted: it answers None there
def run(model, input_ids: paddle.Tensor, attention_mask: paddle.Tensor | None, cache) -> paddle.Tensor | None:
    """`model`'s (an Ernie4_5Model) final normed hidden states [B, 1, H] for `input_ids` [B, 1] after
    `cache.length` cached tokens, updating the cache as the layers do; None where the step does not
    apply (nothing is changed then, and the caller runs the layers)."""
    if not (native.cpu_build() and paddle.in_dynamic_mode()) or paddle.is_grad_enabled() or model.training:
        return None
    if input_ids.ndim != 2 or input_ids.shape[1] != 1:
        return None
    parts = _covered(model)
    if not parts:
        return None
    c = model.config
    B, D, KVH, past = input_ids.shape[0], c.head_dim, c.num_key_value_heads, cache.length
    kernels = (norm.forward_kernel(), rope.forward_kernel(), swiglu.forward_kernel())
    if None in kernels or not fused_attention.decode_ready(D):
        return None
    inter = {p[6]._parameters["weight"].shape[-1] for p in parts}  # gate_proj's width
    if len(inter) > 1 or not _cache_buffers_fit(cache, len(parts), B, past, KVH, D):
        return None
    inter = inter.pop()
    calls = _calls(model, parts, B, inter)
    if calls is None:
        return None
    emb = model._sub_layers["embed_tokens"]._parameters["weight"]
    ids = input_ids.numpy().reshape(B)
    if ids.size and (ids.min() < 0 or ids.max() >= emb.shape[0]):
        return None  # the layers' embedding reports it
    if use_fused_attention():
        return None  # (rope_and_mask's mask is then no bias: the layers run)
    if attention_mask is None:
        rope_mask = _rope_rows(c, past, B)
    elif list(attention_mask.shape) == [B, past + 1]:
        rope_mask = _rope_rows(c, past, B, attention_mask.numpy())
    else:
        return None
    cache.reserve(past + 1)  # may grow the buffers (KVCache), or refuse a step past max_len as `update` does
    return _layers(model, parts, calls, inter, emb, ids, rope_mask, cache, kernels)


_ROW_BLOCK = 256  # the table is filled this many positions at a time


class _RopeTable:
    """cos / sin [n, D] of positions 0..n-1 for one (head_dim, theta), filled as positions are
    reached (a block at a time, into a buffer that doubles), so it holds at most ~2x the rows the
    longest sequence used and a step never rebuilds what is there. Rows are written once and never
    moved in place: a step's views of the old buffer stay valid when it is replaced."""

    def __init__(self, D: int, theta) -> None:
        self.D, self.theta, self.n = D, theta, 0
        self.cos = self.sin = np.zeros((0, D), _F32)
        self.lock = threading.Lock()  # one filler at a time (the engine's thread, a chat's, ...)

    def rows(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) holding at least positions [0, end); rows below `n` are final, so a reader
        needs no lock."""
        if end > self.n:
            with self.lock:
                if end > self.n:
                    self._fill(end)
        return self.cos, self.sin

    def _fill(self, end: int) -> None:
        new = -(-end // _ROW_BLOCK) * _ROW_BLOCK
        cos, sin = rope_cos_sin(paddle.arange(self.n, new, dtype="int64").unsqueeze(0), self.D, self.theta)
        if new > len(self.cos):
            cap = max(new, 2 * len(self.cos))
            grown = [np.empty((cap, self.D), _F32) for _ in range(2)]
            for g, old in zip(grown, (self.cos, self.sin)):
                g[: self.n] = old[: self.n]
            self.cos, self.sin = grown
        self.cos[self.n : new] = cos.numpy().reshape(-1, self.D)
        self.sin[self.n : new] = sin.numpy().reshape(-1, self.D)
        self.n = new  # last: the rows below are written


_ROPE_ROWS: dict[tuple, _RopeTable] = {}  # (head_dim, float(theta)) -> its table


def _rope_rows(config, past: int, B: int, mask: np.ndarray | None = None) -> tuple:
    """cos, sin [B, D] and the additive bias ([1 or B, past + 1]) of a step after `past` cached
    tokens, as `rope_and_mask` makes them: without a mask every row sits at `past` and sees every
    key; with one ([B, past + 1], 1 = a real token) a row sits at its mask's sum less one (as
    rope_and_mask's int64 cumsum has it) and sees its real keys and itself.

    Why: `rope_and_mask` spends ~15-25 small Paddle ops on this, ~0.35 ms of a ~21 ms batch-1 step;
    here it is rows of a table. Same bits: the table is the model's own `rope_cos_sin` over the
    positions (Paddle's CPU cos and sin are scalar per element, so an element does not depend on its
    neighbours), and the bias takes additive_mask's two values; tests compare them with rope_and_mask's."""
    D, theta, past = config.head_dim, config.rope_theta, int(past)  # theta as rope_and_mask passes it
    if mask is None:
        pos, bias = np.full(B, past), np.zeros((1, past + 1), _F32)
    else:
        pos = np.maximum(mask.astype(np.int64, copy=False).sum(axis=1) - 1, 0)
        sees = (mask != 0) | (np.arange(past + 1) == past)  # build_attention_mask's [B, 1, 1, past + 1]
        bias = np.where(sees, _F32(0), _F32(-1e30))
    table = _ROPE_ROWS.get((D, float(theta)))
    if table is None:
        table = _ROPE_ROWS.setdefault((D, float(theta)), _RopeTable(D, theta))
    cos, sin = table.rows(int(pos.max()) + 1)
    return cos[pos], sin[pos], bias


def _layers(model, parts, calls, inter, emb, ids, rope_mask, cache, kernels) -> paddle.Tensor:
    c = model.config
    B, H, D, heads, KVH = len(ids), c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    buf = _BUFFERS.get(cache)
    if buf is None:
        buf = _BUFFERS[cache] = _Buffers()
    arr = buf.activations(B, H, heads * D, KVH * D, inter)
    P = buf.ptrs
    rms, rot, act = kernels
    h = arr["h"][:B]
    np.take(host_view(emb), ids, axis=0, out=h)
    past = cache.length
    cos, sin, bias = rope_mask  # float32 arrays, rows contiguous
    scale, batched = D**-0.5, bias.shape[0] > 1
    cs, sn, mb = cos.ctypes.data, sin.ctypes.data, bias.ctypes.data
    kr, vv = arr["kr"][:B].reshape(B, KVH, D), arr["v"][:B].reshape(B, KVH, D)
    for i, ((n1, n2, *_), (q, k, v, o, gate, up, down)) in enumerate(zip(parts, calls)):
        native.over_chunks(rms, B, B * H * 4, P["h"], n1._parameters["weight"].data_ptr(), P["x"], P["r"], H, n1.eps)
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
        native.over_chunks(rms, B, B * H * 4, P["h"], n2._parameters["weight"].data_ptr(), P["x"], P["r"], H, n2.eps)
        gate(P["x"], P["g"])
        up(P["x"], P["u"])
        native.over_chunks(act, B * inter, 4 * B * inter, P["g"], P["u"], P["s"])
        down(P["s"], P["a"])
        np.add(h, arr["a"][:B], out=h)
    cache.length = past + 1
    buf.keep_only([*cache.k, *cache.v])
    out = paddle.empty([B, 1, H], dtype="float32")
    f = model._sub_layers["norm"]
    native.over_chunks(rms, B, B * H * 4, P["h"], f._parameters["weight"].data_ptr(), out.data_ptr(), P["r"], H, f.eps)
    return out
