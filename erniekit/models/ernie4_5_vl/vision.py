"""ERNIE-4.5-VL's vision side: a ViT over variable-resolution patches and the resampler that merges
2x2 patches (and frame pairs of a video) into the text model's width.

Images arrive as flattened patches, all images of a batch concatenated: pixel_values
[patches, C * p * p] with grid_thw [n, 3] (frames, patch rows, patch columns) per image or video,
the patches of each frame in 2x2 merge-block order (the processor's layout). Attention is full
within a frame and never across frames or images (a block-diagonal mask, the reference's
cu_seqlens); positions are 2-D rope over (row, column).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from erniekit.models.ernie4_5.modeling import RMSNorm
from erniekit.models.ernie4_5_vl.configuration import Ernie4_5_VLConfig, VisionConfig
from erniekit.nn import fused_attention
from erniekit.nn.linear import Linear


def vision_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(row, column) of every patch [patches, 2], in the merge-block order of the patches."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def frame_lengths(grid_thw: np.ndarray) -> list[int]:
    """Patches of each attention segment: one per frame of each image or video."""
    return [int(h * w) for t, h, w in grid_thw.tolist() for _ in range(int(t))]


def _rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


class VisionRope(nn.Layer):
    """Axial 2-D rope: a quarter of the head's frequencies for rows, the same for columns; the
    angles cover the whole head, rotated half against half (not interleaved)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))

    def forward(self, positions: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
        freqs = paddle.to_tensor(positions.astype(np.float32)).unsqueeze(-1) * paddle.to_tensor(self.inv_freq)
        hw = paddle.concat([freqs[:, 0], freqs[:, 1]], axis=-1)  # [N, D/2]
        angles = paddle.concat([hw, hw], axis=-1)  # [N, D]
        return paddle.cos(angles), paddle.sin(angles)


def quick_gelu(x: paddle.Tensor) -> paddle.Tensor:
    return x * F.sigmoid(1.702 * x)


class VisionMLP(nn.Layer):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)
        self.act = quick_gelu if config.hidden_act == "quick_gelu" else F.gelu

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionAttention(nn.Layer):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, bias: paddle.Tensor) -> paddle.Tensor:
        """x [N, hidden]; bias [N, N] additive (0 within a frame, very negative across)."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape([n, 3, self.num_heads, self.head_dim])
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [N, heads, D]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        q4, k4, v4, b4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), bias.reshape([1, 1, n, n])
        if fused_attention.usable(q4, k4, v4, b4):
            # float32 on the CPU: one C kernel each way, visiting only each frame's own keys (the
            # block-diagonal mask's -1e30 elsewhere), where the GEMMs below fill all N x N scores
            out = fused_attention.fused_attention(q4, k4, v4, b4, self.head_dim**-0.5)
            return self.proj(out.reshape([n, -1]))
        q, k, v = (t.transpose([1, 0, 2]) for t in (q, k, v))  # [heads, N, D]
        scores = paddle.matmul(q, k, transpose_y=True) * (self.head_dim**-0.5) + bias
        out = paddle.matmul(F.softmax(scores, axis=-1), v)  # [heads, N, D]
        return self.proj(out.transpose([1, 0, 2]).reshape([n, -1]))


class VisionBlock(nn.Layer):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, bias):
        x = x + self.attn(self.norm1(x), cos, sin, bias)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Layer):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = Linear(config.in_channels * config.patch_size**2, config.hidden_size, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.proj(x.astype(self.proj.weight.dtype))


class VisionTransformer(nn.Layer):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rope = VisionRope(config)
        self.blocks = nn.LayerList([VisionBlock(config) for _ in range(config.depth)])
        self.ln = nn.LayerNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(self, pixel_values: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        """[patches, C*p*p] -> [patches, hidden]."""
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        lengths = frame_lengths(grid_thw)
        if pixel_values.shape[0] != sum(lengths):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw describes {sum(lengths)}")
        cos, sin = self.rope(vision_positions(grid_thw, self.config.spatial_merge_size))
        seg = np.repeat(np.arange(len(lengths)), lengths)
        bias = paddle.to_tensor(np.where(seg[:, None] == seg[None, :], 0.0, -1e30).astype(np.float32))
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, bias)
        return self.ln(x)


class _ResamplerMLP(nn.Layer):
    """Linear, GELU, Linear, LayerNorm (the hub's `*_linear.0 / .2 / .3`)."""

    def __init__(self, in_dim: int, out_dim: int, eps: float):
        super().__init__()
        self.fc1 = Linear(in_dim, out_dim)
        self.fc2 = Linear(out_dim, out_dim)
        self.ln = nn.LayerNorm(out_dim, epsilon=eps)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.ln(self.fc2(F.gelu(self.fc1(x))))


class Resampler(nn.Layer):
    """2x2 patch blocks -> one token (spatial merge), then frame pairs -> one token (temporal
    merge: an image's single frame is paired with itself), projected to the text width."""

    def __init__(self, config: Ernie4_5_VLConfig):
        super().__init__()
        v = config.vision
        self.merge, self.temporal = v.spatial_merge_size, v.temporal_merge_size
        spatial = v.hidden_size * self.merge**2
        self.spatial_linear = _ResamplerMLP(spatial, spatial, v.rms_norm_eps)
        self.temporal_linear = _ResamplerMLP(spatial * self.temporal, spatial, v.rms_norm_eps)
        self.mlp = Linear(spatial, config.hidden_size)
        self.after_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        x = self.spatial_linear(x.reshape([-1, x.shape[-1] * self.merge**2]))
        first, second = _frame_pairs(np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3), self.merge)
        x = paddle.concat([paddle.gather(x, paddle.to_tensor(first)), paddle.gather(x, paddle.to_tensor(second))], -1)
        return self.after_norm(self.mlp(self.temporal_linear(x)))


def _frame_pairs(grid_thw: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Merged-token indices of the even and the odd frame of each frame pair (a single frame: itself)."""
    first, second, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        per_frame = h * w // merge**2
        odd_start = 1 if t > 1 else 0
        for even, odd in zip(range(0, t, 2), range(odd_start, t, 2)):
            first.append(np.arange(offset + even * per_frame, offset + (even + 1) * per_frame))
            second.append(np.arange(offset + odd * per_frame, offset + (odd + 1) * per_frame))
        offset += t * per_frame
    return np.concatenate(first), np.concatenate(second)
