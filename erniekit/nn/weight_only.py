"""Weight-only quantization of a checkpoint's matrices (`erniekit export --format wint8|wint4`).

wint8: int8 per output channel (scale = max |row| / 127). wint4: 4-bit group-wise along the
input dimension (scale per `group_size` inputs of a row = max |group| / 7), two values per byte,
the even input index in the low nibble. Matrices are in the Hugging Face layout [out, in]; the
scale is stored beside each as `<name>_scale` ([out] for int8, [out, in / group_size] for int4),
so a reader knows a quantized tensor by its scale and its logical shape by the scale's.
"""

from __future__ import annotations

import re

import numpy as np

SCALE_SUFFIX = "_scale"
# what is quantized: the decoder's projections and experts (not embeddings, LM head, router, norms)
QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|"
    r"mlp\.shared_experts\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (int8 [out, in], float32 scale [out])."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (uint8 [out, in / 2] two 4-bit values each, float32 scale [out, in / group_size])."""
    out, cols = w.shape
    if cols % group_size or group_size % 2:
        raise ValueError(f"wint4: group size {group_size} must be even and divide the input size {cols}")
    g = w.astype(np.float32).reshape(out, cols // group_size, group_size)
    scale = np.abs(g).max(axis=2) / 7.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[:, :, None]), -8, 7).astype(np.int8).reshape(out, cols)
    nib = (q & 0x0F).astype(np.uint8)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 [out, in] matrix a quantized tensor stands for (int8 or packed int4, told by the
    scale's rank)."""
    if scale.ndim == 1:
        return q.astype(np.float32) * scale[:, None]
    lo = (q & 0x0F).astype(np.int8)
    hi = (q >> 4).astype(np.int8)
    vals = np.empty((q.shape[0], q.shape[1] * 2), dtype=np.int8)
    vals[:, 0::2] = np.where(lo > 7, lo - 16, lo)
    vals[:, 1::2] = np.where(hi > 7, hi - 16, hi)
    out, cols = vals.shape
    groups = scale.shape[1]
    return (vals.reshape(out, groups, cols // groups).astype(np.float32) * scale[:, :, None]).reshape(out, cols)


def logical_shape(stored: list[int], scale_shape: list[int]) -> list[int]:
    return list(stored) if len(scale_shape) == 1 else [stored[0], stored[1] * 2]


def quantize_state(state: dict[str, np.ndarray], bits: int, group_size: int = 64) -> tuple[dict[str, np.ndarray], int]:
    """HF-layout tensors -> the same with QUANTIZED matrices replaced by (q, scale); and how many
    matrices were quantized."""
    out, n = {}, 0
    for name, w in state.items():
        if QUANTIZED.match(name) and w.ndim == 2:
            q, s = quantize_int8(w) if bits == 8 else quantize_int4(w, group_size)
            out[name], out[name + SCALE_SUFFIX] = q, s
            n += 1
        else:
            out[name] = w
    return out, n
