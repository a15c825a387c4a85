"""Token-level MoE routing statistics on numpy arrays: expert load, imbalance, router entropy,
per-modality expert usage, and an accumulator that adds them up over many batches.

Shapes: T tokens (a batch flattened, padding included), k experts per token, E experts,
M modalities. Every function takes an optional boolean `valid` mask [T] (any shape that
flattens to T, e.g. `segment_ids > 0` of a [B, S] batch) so padding can be left out.
Expert ids may be global across modalities (modality-isolated routing): usage is then simply
zero outside a modality's own experts.

Nothing here imports paddle; `read_routing` only calls `.numpy()` on the tensors the MoE
blocks keep from their last forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


# ---- per-batch functions ----------------------------------------------------------------------
def _valid_rows(valid: Any, n: int) -> np.ndarray | None:
    """The mask as a flat bool array of length n (None = every row counts)."""
    if valid is None:
        return None
    v = np.asarray(valid.numpy() if hasattr(valid, "numpy") else valid).reshape(-1).astype(bool)
    if v.shape[0] != n:
        raise ValueError(f"valid mask has {v.shape[0]} entries but the routing covers {n} tokens")
    return v


def _select(a: np.ndarray, valid: Any) -> np.ndarray:
    v = _valid_rows(valid, a.shape[0])
    return a if v is None else a[v]


def expert_counts(topk_idx: np.ndarray, num_experts: int, valid: Any = None) -> np.ndarray:
    """count_e = number of (token, slot) assignments to expert e over valid tokens; int64 [E]."""
    idx = _select(np.asarray(topk_idx), valid).reshape(-1).astype(np.int64)
    return np.bincount(idx, minlength=num_experts).astype(np.int64)


def expert_load(topk_idx: np.ndarray, num_experts: int, valid: Any = None) -> np.ndarray:
    """load_e = count_e / sum_e' count_e': the fraction of assignments each expert received
    (sums to 1; all zeros when there is no valid token). float64 [E]."""
    c = expert_counts(topk_idx, num_experts, valid).astype(np.float64)
    total = c.sum()
    return c / total if total > 0 else c


def load_imbalance(load: np.ndarray) -> float:
    """max_e load_e / mean_e load_e: 1.0 when perfectly balanced, E when one expert takes all.
    NaN for an all-zero load (nothing routed)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean() if load.size else 0.0
    return float(load.max() / mean) if mean > 0 else math.nan


