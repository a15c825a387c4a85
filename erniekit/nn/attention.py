"""Rotary embeddings as ERNIE 4.5 applies them, attention masks, and the attention kernel call."""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F

from erniekit.nn import fused_attention, masked_softmax, rope


def rope_cos_sin(position_ids: paddle.Tensor, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos/sin of shape [B, S, 1, head_dim], each angle repeated for its interleaved pair,
    computed once per forward in float32 (as the reference does)."""
    freqs = position_ids.astype("float32").unsqueeze(-1) * _inv_freq(head_dim, theta)  # [B, S, D/2]
    # each angle twice (pair i -> dims 2i, 2i+1); tile + flatten rather than repeat_interleave,
    # which paddle2onnx cannot convert with dynamic shapes (the onnx export)
    freqs = paddle.tile(freqs.unsqueeze(-1), [1, 1, 1, 2]).flatten(start_axis=-2)
    return paddle.cos(freqs).unsqueeze(2), paddle.sin(freqs).unsqueeze(2)


_INV_FREQ: dict[tuple, paddle.Tensor] = {}  # (head_dim, theta, device) -> inv_freq: made once, not per step


def _inv_freq(head_dim: int, theta: float) -> paddle.Tensor:
    """1 / theta^(2i / head_dim), i < head_dim / 2; cached in dynamic mode (a decode step would
    otherwise spend 3 of its ~20 small ops on it), built in the program in static mode."""
    if not paddle.in_dynamic_mode():  # (to_static converts this function: keep its branches plain)
        return _inv_freq_of(head_dim, theta)
    key = (head_dim, float(theta), str(paddle.get_device()))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = _inv_freq_of(head_dim, theta)
    return _INV_FREQ[key]


def _inv_freq_of(head_dim: int, theta: float) -> paddle.Tensor:
    return 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))


def rope_cos_sin_3d(
    position_ids: paddle.Tensor, head_dim: int, theta: float, sections: list[int]
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """ERNIE-4.5-VL's 3-D rotary positions: position_ids [3, B, S] (temporal, height, width) ->
    cos/sin [B, S, 1, head_dim] as `rope_cos_sin` lays them out.

    Pair p keeps the text model's frequency inv_freq[p]; its angle takes the height position for
    even p and the width position for odd p among the first sections[0] + sections[1] pairs, and
    the temporal position for the last sections[2] (the reference pre-permutes its frequencies
    and interleaves h/w sections to the same effect). With the three rows equal (text) this is
    `rope_cos_sin` exactly."""
    half = head_dim // 2
    hw = sections[0] + sections[1]
    if sections[0] != sections[1] or hw + sections[2] != half:
        raise ValueError(f"mrope_section={sections}: needs two equal h/w sections and a sum of head_dim/2={half}")
    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
    axis = [1 + p % 2 if p < hw else 0 for p in range(half)]  # pair -> row of position_ids
    pos = position_ids.astype("float32")  # [3, B, S]
    angles = paddle.stack([pos[a] for a in (0, 1, 2)], axis=-1)  # [B, S, 3]
    onehot = paddle.to_tensor([[1.0 if axis[p] == a else 0.0 for p in range(half)] for a in range(3)])  # [3, D/2]
    freqs = paddle.matmul(angles, onehot) * inv_freq  # [B, S, D/2]: the chosen row's position times inv_freq
    freqs = paddle.tile(freqs.unsqueeze(-1), [1, 1, 1, 2]).flatten(start_axis=-2)
    return paddle.cos(freqs).unsqueeze(2), paddle.sin(freqs).unsqueeze(2)


_PAIR_ROTATION = [[0.0, 1.0], [-1.0, 0.0]]  # [a, b] @ R = [-b, a]
_ROTATIONS: dict[str, paddle.Tensor] = {}  # the rotation as a tensor, per device: made once, not per call


@paddle.jit.not_to_static
def _pair_rotation() -> paddle.Tensor:
    """Dynamic mode only (a static program holds its own constant)."""
    device = str(paddle.get_device())
    if device not in _ROTATIONS:
        _ROTATIONS[device] = paddle.to_tensor(_PAIR_ROTATION)
    return _ROTATIONS[device]


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """ERNIE 4.5 rotates *interleaved* pairs (x[2i], x[2i+1]) by angle pos*inv_freq[i]
    (GLM style, not the half-split of LLaMA). x: [B, S, H, D].

    The pair rotation is a 2x2 matmul rather than slicing: Paddle's CPU slice backward is
    slow (measured 2x on the whole rope). On plain CPU tensors cos/sin [B, S, 1, D] are expanded
    to x's heads first: Paddle's CPU kernels broadcasting over a middle axis are ~20x slower than
    same-shape ones (rope forward + backward 9.4 -> 1.1 ms on the embedded default's shapes, same
    values). Elsewhere they broadcast: the products keep cos and sin for the backward, and expanded
    they cost 2 x (q + kv) floats a token and layer (on GPUs; on a tp rank whole, since the expand
    of a replicated tensor to x's global shape is replicated)."""
    if rope.usable(x, cos, sin):  # float32 on the CPU: one C pass each way, the same bits
        return rope.apply_rope(x, cos, sin)
    dtype = x.dtype
    xf = x if dtype == paddle.float32 else x.astype("float32")
    if _expand_rope(xf, cos):  # (a static export keeps the broadcast)
        cos, sin = cos.expand(xf.shape).contiguous(), sin.expand(xf.shape).contiguous()
    pair = _pair_rotation() if paddle.in_dynamic_mode() else paddle.to_tensor(_PAIR_ROTATION)
    rot = paddle.matmul(xf.reshape(x.shape[:-1] + [x.shape[-1] // 2, 2]), pair)
    out = xf * cos + rot.reshape(x.shape) * sin
    return out if dtype == paddle.float32 else out.astype(dtype)


def _expand_rope(x: paddle.Tensor, cos: paddle.Tensor) -> bool:
    """Expand cos/sin to x's shape: plain CPU tensors in dynamic mode only (the speed above)."""
    return paddle.in_dynamic_mode() and cos.shape != x.shape and not x.is_dist() and x.place.is_cpu_place()


def build_attention_mask(
    q_len: int,
    kv_len: int,
    segment_ids: paddle.Tensor | None = None,
    key_padding_mask: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """Boolean mask [B or 1, 1, q_len, kv_len], True = may attend.

    Causal with the queries being the last `q_len` of `kv_len` positions (KV cache), restricted to
    the same document when `segment_ids` [B, S] is given (packed sequences), and to non-padding
    keys when `key_padding_mask` [B, kv_len] (1 = real token) is given.
    """
    q_pos = paddle.arange(kv_len - q_len, kv_len).unsqueeze(1)
    k_pos = paddle.arange(kv_len).unsqueeze(0)
    mask = (k_pos <= q_pos).unsqueeze(0).unsqueeze(0)  # [1, 1, q, k]
    if segment_ids is not None:
        seg_k = segment_ids
        seg_q = segment_ids[:, kv_len - q_len :]
        same = seg_q.unsqueeze(2) == seg_k.unsqueeze(1)  # [B, q, k]
        mask = paddle.logical_and(mask, same.unsqueeze(1))
    if key_padding_mask is not None:
        keep = key_padding_mask.astype("bool").unsqueeze(1).unsqueeze(1)  # [B, 1, 1, k]
        mask = paddle.logical_and(mask, keep)
        # a padding query that can see nothing would give NaN: let it see itself
        eye = (k_pos == q_pos).unsqueeze(0).unsqueeze(0)
        mask = paddle.logical_or(mask, eye)
    return mask


def use_fused_attention() -> bool:
    """Paddle's fused SDPA (flash kernels) on GPU; on CPU it decomposes into slower ops than
    `math_attention` (measured ~3x on the tiny model's shapes)."""
    return paddle.get_device().startswith("gpu")


def additive_mask(mask: paddle.Tensor | None, q_len: int, kv_len: int, dtype) -> paddle.Tensor:
    """Boolean mask -> additive bias (0 / very negative), causal when `mask` is None; built once per forward."""
    if mask is None:
        mask = build_attention_mask(q_len, kv_len)
    neg = -1e30 if dtype == paddle.float32 else -1e4
    return paddle.where(mask, paddle.zeros([1], dtype), paddle.full([1], neg, dtype))


def math_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """Softmax attention with GQA by grouping query heads per kv head (no k/v repeat).

    q [B, Sq, H, D], k/v [B, Sk, KVH, D], bias [B|1, 1, Sq, Sk] additive -> [B, Sq, H, D].

    The scale multiplies q, not the scores: Sk / D times fewer elements, forward and backward
    (the same bits when it is a power of two: head_dim 16, 64, 256). Float32 on the CPU takes one C
    kernel each way (erniekit/nn/fused_attention.py) when its shapes fit; otherwise float32 scores
    take the fused masked softmax (erniekit/nn/masked_softmax.py), which reads the mask as it is.
    """
    if fused_attention.usable(q, k, v, bias):  # float32 on the CPU: one C kernel each way
        return fused_attention.fused_attention(q, k, v, bias, scale)
    B, Sq, H, D = q.shape
    Sk, KVH = k.shape[1], k.shape[2]
    rep = H // KVH
    qh = (q * scale).reshape([B, Sq, KVH, rep, D]).transpose([0, 2, 3, 1, 4]).reshape([B, KVH, rep * Sq, D])
    kh, vh = k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])
    s = paddle.matmul(qh, kh, transpose_y=True).reshape([B, KVH * rep, Sq, Sk])
    if masked_softmax.usable(s, bias):
        p = masked_softmax.masked_softmax(s, bias)
    else:
        s = s.reshape([B, KVH, rep, Sq, Sk])
        # the bias expanded to s's shape first: a broadcasting add is ~60x slower on CPU (2.3 ms vs
        # 0.04 + 0.05 ms for the expand, embedded default's shapes)
        bias = bias.unsqueeze(2)
        s = s + (bias.expand(s.shape).contiguous() if paddle.in_dynamic_mode() else bias)
        p = F.softmax(s.astype("float32"), axis=-1).astype(q.dtype)
    o = paddle.matmul(p.reshape([B, KVH, rep * Sq, Sk]), vh).reshape([B, KVH, rep, Sq, D])
    return o.transpose([0, 3, 1, 2, 4]).reshape([B, Sq, H, D])


def attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor | None, causal: bool, scale: float
) -> paddle.Tensor:
    """q [B, Sq, H, D], k/v [B, Sk, KVH, D] -> [B, Sq, H, D] through Paddle's fused SDPA.

    GQA is handled by repeating kv heads so every backend (CPU math, flash on GPU) accepts it.
    """
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = paddle.repeat_interleave(k, rep, axis=2)
        v = paddle.repeat_interleave(v, rep, axis=2)
    if mask is not None and mask.shape[0] != q.shape[0]:
        mask = mask.expand([q.shape[0]] + mask.shape[1:])
    # SDPA's own default scale is 1/sqrt(head_dim); naming it rules flash attention out (Paddle 3.3's
    # check_scale_is_None), so the default is left unnamed
    default = math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-12)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, training=False, scale=None if default else scale
    )


class KVCache:
    """Per-layer key/value buffers [B, capacity, KVH, D]; `length` tokens are valid, at most `max_len`.
    The buffers start at the first update's length plus `GROW` columns and double as tokens come:
    a generous max_new_tokens costs memory only for the tokens actually generated.
    `config`: any model config with num_hidden_layers, num_key_value_heads and head_dim."""

    GROW = 256  # columns past the first update's (the prompt's) that the first buffers hold

    def __init__(self, config, batch_size: int, max_len: int, dtype: str = "float32"):
        self._shape = [batch_size, 0, config.num_key_value_heads, config.head_dim]
        self._dtype = dtype
        self.k = [paddle.zeros(self._shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [paddle.zeros(self._shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.length = 0
        self.max_len = max_len

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[1]) if self.k else 0

    def _grow(self, end: int) -> None:
        cap = min(self.max_len, max(end + (self.GROW if self.capacity == 0 else 0), 2 * self.capacity))
        shape = [self._shape[0], cap, *self._shape[2:]]
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = paddle.zeros(shape, dtype=self._dtype)
                if self.length:
                    new[:, : self.length] = old[:, : self.length]
                bufs[i] = new

    def reserve(self, end: int) -> None:
        """Room for `end` tokens in every layer's buffers (ValueError past max_len)."""
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len={self.max_len}")
        if end > self.capacity:  # every layer's buffers at once, before layer 0 writes its tokens
            self._grow(end)

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        start, end = self.length, self.length + k.shape[1]
        self.reserve(end)
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]
