"""Rotary embeddings as ERNIE 4.5 applies them, attention masks, and the attention kernel call."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def rope_cos_sin(position_ids: paddle.Tensor, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos/sin of shape [B, S, 1, head_dim/2], computed in float32 (as the reference does)."""
    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
    freqs = position_ids.astype("float32").unsqueeze(-1) * inv_freq  # [B, S, D/2]
    return paddle.cos(freqs).unsqueeze(2), paddle.sin(freqs).unsqueeze(2)


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """ERNIE 4.5 rotates *interleaved* pairs (x[2i], x[2i+1]) by angle pos*inv_freq[i]
    (GLM style, not the half-split of LLaMA). x: [B, S, H, D]."""
    dtype = x.dtype
    pairs = x.astype("float32").reshape(x.shape[:-1] + [x.shape[-1] // 2, 2])
    a, b = pairs[..., 0], pairs[..., 1]
    out = paddle.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(x.shape).astype(dtype)


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
        seg_q = segment_ids[:, kv_len - q_len:]
        same = seg_q.unsqueeze(2) == seg_k.unsqueeze(1)  # [B, q, k]
        mask = paddle.logical_and(mask, same.unsqueeze(1))
    if key_padding_mask is not None:
        keep = key_padding_mask.astype("bool").unsqueeze(1).unsqueeze(1)  # [B, 1, 1, k]
        mask = paddle.logical_and(mask, keep)
        # a padding query that can see nothing would give NaN: let it see itself
        eye = (k_pos == q_pos).unsqueeze(0).unsqueeze(0)
        mask = paddle.logical_or(mask, eye)
    return mask


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
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, training=False, scale=scale
    )
