"""ERNIE 4.5 mixture-of-experts block: top-k softmax router, stacked experts, shared experts.

Dispatch is vectorised over tokens: token->expert assignments are sorted by expert, each
expert's contiguous group goes through its GEMMs, and results are weighted and scattered back
with one index_add. The only Python loop is over experts (a grouped GEMM, see StackedExperts).

Router losses (formulas in docs/moe.md), each weighted by its coefficient in the model config:
Switch load balancing (`router_aux_loss_coef`), z-loss (`router_z_loss_coef`) and ERNIE 4.5's
orthogonal loss on the router vectors (`router_orthogonal_loss_coef`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

_MASKED = -1e9  # logit of an expert outside the active (elastic) subset: softmax gives ~1e-28


@dataclass
class RouterOutput:
    logits: paddle.Tensor  # [T, E] float32 (masked experts at -1e9)
    probs: paddle.Tensor  # [T, E] float32 softmax
    topk_idx: paddle.Tensor  # [T, k] int64
    topk_weight: paddle.Tensor  # [T, k] float32, renormalised


class TopKRouter(nn.Layer):
    """Softmax gate in float32; experts picked by probs + e_score_correction_bias (aux-loss-free
    balancing of ERNIE 4.5), weights taken from the unbiased probs and renormalised with
    `moe_norm_min` as the floor of the denominator.

    `active_experts` / `active_k` (set by elastic training) restrict routing to the first n
    experts and change top-k without changing any parameter shape, so a sub-model is a prefix.
    """

    def __init__(self, hidden_size: int, num_experts: int, k: int, norm_min: float):
        super().__init__()
        self.k, self.norm_min, self.num_experts = k, norm_min, num_experts
        self.active_experts: int | None = None
        self.active_k: int | None = None
        self.weight = self.create_parameter([hidden_size, num_experts], dtype="float32")
        self.e_score_correction_bias = self.create_parameter(
            [1, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )
        self.e_score_correction_bias.stop_gradient = True

    @property
    def n_active(self) -> int:
        return self.active_experts or self.num_experts

    def forward(self, x: paddle.Tensor) -> RouterOutput:
        logits = paddle.matmul(x.astype("float32"), self.weight)
        n, k = self.n_active, self.active_k or self.k
        if n < self.num_experts:
            mask = paddle.to_tensor([0.0] * n + [_MASKED] * (self.num_experts - n), dtype="float32")
            logits = logits + mask
        probs = F.softmax(logits, axis=-1)
        score = probs + self.e_score_correction_bias
        if n < self.num_experts:
            score = score + mask
        _, idx = paddle.topk(score, k, axis=-1)
        w = paddle.take_along_axis(probs, idx, axis=-1)
        w = w / paddle.clip(w.sum(axis=-1, keepdim=True), min=self.norm_min)
        return RouterOutput(logits, probs, idx, w)


@dataclass
class Dispatch:
    """Kept assignments sorted by expert: row i of the grouped input is token `token[i]`."""

    token: paddle.Tensor  # [A] int64
    weight: paddle.Tensor  # [A] float32 gate weight of each assignment
    counts: list[int]  # assignments per expert (length E)


def dispatch(topk_idx: paddle.Tensor, topk_weight: paddle.Tensor, num_experts: int,
             keep: paddle.Tensor | None = None) -> Dispatch:
    """Sort (token, expert) assignments by expert, dropping those with keep == False."""
    T, k = topk_idx.shape
    flat_e = topk_idx.reshape([-1])
    flat_w = topk_weight.reshape([-1])
    token = paddle.arange(T * k, dtype="int64") // k
    if keep is not None:
        kept = paddle.nonzero(keep.reshape([-1])).reshape([-1])
        flat_e, flat_w, token = paddle.gather(flat_e, kept), paddle.gather(flat_w, kept), paddle.gather(token, kept)
    order = paddle.argsort(flat_e, stable=True)
    counts = paddle.bincount(flat_e, minlength=num_experts).tolist()
    return Dispatch(paddle.gather(token, order), paddle.gather(flat_w, order), counts)


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert may take: ceil(factor * T * k / E) (at least 1)."""
    return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


