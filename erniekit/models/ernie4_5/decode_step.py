"""An ERNIE 4.5 model's decode step (one new token per sequence against a KV cache, under no_grad)
as direct calls of the layers' C kernels on buffers of its own, dense layers and MoE blocks.

Why: in a batch-1 decode step of the dense-1024 benchmark model the kernels' products stream the
weights in ~20 ms, and the layer-by-layer forward spent ~7 ms more around them: ~30 small Paddle ops
and Python calls a layer (module calls, shape checks, output allocations, the KV cache's slice
copies). Here a layer is ~15 kernel calls on preallocated buffers, and the attention reads the KV
cache's buffers in place.

Same bits: every operation is the one the layer-by-layer forward runs on the same inputs. The same
kernels with the same arguments (nn/norm.py, nn/small_gemm.py, nn/rope.py, nn/fused_attention.py,
nn/swiglu.py), MKL's sgemm with Paddle's arguments where a layer's product goes to Paddle's linear
(`grouped_gemm.linear_call`: a tiny model's projections, more rows than the kernels take; the
embedded default's model decodes 2.5x faster in the step at batch 1), the embedding's rows
copied, numpy's float32 add for the residual adds (one rounding, as Paddle's), and the rows of a
table of the model's own `rope_cos_sin` for the positions (with the mask's two values for its
bias, `_rope_rows`). A MoE block (`_moe_mlp`) runs its own router (a few
Paddle ops), sorts the assignments as `dispatch` does and runs the same grouped-GEMM products as
the experts' forward (nn/grouped_gemm.py: MKL's, a decode step's groups of a few rows the kn
kernel's), then sums the weighted rows in index_add's order; it
records its routing as the block does (RL rollouts read it). The moe16-top4 benchmark model's
decode step: 12.6 ms here against the layers' 20.4 at batch 1, 33.3 against 44.8 at batch 8
(medians of 4 alternating runs, AMD EPYC without AVX-512, 2 threads).
Tests compare the two bit for bit. A VL model's text tokens take it too (their 3-D rope is the 1-D
one, and its MoE blocks route text to their text experts). Whatever the step does not cover takes
the layers: vision tokens, capacity-limited MoE blocks, routing replay, elastic sub-models, FP8 or LoRA
experts, experts split over processes, adapters, hooks, GPAS, elastic depth, GPU or half precision,
a wheel without MKL, a prefill, a gradient, `ERNIEKIT_NATIVE_KERNELS=0`.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import paddle

from erniekit.nn import fused_attention, grouped_gemm, native, norm, rope, small_gemm, swiglu
from erniekit.nn.attention import rope_cos_sin, use_fused_attention
from erniekit.nn.moe import StackedExperts, TopKRouter
from erniekit.utils.dtensor import host_view

_F32 = np.float32


def _aligned(shape: tuple[int, int]) -> np.ndarray:
    """Zeros at a 64-byte boundary, as Paddle allocates: MKL's products may round by their operands'
    alignment, and the MoE blocks hand it these buffers where the layers hand it Paddle's."""
    n = shape[0] * shape[1]
    raw = np.zeros(n + 16, _F32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + n].reshape(shape)