def load_cv(load: np.ndarray) -> float:
    """Coefficient of variation std_e(load) / mean_e(load) (population std): 0 when balanced,
    sqrt(E - 1) when one expert takes all. NaN for an all-zero load."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean() if load.size else 0.0
    return float(load.std() / mean) if mean > 0 else math.nan


def token_entropy(probs: np.ndarray) -> np.ndarray:
    """H_t = -sum_e p_te log p_te in nats (0 log 0 = 0), one value per token; float64 [T]."""
    p = np.asarray(probs, dtype=np.float64)
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=-1)


def routing_entropy(probs: np.ndarray, valid: Any = None, normalized: bool = False) -> float:
    """mean_t H_t over valid tokens (nats), with H_t = -sum_e p_te log p_te of the router softmax.
    normalized=True divides by log E, so 1.0 = uniform router, 0.0 = one-hot. NaN for no token."""
    h = token_entropy(_select(np.asarray(probs), valid))
    if h.size == 0:
        return math.nan
    mean = float(h.mean())
    if not normalized:
        return mean
    e = np.asarray(probs).shape[-1]
    return mean / math.log(e) if e > 1 else 0.0


def modality_counts(
    topk_idx: np.ndarray, modality: np.ndarray | None, num_experts: int, num_modalities: int, valid: Any = None
) -> np.ndarray:
    """count_me = assignments of modality-m tokens to expert e; int64 [M, E]. modality None = all 0."""
    idx = np.asarray(topk_idx).astype(np.int64)
    if idx.ndim == 1:
        idx = idx[:, None]
    mod = np.zeros(idx.shape[0], np.int64) if modality is None else np.asarray(modality).reshape(-1).astype(np.int64)
    if mod.shape[0] != idx.shape[0]:
        raise ValueError(f"modality has {mod.shape[0]} entries but topk_idx has {idx.shape[0]} tokens")
    v = _valid_rows(valid, idx.shape[0])
    if v is not None:
        idx, mod = idx[v], mod[v]
    if mod.size and (mod.min() < 0 or mod.max() >= num_modalities):
        raise ValueError(f"modality ids must lie in [0, {num_modalities}); got {mod.min()}..{mod.max()}")
    cell = (mod[:, None] * num_experts + idx).reshape(-1)
    return np.bincount(cell, minlength=num_modalities * num_experts).reshape(num_modalities, num_experts)


def _row_normalize(counts: np.ndarray) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=-1, keepdims=True)
    return np.divide(c, total, out=np.zeros_like(c), where=total > 0)


def modality_usage(
    topk_idx: np.ndarray, modality: np.ndarray | None, num_experts: int, num_modalities: int, valid: Any = None
) -> np.ndarray:
    """usage_me = count_me / sum_e' count_me': where each modality's assignments go. Rows sum to 1
    (all zeros for a modality with no valid token). float64 [M, E]."""
    return _row_normalize(modality_counts(topk_idx, modality, num_experts, num_modalities, valid))


# ---- reading a model ---------------------------------------------------------------------------
@dataclass
class LayerRouting:
    """The routing of one MoE layer in the last forward, as numpy arrays."""

    layer: int  # decoder layer index
    num_experts: int
    topk_idx: np.ndarray  # [T, k] int64
    probs: np.ndarray | None  # [T, E] float32, None when the block does not keep them
    modality: np.ndarray | None  # [T] int64, None = text only


def _np(t: Any) -> np.ndarray | None:
    return None if t is None else np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def moe_blocks(model: Any) -> list[tuple[int, Any]]:
    """(decoder layer index, MoE block) pairs in layer order; empty for a dense model."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    # getattr: a pipeline stage holds placeholders (no mlp) for the other stages' layers
    return [(i, l.mlp) for i, l in enumerate(layers) if hasattr(getattr(l, "mlp", None), "last_topk_idx")]


def read_routing(blocks: Sequence[tuple[int, Any]]) -> list[LayerRouting]:
    """Copy each block's last routing to host memory; blocks that have not run are skipped."""
    out = []
    for layer, b in blocks:
        if getattr(b, "last_topk_idx", None) is None:
            continue
        out.append(
            LayerRouting(
                layer,
                int(b.num_experts),
                _np(b.last_topk_idx),
                _np(getattr(b, "last_probs", None)),
                _np(getattr(b, "last_modality", None)),
            )
        )
    return out


