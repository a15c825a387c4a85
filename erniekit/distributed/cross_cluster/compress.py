"""Flat-vector compression for the cross-cluster outer delta, with error feedback.

The outer delta of one rank (anchor - local parameters, flattened) is cut into rows of `row`
elements (the last one zero-padded) so the parameter-server row codecs (erniekit/distributed/ps/
compression.py: int8 with a float32 scale per row, top-k per row) apply unchanged. What a sync
loses to compression is kept in `residual` and added to the next delta (error feedback), so
nothing is dropped for good. Payloads are plain bytes: a 13-byte header (kind, n, row) and the
arrays' raw bytes, so `payload_nbytes` is exact and the planner can use it without encoding.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from erniekit.distributed.ps.compression import KINDS, decode, encode
from erniekit.errors import ErniekitError

ROW = 1024
_HEADER = struct.Struct("<BQI")  # kind code, n elements, row length
_CODE = {kind: i for i, kind in enumerate(KINDS)}


def topk_k(topk_ratio: float, row: int = ROW) -> int:
    """Entries kept per row by `topk` (the same rounding as the parameter-server compressor)."""
    if not 0 < topk_ratio <= 1:
        raise ErniekitError(f"cross-cluster topk ratio {topk_ratio}: use a value in (0, 1]")
    return max(1, math.ceil(topk_ratio * row))


def _index_dtype(row: int) -> type:
    """Column indices within a row: uint16 while they fit (ROW <= 65536), else int32."""
    return np.uint16 if row <= 1 << 16 else np.int32


def _check(kind: str, n: int, row: int) -> None:
    if kind not in KINDS:
        raise ErniekitError(f"cross-cluster compression {kind!r}: use one of {', '.join(KINDS)}")
    # n = 0: a rank with nothing to train (a pipeline stage no LoRA target reaches) still sends its
    # header at every sync, so its link stays in step with the other ranks' links
    if n < 0 or row < 1 or row >= 1 << 31:
        raise ErniekitError(f"cross-cluster payload of n={n}, row={row}: need n >= 0 and 1 <= row < 2^31")


def payload_nbytes(kind: str, n: int, topk_ratio: float, row: int = ROW) -> int:
    """Exact length of the bytes `FlatCompressor(kind, n, topk_ratio, row).encode` returns."""
    _check(kind, n, row)
    rows = math.ceil(n / row)
    if kind == "none":
        body = 4 * n
    elif kind == "int8":
        body = n + 4 * rows  # int8 values (padding not sent) + a float32 scale per row
    else:
        k = topk_k(topk_ratio, row)
        body = rows * k * (4 + np.dtype(_index_dtype(row)).itemsize)
    return _HEADER.size + body


class FlatCompressor:
    """One rank's encoder/decoder for n-element float32 vectors; it owns the error-feedback residual."""

    def __init__(self, kind: str, n: int, topk_ratio: float = 0.01, row: int = ROW):
        _check(kind, n, row)
        self.kind, self.n, self.row = kind, n, row
        self.rows = math.ceil(n / row)
        self.k = topk_k(topk_ratio, row) if kind == "topk" else row
        self.nbytes = payload_nbytes(kind, n, topk_ratio, row)
        self.residual = np.zeros(n, np.float32) if kind != "none" else None

    def _padded(self, vec: np.ndarray) -> np.ndarray:
        out = np.zeros(self.rows * self.row, np.float32)
        out[: self.n] = vec
        return out.reshape(self.rows, self.row)

    def encode(self, vec: np.ndarray) -> bytes:
        """vec (+ the residual) -> payload bytes; the residual becomes what this payload leaves out."""
        vec = np.asarray(vec, dtype=np.float32).reshape(-1)
        if vec.size != self.n:
            raise ErniekitError(f"cross-cluster compressor: vector has {vec.size} elements, built for {self.n}")
        if not np.isfinite(vec).all():
            raise ErniekitError(
                "cross-cluster sync: the outer delta has non-finite values (training diverged); "
                "lower learning_rate or resume from the last checkpoint"
            )
        header = _HEADER.pack(_CODE[self.kind], self.n, self.row)
        if self.kind == "none":
            return header + vec.tobytes()
        g = vec + self.residual
        parts = encode(self.kind, self._padded(g), self.k)
        if self.kind == "int8":
            q, scale = parts
            body = q.reshape(-1)[: self.n].tobytes() + scale.astype(np.float32).tobytes()
        else:
            vals, idx = parts
            body = vals.astype(np.float32).tobytes() + idx.astype(_index_dtype(self.row)).tobytes()
        payload = header + body
        self.residual = g - self.decode(payload)
        return payload

    def decode(self, payload: bytes) -> np.ndarray:
        """Payload bytes (from any cluster running the same layout) -> the n-element float32 vector."""
        if len(payload) != self.nbytes:
            raise ErniekitError(
                f"cross-cluster payload has {len(payload)} bytes, expected {self.nbytes} for "
                f"{self.kind} of {self.n} elements: every cluster must run the same layout and cross_cluster_compress"
            )
        code, n, row = _HEADER.unpack_from(payload)
        if (code, n, row) != (_CODE[self.kind], self.n, self.row):
            got = KINDS[code] if code < len(KINDS) else code
            raise ErniekitError(
                f"cross-cluster payload is {got} of n={n}, row={row}; this rank expects {self.kind} of "
                f"n={self.n}, row={self.row}: every cluster must run the same layout and cross_cluster_compress"
            )
        body = memoryview(payload)[_HEADER.size :]
        if self.kind == "none":
            parts = [np.frombuffer(body, np.float32).reshape(1, self.n)]
        elif self.kind == "int8":
            q = np.zeros(self.rows * self.row, np.int8)
            q[: self.n] = np.frombuffer(body, np.int8, count=self.n)
            scale = np.frombuffer(body, np.float32, count=self.rows, offset=self.n)
            parts = [q.reshape(self.rows, self.row), scale]
        else:
            count = self.rows * self.k
            vals = np.frombuffer(body, np.float32, count=count).reshape(self.rows, self.k)
            idx = np.frombuffer(body, _index_dtype(self.row), count=count, offset=4 * count)
            if count and (int(idx.max()) >= self.row or int(idx.min()) < 0):
                raise ErniekitError(
                    f"cross-cluster topk payload has a column index outside 0..{self.row - 1}: a broken or "
                    "different-version peer; use the same erniekit on every cluster"
                )
            parts = [vals, idx.reshape(self.rows, self.k).astype(np.int64)]
        out = decode(self.kind, parts, self.rows, self.row).reshape(-1)[: self.n].copy()
        if not np.isfinite(out).all():  # our own encode refuses them, so only a broken peer sends them
            raise ErniekitError(
                "cross-cluster payload decodes to non-finite values (another cluster diverged or is broken); "
                "resume every cluster from the last checkpoint"
            )
        return out

    def state_dict(self) -> dict:
        """The residual (checkpointed with the anchor so a resumed run loses nothing it owed)."""
        return {"kind": self.kind, "n": self.n, "residual": None if self.residual is None else self.residual.copy()}

    def load_state_dict(self, state: dict) -> None:
        if (state["kind"], state["n"]) != (self.kind, self.n):
            raise ErniekitError(
                f"cross-cluster checkpoint has a {state['kind']} residual of {state['n']} elements; this run "
                f"compresses {self.kind} over {self.n}: resume with the same layout and cross_cluster_compress"
            )
        res = state["residual"]
        self.residual = None if res is None else np.asarray(res, np.float32).reshape(self.n).copy()