class _Buffers:
    """One cache's step buffers: the activations (rows for the most sequences seen so far) and
    numpy views of the cache's key / value buffers (kept while those buffers are the cache's)."""

    def __init__(self) -> None:
        self.shape: tuple = ()
        self.views: dict[int, tuple[paddle.Tensor, int, list, np.ndarray]] = {}

    def activations(self, rows: int, widths: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        """Float32 arrays by name, [rows * per_row, width] for widths[name] = (per_row, width)."""
        key = tuple(sorted(widths.items()))
        if not self.shape or rows > self.shape[0] or self.shape[1] != key:
            self.arrays = {name: _aligned((rows * n, w)) for name, (n, w) in widths.items()}
            self.ptrs = {name: a.ctypes.data for name, a in self.arrays.items()}
            self.shape = (rows, key)
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
    """(input norm, post-attention norm, the MoE block or None, the projections: q, k, v, o, then the
    MLP's gate, up, down, or the MoE block's shared experts' (none without them)) of a decoder layer
    the step reproduces (a dense SwiGLU MLP or a text MoE block `_moe_covered` takes, no GPAS, plain
    Linear projections: no adapter, no quantized layer; no hooks), else None. Read from the Layers'
    own dicts: Paddle's Layer.__getattr__ costs ~2 us an access, and this runs every step."""
    decoder, attention, mlp, rms, linear, moe = types
    subs = layer._sub_layers if type(layer) is decoder else {}
    a, m = subs.get("self_attn"), subs.get("mlp")
    n1, n2 = subs.get("input_layernorm"), subs.get("post_attention_layernorm")
    if type(a) is not attention or type(n1) is not rms or type(n2) is not rms or layer.gpas is not None:
        return None
    block = m if type(m) is moe else None
    if block is not None:
        shared = block._sub_layers.get("shared_experts")
        if not _moe_covered(block) or (shared is not None and type(shared) is not mlp):
            return None
        inner = [] if shared is None else [shared]
    elif type(m) is mlp:
        inner = [m]
    else:
        return None
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    projections = tuple(a._sub_layers.get(name) for name in names)
    projections += tuple(f._sub_layers.get(name) for f in inner for name in ("gate_proj", "up_proj", "down_proj"))
    if any(type(p) is not linear for p in projections) or not _no_hooks(layer, a, m, n1, n2, *inner, *projections):
        return None
    return (n1, n2, block, projections)


def _moe_covered(block) -> bool:
    """A MoE block in its plain inference form: one router and one StackedExperts of float32 CPU
    weights on the grouped GEMM (nn/grouped_gemm.py: what `_moe_mlp` reproduces), no capacity limit, no elastic
    sub-model, no routing replay, no FP8, nothing split over processes, no hooks. A VL model's
    block qualifies by its text router and experts: the step runs on text tokens only (no
    token_type_ids), which the block routes there."""
    gate, experts = block._sub_layers.get("gate"), block._sub_layers.get("experts")
    if block.training or block.capacity_factor > 0 or block.routing_reference is not None:
        return False
    if type(gate) is not TopKRouter or gate.active_experts is not None or gate.active_k is not None:
        return False
    if type(experts) is not StackedExperts or experts.fp8_block or experts._local:
        return False
    if experts.expert_parallel is not None or experts.replicated is not None or experts.tensor_parallel is not None:
        return False
    ws = [experts._parameters[p] for p in StackedExperts.PROJS] + [gate._parameters["weight"]]
    if not (native.dense_cpu_float32(*ws) and all(w.is_contiguous() for w in ws) and grouped_gemm.available()):
        return False
    return _no_hooks(gate, experts)


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
        for p in layer[3]:
            w, b = p._parameters["weight"], p._parameters.get("bias")
            # the addresses too: the calls hold them, and a tensor may be given new storage in place
            out.append((w, b, small_gemm.packed_of(w), w.data_ptr(), None if b is None else b.data_ptr()))
    return tuple(out)


def _product(w: paddle.Tensor, bias: paddle.Tensor | None, B: int):
    """The call of the product the layer runs for B rows: the kernel where `takes_kn` says yes,
    else Paddle's linear as MKL computes it (a tiny model's projections, more rows than the kernel
    takes); None where neither can be reproduced."""
    return small_gemm.product(w, bias, B) or grouped_gemm.linear_call(w, bias, B)


def _products(weights: tuple, counts: list[int], B: int, H: int, Hq: int, Hkv: int) -> list | None:
    """Each layer's products as calls for B rows (q, k, v, o, then gate, up, down where the layer has
    them; `counts` per layer); None where a weight has another shape or no call reproduces it."""
    calls, at = [], 0
    for n in counts:
        layer = weights[at : at + n]
        at += n
        shapes = [(H, Hq), (H, Hkv), (H, Hkv), (Hq, H)]
        if n > 4:  # the MLP's width: its gate projection's
            inter = layer[4][0].shape[-1]
            shapes += [(H, inter), (H, inter), (inter, H)]
        row = []
        for (w, bias, *_), shape in zip(layer, shapes):
            call = _product(w, bias, B) if list(w.shape) == list(shape) else None
            if call is None:
                return None
            row.append(call)
        calls.append(row)
    return calls


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


def _calls(model, parts: list[tuple], B: int) -> list | None:
    weights = _weights(parts)
    key = (B, small_gemm.KN_ROWS, small_gemm.PACKED_ROWS, small_gemm.KN_MIN_BYTES)  # (the limits: tests set them)
    plan = _PLANS.get(model)
    if plan is not None and plan[0] == key and len(plan[1]) == len(weights):
        if all(_held(a, b) for a, b in zip(plan[1], weights)):
            return plan[2]
    _PLANS.pop(model, None)
    c = model.config
    D = c.head_dim
    counts = [len(p[3]) for p in parts]
    calls = _products(weights, counts, B, c.hidden_size, c.num_attention_heads * D, c.num_key_value_heads * D)
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
def run(
    model,
    input_ids: paddle.Tensor,
    attention_mask: paddle.Tensor | None,
    cache,
    position_ids: paddle.Tensor | None = None,
) -> paddle.Tensor | None:
    """`model`'s (an Ernie4_5Model) final normed hidden states [B, 1, H] for `input_ids` [B, 1] after
    `cache.length` cached tokens, updating the cache as the layers do; None where the step does not
    apply (nothing is changed then, and the caller runs the layers). position_ids: [B, 1], or a VL
    model's [3, B, 1] with its three rows equal (a text token: the 3-D rope is then the 1-D one)."""
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
    if not _cache_buffers_fit(cache, len(parts), B, past, KVH, D):
        return None
    calls = _calls(model, parts, B)
    if calls is None:
        return None
    emb = model._sub_layers["embed_tokens"]._parameters["weight"]
    ids = input_ids.numpy().reshape(B)
    if ids.size and (ids.min() < 0 or ids.max() >= emb.shape[0]):
        return None  # the layers' embedding reports it
    if use_fused_attention():
        return None  # (rope_and_mask's mask is then no bias: the layers run)
    pos = None if position_ids is None else _text_positions(position_ids, B, model.mrope_section is not None)
    if position_ids is not None and pos is None:
        return None
    if attention_mask is None:
        rope_mask = _rope_rows(c, past, B, pos=pos)
    elif list(attention_mask.shape) == [B, past + 1]:
        rope_mask = _rope_rows(c, past, B, attention_mask.numpy(), pos)
    else:
        return None
    cache.reserve(past + 1)  # may grow the buffers (KVCache), or refuse a step past max_len as `update` does
    return _layers(model, parts, calls, emb, ids, rope_mask, cache, kernels)


def _text_positions(position_ids: paddle.Tensor, B: int, three_d: bool) -> np.ndarray | None:
    """[B] positions of a step's given position_ids ([B, 1], or [3, B, 1] with equal rows where the
    model has a 3-D rope: `three_d`), or None where the step cannot take them (another shape, a 3-D
    position of a vision token, a negative; the layers then run, or refuse what they refuse)."""
    shapes = ([B, 1], [3, B, 1]) if three_d else ([B, 1],)
    if list(position_ids.shape) not in shapes or position_ids.dtype not in (paddle.int64, paddle.int32):
        return None
    p = position_ids.numpy().reshape(-1, B).astype(np.int64)
    if (p != p[0]).any() or (p[0] < 0).any():
        return None
    return p[0]


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


def _rope_rows(config, past: int, B: int, mask: np.ndarray | None = None, pos: np.ndarray | None = None) -> tuple:
    """cos, sin [B, D] and the additive bias ([1 or B, past + 1]) of a step after `past` cached
    tokens, as `rope_and_mask` makes them: without a mask every row sits at `past` and sees every
    key; with one ([B, past + 1], 1 = a real token) a row sits at its mask's sum less one (as
    rope_and_mask's int64 cumsum has it) and sees its real keys and itself; `pos` ([B]), the
    caller's position_ids, overrides where the rows sit.

    Why: `rope_and_mask` spends ~15-25 small Paddle ops on this, ~0.35 ms of a ~21 ms batch-1 step;
    here it is rows of a table. Same bits: the table is the model's own `rope_cos_sin` over the
    positions (Paddle's CPU cos and sin are scalar per element, so an element does not depend on its
    neighbours), and the bias takes additive_mask's two values; tests compare them with rope_and_mask's."""
    D, theta, past = config.head_dim, config.rope_theta, int(past)  # theta as rope_and_mask passes it
    if mask is None:
        pos, bias = np.full(B, past) if pos is None else pos, np.zeros((1, past + 1), _F32)
    else:
        pos = np.maximum(mask.astype(np.int64, copy=False).sum(axis=1) - 1, 0) if pos is None else pos
        sees = (mask != 0) | (np.arange(past + 1) == past)  # build_attention_mask's [B, 1, 1, past + 1]
        bias = np.where(sees, _F32(0), _F32(-1e30))
    table = _ROPE_ROWS.get((D, float(theta)))
    if table is None:
        table = _ROPE_ROWS.setdefault((D, float(theta)), _RopeTable(D, theta))
    cos, sin = table.rows(int(pos.max()) + 1)
    return cos[pos], sin[pos], bias


def _widths(parts: list[tuple], H: int, Hq: int, Hkv: int) -> dict[str, tuple[int, int]]:
    """The step's buffers: (rows per sequence, width) by name. g / u / s hold the widest dense MLP or
    shared experts; a MoE block's routed rows (k per sequence) go through xe / ge / ue / se / ye."""
    widths = {
        name: (1, w) for name, w in dict(h=H, x=H, a=H, m=H, q=Hq, qr=Hq, o=Hq, k=Hkv, kr=Hkv, v=Hkv, r=1).items()
    }
    inter = max([p[3][4]._parameters["weight"].shape[-1] for p in parts if len(p[3]) > 4], default=1)
    widths.update(g=(1, inter), u=(1, inter), s=(1, inter))
    blocks = [p[2] for p in parts if p[2] is not None]
    if blocks:
        k = max(b._sub_layers["gate"].k for b in blocks)
        ie = max(b._sub_layers["experts"]._parameters["gate_proj"].shape[-1] for b in blocks)
        widths.update(xe=(k, H), ye=(k, H), ge=(k, ie), ue=(k, ie), se=(k, ie))
    return widths


def _layers(model, parts, calls, emb, ids, rope_mask, cache, kernels) -> paddle.Tensor:
    c = model.config
    B, H, D, heads, KVH = len(ids), c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    buf = _BUFFERS.get(cache)
    if buf is None:
        buf = _BUFFERS[cache] = _Buffers()
    arr = buf.activations(B, _widths(parts, H, heads * D, KVH * D))
    P = buf.ptrs
    rms, rot, act = kernels
    h = arr["h"][:B]
    np.take(host_view(emb), ids, axis=0, out=h)
    past = cache.length
    cos, sin, bias = rope_mask  # float32 arrays, rows contiguous
    scale, batched = D**-0.5, bias.shape[0] > 1
    cs, sn, mb = cos.ctypes.data, sin.ctypes.data, bias.ctypes.data
    kr, vv = arr["kr"][:B].reshape(B, KVH, D), arr["v"][:B].reshape(B, KVH, D)
    for i, ((n1, n2, block, projs), (q, k, v, o, *mlp)) in enumerate(zip(parts, calls)):
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
        if mlp:  # the dense MLP, or the MoE block's shared experts: into `a`
            gate, up, down = mlp
            inter = projs[4]._parameters["weight"].shape[-1]
            gate(P["x"], P["g"])
            up(P["x"], P["u"])
            native.over_chunks(act, B * inter, 4 * B * inter, P["g"], P["u"], P["s"])
            down(P["s"], P["a"])
        if block is None:
            np.add(h, arr["a"][:B], out=h)
            continue
        routed = _moe_mlp(block, arr, P, act, B)  # into `m`
        if mlp:  # MoEBlock: routed + shared
            np.add(routed, arr["a"][:B], out=routed)
        np.add(h, routed, out=h)
    cache.length = past + 1
    buf.keep_only([*cache.k, *cache.v])
    out = paddle.empty([B, 1, H], dtype="float32")
    f = model._sub_layers["norm"]
    native.over_chunks(rms, B, B * H * 4, P["h"], f._parameters["weight"].data_ptr(), out.data_ptr(), P["r"], H, f.eps)
    return out


def _moe_mlp(block, arr: dict, P: dict, act, B: int) -> np.ndarray:
    """A MoE block's routed experts on the step's normed rows `x`, into `m`, as MoEBlock.forward
    makes them: its own router (a few Paddle ops; it records the routing as the block does), the
    assignments sorted by expert as `dispatch` sorts them, each projection the same list of
    products the experts' forward runs (`grouped_gemm.run_products`, so they round alike), the SwiGLU kernel, and the
    weighted rows summed into their tokens in index_add's order."""
    gate, experts = block._sub_layers["gate"], block._sub_layers["experts"]
    x = arr["x"][:B]
    r = gate(paddle.to_tensor(x))
    # a VL block's text router: its probabilities in the global columns, as the block records them
    probs = block._global_probs(0, r.probs)
    block.last_topk_idx, block.last_probs, block.last_modality = r.topk_idx.detach(), probs.detach(), None
    idx, weight = r.topk_idx.numpy(), r.topk_weight.numpy()
    A = idx.size
    flat = idx.reshape(A)
    order = np.argsort(flat, kind="stable")
    tok = order // idx.shape[1]
    counts = np.bincount(flat, minlength=experts.num_experts)
    used = np.flatnonzero(counts)
    sizes, used = counts[used].tolist(), used.tolist()
    np.take(x, tok, axis=0, out=arr["xe"][:A])
    wg, wu, wd = (experts._parameters[p] for p in StackedExperts.PROJS)
    decode = grouped_gemm.decode_sized(A)  # as the experts' forward decides it on these rows
    products = grouped_gemm.products_at(P["xe"], wg, P["ge"], sizes, used, False)
    products += grouped_gemm.products_at(P["xe"], wu, P["ue"], sizes, used, False)
    grouped_gemm.run_products(products, decode)
    n = A * wg.shape[-1]
    native.over_chunks(act, n, 4 * n, P["ge"], P["ue"], P["se"])
    grouped_gemm.run_products(grouped_gemm.products_at(P["se"], wd, P["ye"], sizes, used, False), decode)
    ye, m = arr["ye"][:A], arr["m"][:B]
    np.multiply(ye, weight.reshape(A)[order][:, None], out=ye)
    m.fill(0)
    np.add.at(m, tok, ye)
    return m