# ---- accumulation ------------------------------------------------------------------------------
def _grow(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`a` zero-padded at the end of every axis to at least `shape`."""
    target = tuple(max(s, t) for s, t in zip(a.shape, shape))
    if target == a.shape:
        return a
    out = np.zeros(target, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


class RoutingAccumulator:
    """Counts per (layer, modality, expert) and entropy sums per (layer, modality) over many batches.

    Memory is O(L * M * E) whatever the number of batches: per-token arrays are reduced to
    counts inside each `add` and never kept. E and M grow when a batch brings a larger expert
    or modality id.

    modality_experts (optional): for each modality, the experts it may route to (modality-
    isolated routing with global ids); its per-modality imbalance is then taken over those only.
    """

    def __init__(self, modality_experts: Sequence[Sequence[int]] | None = None):
        self.modality_experts = [list(e) for e in modality_experts] if modality_experts else None
        self.reset()

    def reset(self) -> None:
        """Forget everything (start a new window)."""
        self.layer_ids: list[int] = []
        self._row: dict[int, int] = {}
        self.counts = np.zeros((0, 1, 1), np.int64)  # [L, M, E] assignments
        self.entropy_sum = np.zeros((0, 1), np.float64)  # [L, M] sum of H_t over tokens
        self.entropy_tokens = np.zeros((0, 1), np.int64)  # [L, M] tokens in entropy_sum
        self.log_e = np.zeros(0, np.float64)  # [L] log of the router's width, for normalising
        self.batches = 0

    # -- adding --------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.counts.shape[2]

    @property
    def num_modalities(self) -> int:
        return self.counts.shape[1]

    @property
    def empty(self) -> bool:
        return not self.layer_ids or int(self.counts.sum()) == 0

    def _layer_row(self, layer: int) -> int:
        if layer not in self._row:
            self._row[layer] = len(self.layer_ids)
            self.layer_ids.append(layer)
            L = len(self.layer_ids)
            self.counts = _grow(self.counts, (L, 1, 1))
            self.entropy_sum = _grow(self.entropy_sum, (L, 1))
            self.entropy_tokens = _grow(self.entropy_tokens, (L, 1))
            self.log_e = _grow(self.log_e, (L,))
        return self._row[layer]

    def add(
        self,
        layer: int,
        topk_idx: np.ndarray,
        probs: np.ndarray | None = None,
        modality: np.ndarray | None = None,
        valid: Any = None,
        num_experts: int = 0,
    ) -> None:
        """Add one layer's routing of one batch (arrays as in the module doc)."""
        topk_idx = np.asarray(topk_idx).astype(np.int64)
        if topk_idx.ndim == 1:
            topk_idx = topk_idx[:, None]
        T = topk_idx.shape[0]
        v = _valid_rows(valid, T)
        mod = np.zeros(T, np.int64) if modality is None else np.asarray(modality).reshape(-1).astype(np.int64)
        if v is not None:
            topk_idx, mod = topk_idx[v], mod[v]
            probs = None if probs is None else np.asarray(probs)[v]
        E = max(
            num_experts,
            int(topk_idx.max()) + 1 if topk_idx.size else 0,
            0 if probs is None else np.asarray(probs).shape[-1],
            self.num_experts,
        )
        M = max(int(mod.max()) + 1 if mod.size else 1, self.num_modalities)
        r = self._layer_row(layer)
        self.counts = _grow(self.counts, (len(self.layer_ids), M, E))
        self.entropy_sum = _grow(self.entropy_sum, (len(self.layer_ids), M))
        self.entropy_tokens = _grow(self.entropy_tokens, (len(self.layer_ids), M))
        self.counts[r] += modality_counts(topk_idx, mod, E, M)
        if probs is not None:
            self.entropy_sum[r] += np.bincount(mod, weights=token_entropy(probs), minlength=M)
            self.entropy_tokens[r] += np.bincount(mod, minlength=M)
            width = np.asarray(probs).shape[-1]
            self.log_e[r] = math.log(width) if width > 1 else 0.0

    def add_routing(self, routing: Sequence[LayerRouting], valid: Any = None) -> None:
        """Add every layer of one forward (from `read_routing`)."""
        for lr in routing:
            self.add(lr.layer, lr.topk_idx, lr.probs, lr.modality, valid, lr.num_experts)
        if routing:
            self.batches += 1

    def update(self, model: Any, valid: Any = None) -> None:
        """Add the routing of the model's last forward; `valid` masks padding ([B, S] or [T])."""
        self.add_routing(read_routing(moe_blocks(model)), valid)

    # -- reading -------------------------------------------------------------------------------
    def load_matrix(self) -> np.ndarray:
        """load[l, e]: fraction of layer l's assignments that went to expert e; [L, E], rows sum to 1."""
        return _row_normalize(self.counts.sum(axis=1))

    def modality_matrix(self, layer: int | None = None) -> np.ndarray:
        """usage[m, e]: fraction of modality m's assignments that went to expert e, pooled over
        layers (layer=None) or for one decoder layer index; [M, E], rows sum to 1."""
        c = self.counts.sum(axis=0) if layer is None else self.counts[self._row[layer]]
        return _row_normalize(c)

    def modality_load_matrix(self, m: int) -> tuple[np.ndarray, list[int]]:
        """load[l, e] of modality m's assignments over the experts it may use (its own group under
        modality-isolated routing, else all), rows sum to 1; and those experts' global ids."""
        experts = (
            self.modality_experts[m]
            if self.modality_experts and m < len(self.modality_experts)
            else list(range(self.num_experts))
        )
        return _row_normalize(self.counts[:, m][:, experts]), list(experts)

    def entropy(self) -> np.ndarray:
        """Mean router entropy (nats) per layer; NaN where no probabilities were seen. [L]"""
        tok = self.entropy_tokens.sum(axis=1)
        return np.divide(self.entropy_sum.sum(axis=1), tok, out=np.full(tok.shape, np.nan), where=tok > 0)

    def normalized_entropy(self) -> np.ndarray:
        """entropy / log E per layer (1 = uniform router). [L]"""
        return np.divide(self.entropy(), self.log_e, out=np.zeros(self.log_e.shape), where=self.log_e > 0)

    def layer_table(self) -> list[dict[str, float]]:
        """One dict per layer: entropy, entropy_norm, load_imbalance, load_cv, top_expert(_share)."""
        load, ent, ent_n = self.load_matrix(), self.entropy(), self.normalized_entropy()
        rows = []
        for r, layer in enumerate(self.layer_ids):
            top = int(np.argmax(load[r]))
            rows.append(
                {
                    "layer": layer,
                    "entropy": float(ent[r]),
                    "entropy_norm": float(ent_n[r]),
                    "load_imbalance": load_imbalance(load[r]),
                    "load_cv": load_cv(load[r]),
                    "top_expert": top,
                    "top_expert_share": float(load[r, top]),
                    "assignments": int(self.counts[r].sum()),
                }
            )
        return rows

    def _modality_load(self, m: int, counts_me: np.ndarray) -> np.ndarray:
        """Modality m's load over the experts it may use (all experts unless modality_experts)."""
        if self.modality_experts and m < len(self.modality_experts):
            counts_me = counts_me[..., self.modality_experts[m]]
        return _row_normalize(counts_me)

    def scalars(self, prefix: str = "routing/") -> dict[str, float]:
        """Scalars for logging (empty when nothing was accumulated); see docs/routing.md:
        per layer `layerNN/{entropy,entropy_norm,load_imbalance,load_cv}`, their mean over layers,
        `load_imbalance_max` (worst layer), and `modalityM/{entropy,load_imbalance,load_cv}` when
        more than one modality was seen."""
        if self.empty:
            return {}
        out: dict[str, float] = {}
        rows = self.layer_table()
        keys = ("entropy", "entropy_norm", "load_imbalance", "load_cv")
        for row in rows:
            for k in keys:
                if math.isfinite(row[k]):
                    out[f"{prefix}layer{row['layer']:02d}/{k}"] = row[k]
        for k in keys:
            vals = [row[k] for row in rows if math.isfinite(row[k])]
            if vals:
                out[f"{prefix}{k}"] = float(np.mean(vals))
        imb = [row["load_imbalance"] for row in rows if math.isfinite(row["load_imbalance"])]
        if imb:
            out[f"{prefix}load_imbalance_max"] = float(max(imb))
        if self.num_modalities > 1:
            out.update(self._modality_scalars(prefix))
        return out

    def _modality_scalars(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in range(self.num_modalities):
            tok = self.entropy_tokens[:, m].sum()
            if tok > 0:
                out[f"{prefix}modality{m}/entropy"] = float(self.entropy_sum[:, m].sum() / tok)
            used = self.counts[:, m].sum(axis=1) > 0  # layers where modality m had tokens
            if not used.any():
                continue
            loads = self._modality_load(m, self.counts[used, m])  # [L_m, E_m]
            out[f"{prefix}modality{m}/load_imbalance"] = float(np.mean([load_imbalance(l) for l in loads]))
            out[f"{prefix}modality{m}/load_cv"] = float(np.mean([load_cv(l) for l in loads]))
        return out