def capacity_keep(topk_idx: paddle.Tensor, num_experts: int, capacity: int) -> paddle.Tensor:
    """[T, k] bool: which assignments fit their expert's capacity.

    Priority is by routing slot first (every token's 1st choice before any 2nd choice), then by
    token order, as in GShard/Switch: an overflowing expert drops the least important assignments.
    """
    T, k = topk_idx.shape
    slot_major = topk_idx.transpose([1, 0]).reshape([-1])  # assignment a = s*T + t
    order = paddle.argsort(slot_major, stable=True)
    counts = paddle.bincount(slot_major, minlength=num_experts)
    starts = paddle.cumsum(counts) - counts
    rank_sorted = paddle.arange(T * k, dtype="int64") - paddle.gather(starts, paddle.gather(slot_major, order))
    rank = paddle.scatter(paddle.zeros([T * k], dtype="int64"), order, rank_sorted)
    return (rank < capacity).reshape([k, T]).transpose([1, 0])


class StackedExperts(nn.Layer):
    """E SwiGLU experts stored as [E, in, out] tensors (Paddle's Linear orientation).

    `fp8_block` > 0 runs every expert GEMM (forward and backward) in block-scaled FP8
    (erniekit/nn/fp8.py); 0 keeps the parameter dtype.
    """

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fp8_block: int = 0):
        super().__init__()
        self.num_experts = num_experts
        self.fp8_block = fp8_block
        self.gate_proj = self.create_parameter([num_experts, hidden_size, intermediate_size])
        self.up_proj = self.create_parameter([num_experts, hidden_size, intermediate_size])
        self.down_proj = self.create_parameter([num_experts, intermediate_size, hidden_size])

    def matmul(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """The base GEMM of one expert projection: FP8 block-scaled or plain."""
        if self.fp8_block:
            from erniekit.nn.fp8 import fp8_matmul

            return fp8_matmul(x, w, block=self.fp8_block)
        return paddle.matmul(x, w)

    def prepare(self) -> Callable[[str, paddle.Tensor, int], paddle.Tensor]:
        """Per-forward setup; returns proj(name, h, expert) -> h @ W_name[expert]."""
        W = {p: paddle.unbind(getattr(self, p)) for p in self.PROJS}
        return lambda p, h, e: self.matmul(h, W[p][e])

    def forward(self, x: paddle.Tensor, topk_idx: paddle.Tensor, topk_weight: paddle.Tensor,
                keep: paddle.Tensor | None = None) -> paddle.Tensor:
        """x [T, H]; returns sum_k weight_k * expert_{idx_k}(x) as [T, H] (dropped assignments add 0).

        Assignments are sorted by expert and split into one contiguous group per expert, so each
        expert runs one GEMM over exactly its tokens (a grouped GEMM). Padding every group to the
        largest one and using one bmm was measured 2.5-4x slower on real data: repeated tokens
        (chat-template words) all route alike, so groups are very unequal.
        """
        d = dispatch(topk_idx, topk_weight, self.num_experts, keep)
        out = paddle.zeros_like(x)
        if not d.token.shape[0]:
            return out
        groups = paddle.split(paddle.gather(x, d.token), [c for c in d.counts if c > 0], axis=0)
        used = [e for e, c in enumerate(d.counts) if c > 0]
        proj = self.prepare()
        outs = [proj("down_proj", F.silu(proj("gate_proj", g, e)) * proj("up_proj", g, e), e) for g, e in zip(groups, used)]
        y = paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
        return paddle.index_add(out, d.token, 0, y * d.weight.astype(x.dtype).unsqueeze(-1))


# ---- router losses ---------------------------------------------------------------------------
def load_balancing_loss(probs: paddle.Tensor, topk_idx: paddle.Tensor, num_experts: int) -> paddle.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e f_e * P_e, where f_e is the fraction of
    assignments routed to expert e and P_e the mean router probability of e (1.0 when uniform)."""
    k = topk_idx.shape[1]
    f = paddle.bincount(topk_idx.reshape([-1]), minlength=probs.shape[1]).astype("float32") / (topk_idx.shape[0] * k)
    return num_experts * paddle.sum(f * probs.mean(axis=0))


def router_z_loss(logits: paddle.Tensor) -> paddle.Tensor:
    """ST-MoE z-loss: mean_t (log sum_e exp(logit_te))^2, keeps router logits small."""
    z = paddle.logsumexp(logits, axis=-1)
    return (z * z).mean()


def router_orthogonal_loss(weight: paddle.Tensor, num_active: int | None = None) -> paddle.Tensor:
    """ERNIE 4.5 router orthogonal loss: mean((W_n^T W_n - I)^2) over the E x E Gram matrix of the
    unit-normalised router vectors (columns of weight [H, E]); 0 when they are orthonormal."""
    w = weight if num_active is None else weight[:, :num_active]
    w = w / paddle.clip(paddle.sqrt((w * w).sum(axis=0, keepdim=True)), min=1e-12)
    g = paddle.matmul(w, w, transpose_x=True) - paddle.eye(w.shape[1], dtype=w.dtype)
    return (g * g).mean()


class MoEBlock(nn.Layer):
    """Routed experts plus always-on shared experts (ERNIE 4.5 `Ernie4_5_MoeSparseMoeBlock`)."""

    def __init__(self, config, mlp_cls):
        super().__init__()
        c = config
        self.num_experts = c.moe_num_experts
        self.capacity_factor = c.moe_capacity_factor
        self.coefs = {"aux": c.router_aux_loss_coef, "z": c.router_z_loss_coef,
                      "orthogonal": c.router_orthogonal_loss_coef}
        self.gate = TopKRouter(c.hidden_size, c.moe_num_experts, c.moe_k, c.moe_norm_min)
        self.experts = StackedExperts(c.moe_num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = (
            mlp_cls(c, c.moe_intermediate_size * c.moe_num_shared_experts) if c.moe_num_shared_experts > 0 else None
        )
        self.router_loss: paddle.Tensor | None = None  # weighted sum of router losses (training only)
        self.loss_parts: dict[str, paddle.Tensor] = {}  # unweighted, detached, for logging
        # assignments per expert since the last correction-bias update (aux-loss-free balancing)
        self.register_buffer("load_counts", paddle.zeros([c.moe_num_experts], dtype="float32"), persistable=False)
        # routing of the last forward, for statistics and pictures (detached; overwritten each call)
        self.last_topk_idx: paddle.Tensor | None = None  # [T, k] int64
        self.last_probs: paddle.Tensor | None = None  # [T, E] float32 router softmax
        self.last_modality: paddle.Tensor | None = None  # [T] int64 modality id, None when text only
        self.last_dropped: float = 0.0  # fraction of assignments dropped by the capacity limit

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape([-1, shape[-1]])
        r = self.gate(x)
        keep = None
        if self.capacity_factor > 0:
            cap = expert_capacity(x.shape[0], r.topk_idx.shape[1], self.gate.n_active, self.capacity_factor)
            keep = capacity_keep(r.topk_idx, self.num_experts, cap)
            self.last_dropped = 1.0 - float(keep.astype("float32").mean())
        y = self.experts(x, r.topk_idx, r.topk_weight, keep)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        if self.training:
            self._router_losses(r)
        self.last_topk_idx = r.topk_idx.detach()
        self.last_probs = r.probs.detach()
        return y.reshape(shape)

    def _router_losses(self, r: RouterOutput) -> None:
        n = self.gate.n_active
        parts = {}
        if self.coefs["aux"]:
            parts["aux"] = load_balancing_loss(r.probs, r.topk_idx, n)
        if self.coefs["z"]:
            parts["z"] = router_z_loss(r.logits if n == self.num_experts else r.logits[:, :n])
        if self.coefs["orthogonal"]:
            parts["orthogonal"] = router_orthogonal_loss(self.gate.weight, n if n < self.num_experts else None)
        self.router_loss = paddle.add_n([self.coefs[k] * v for k, v in parts.items()]) if parts else None
        self.loss_parts = {k: v.detach() for k, v in parts.items()}
        with paddle.no_grad():
            self.load_counts += paddle.bincount(r.topk_idx.reshape([-1]), minlength=self.num_experts).astype("float32")

    @paddle.no_grad()
    def update_correction_bias(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3, carried by ERNIE 4.5 checkpoints as
        e_score_correction_bias): b_e += rate * sign(mean load - load_e) over the active experts,
        from the assignments counted since the last update."""
        n = self.gate.n_active
        counts = self.load_counts[:n]
        if float(counts.sum()) > 0:
            delta = rate * paddle.sign(counts.mean() - counts)
            if n < self.num_experts:
                delta = paddle.concat([delta, paddle.zeros([self.num_experts - n], dtype=delta.dtype)])
            bias = self.gate.e_score_correction_bias
            bias.set_value(bias + delta.unsqueeze(0))
        self.load_counts.zero_()
