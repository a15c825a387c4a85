"""Compressed row gradients on the worker -> server links (Nebula-I style), with error feedback.

A worker pushes the gradient of the embedding rows its batch touched. `int8` sends each row as
int8 with one float32 scale (max |g| / 127): ~1/4 of the bytes. `topk` sends the k largest
entries of each row by magnitude with their column indices (k = ceil(ratio x hidden)). What a
row loses to compression is kept in a residual and added to that row's next gradient (error
feedback), so nothing is dropped for good: the sum of what the server receives tracks the sum
of the true gradients up to the current residual (tested).
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("none", "int8", "topk")


class RowCompressor:
    """One worker's encoder for its pushes (it owns the residual of every vocabulary row)."""

    def __init__(self, kind: str, vocab: int, hidden: int, topk_ratio: float = 0.1):
        if kind not in KINDS:
            raise ValueError(f"compression {kind!r}: use one of {', '.join(KINDS)}")
        self.kind, self.hidden = kind, hidden
        self.k = max(1, math.ceil(topk_ratio * hidden))
        self.residual = np.zeros((vocab, hidden), np.float32) if kind != "none" else None

    def encode(self, ids: np.ndarray, grad: np.ndarray) -> list[np.ndarray]:
        """Rows `ids` (global vocabulary ids) with gradients grad [n, hidden] -> the arrays to send."""
        if self.kind == "none":
            return [grad.astype(np.float32)]
        g = grad.astype(np.float32) + self.residual[ids]
        payload = encode(self.kind, g, self.k)
        self.residual[ids] = g - decode(self.kind, payload, len(ids), self.hidden)
        return payload


def encode(kind: str, g: np.ndarray, k: int) -> list[np.ndarray]:
    if kind == "int8":
        scale = np.abs(g).max(axis=1) / 127.0
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint(g / safe[:, None]), -127, 127).astype(np.int8)
        return [q, scale.astype(np.float32)]
    if kind == "topk":
        idx = np.argpartition(-np.abs(g), k - 1, axis=1)[:, :k].astype(np.int64)
        return [np.take_along_axis(g, idx, axis=1).astype(np.float32), idx]
    return [g.astype(np.float32)]


def decode(kind: str, payload: list[np.ndarray], n: int, hidden: int) -> np.ndarray:
    if kind == "int8":
        q, scale = payload
        return q.astype(np.float32) * scale[:, None]
    if kind == "topk":
        vals, idx = payload
        out = np.zeros((n, hidden), np.float32)
        np.put_along_axis(out, idx, vals, axis=1)
        return out
    return payload[0]


def payload_spec(kind: str, n: int, hidden: int, k: int) -> list[tuple[list[int], str]]:
    """Shapes and dtypes of the arrays `encode` sends for n rows (the receiver's buffers)."""
    if kind == "int8":
        return [([n, hidden], "int8"), ([n], "float32")]
    if kind == "topk":
        return [([n, k], "float32"), ([n, k], "int64")]
    return [([n, hidden], "float32")]
