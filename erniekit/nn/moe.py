"""ERNIE 4.5 mixture-of-experts block: top-k softmax router, stacked experts, shared experts.

Dispatch is vectorised over tokens: token->expert assignments are sorted by expert, each
expert's contiguous group goes through its GEMMs, and results are weighted and scattered back
with one index_add. The only Python loop is over experts (a grouped GEMM, see StackedExperts).

Router losses (formulas in docs/moe.md), each weighted by its coefficient in the model config:
Switch load balancing (`router_aux_loss_coef`), z-loss (`router_z_loss_coef`) and ERNIE 4.5's
orthogonal loss on the router vectors (`router_orthogonal_loss_coef`).

Modality-isolated routing (ERNIE-4.5-VL): with per-modality expert lists in the config, each
token is routed only among its modality's experts (MoEBlock; docs/moe.md).

Routing replay (RL, docs/rl.md): a block given a `RoutingReference` compares its own expert
choice with the recorded one and, when `force` is set, uses the recorded experts (gate weights
still come from the current router, so the router keeps its gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from erniekit.errors import DataError
from erniekit.nn import grouped_gemm
from erniekit.nn.fp8 import fp8_grouped_matmuls
from erniekit.nn.recompute import recomputing
from erniekit.nn.rows import concat_rows, split_rows
from erniekit.nn.swiglu import swiglu


class ExpertExchange(Protocol):
    """What an expert-parallel StackedExperts needs from the runtime (erniekit/distributed/collective/expert_exchange.py)."""

    rank: int  # this process's index among those splitting the experts: it holds slice `rank`
    size: int

    def run(self, fn, x, topk_idx, topk_weight, keep, params: dict) -> paddle.Tensor: ...

    def exchange_counts(self, counts: np.ndarray) -> np.ndarray: ...

    def all_to_all(self, x: paddle.Tensor, send: list[int], recv: list[int]) -> paddle.Tensor: ...


class ReplicatedExperts(Protocol):
    """What a StackedExperts replicated over several processes needs from the runtime
    (erniekit/distributed/collective/replicated_experts.py): run fn on local tensors, with the
    expert weights' gradients summed over the data ranks."""

    def run(self, fn, x, topk_idx, topk_weight, keep, params: dict) -> paddle.Tensor: ...


class TensorParallel(Protocol):
    """What a StackedExperts split over tensor-parallel ranks needs from the runtime
    (erniekit/distributed/collective/local_experts.py): gate/up split by output columns, down by
    input rows; `sum` adds a non-differentiable partial over the tp ranks (DoRA's column norms of
    the row-split down projection)."""

    def sum(self, t: paddle.Tensor) -> paddle.Tensor: ...


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
        self.last_own_idx: paddle.Tensor | None = None  # [T, k] the router's own choice in the last forward
        self.weight = self.create_parameter([hidden_size, num_experts], dtype="float32")
        self.e_score_correction_bias = self.create_parameter(
            [1, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )
        self.e_score_correction_bias.stop_gradient = True

    @property
    def n_active(self) -> int:
        return self.active_experts or self.num_experts

    def forward(self, x: paddle.Tensor, forced: RoutingReference | None = None) -> RouterOutput:
        """forced (local expert ids): masked tokens take the recorded experts instead of their own."""
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
        self.last_own_idx = idx
        if forced is not None and forced.force:
            if forced.topk_idx.shape != idx.shape:
                raise DataError(
                    f"routing replay: recorded experts have shape {forced.topk_idx.shape} but this forward "
                    f"routes {idx.shape}; replay needs the same tokens and top-k as the rollout"
                )
            idx = paddle.where(forced.mask.unsqueeze(-1), forced.topk_idx, idx)
        w = paddle.take_along_axis(probs, idx, axis=-1)
        w = w / paddle.clip(w.sum(axis=-1, keepdim=True), min=self.norm_min)
        return RouterOutput(logits, probs, idx, w)


@dataclass
class RoutingReference:
    """Experts recorded for each token (e.g. during an RL rollout) to compare with or replay."""

    topk_idx: paddle.Tensor  # [T, k] int64 global expert ids
    mask: paddle.Tensor  # [T] bool: tokens that have a recorded choice
    force: bool  # True: route masked tokens to the recorded experts (routing replay)


def routing_changed(own: paddle.Tensor, recorded: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
    """[T] bool: masked tokens whose set of top-k experts differs from the recorded set (order ignored)."""
    diff = (paddle.sort(own, axis=-1) != paddle.sort(recorded, axis=-1)).any(axis=-1)
    return paddle.logical_and(diff, mask)


@dataclass
class Dispatch:
    """Kept assignments sorted by expert: row i of the grouped input is token `token[i]`."""

    token: paddle.Tensor  # [A] int64
    weight: paddle.Tensor  # [A] float32 gate weight of each assignment
    counts: list[int]  # assignments per expert (length E)


def dispatch(
    topk_idx: paddle.Tensor, topk_weight: paddle.Tensor, num_experts: int, keep: paddle.Tensor | None = None
) -> Dispatch:
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

    Expert parallelism: with `expert_parallel` set (an `ExpertExchange`, injected by
    erniekit/distributed so that nn imports nothing from it), each process holds a contiguous
    slice of the experts and the tokens routed to them are moved there and back by all-to-all.
    """

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fp8_block: int = 0):
        super().__init__()
        self.num_experts = num_experts
        self.fp8_block = fp8_block
        self.fp8_grad_format = "e4m3"
        self.expert_offset = 0  # global id of expert 0 (modality-isolated routing: experts of earlier modalities)
        self.expert_parallel: "ExpertExchange | None" = None
        # multi-process without expert parallelism: the experts run on local tensors, their weight
        # gradients summed over the data ranks (erniekit/distributed/collective/replicated_experts.py)
        self.replicated: "ReplicatedExperts | None" = None
        self._local: dict[str, paddle.Tensor] = {}  # during an expert-parallel forward: this process's slices
        # tensor parallelism: the tp ranks that split every expert's width (set by the runtime)
        self.tensor_parallel: "TensorParallel | None" = None
        self.gate_proj = self.create_parameter([num_experts, hidden_size, intermediate_size])
        self.up_proj = self.create_parameter([num_experts, hidden_size, intermediate_size])
        self.down_proj = self.create_parameter([num_experts, intermediate_size, hidden_size])

    def param(self, name: str) -> paddle.Tensor:
        """An expert-indexed parameter ([E, ...]) as the GEMMs see it: this process's slice of the
        experts inside an expert-parallel forward, the whole parameter otherwise."""
        return self._local.get(name) if self._local else getattr(self, name)

    def base_matmul(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """One expert's plain GEMM (no FP8); LoRA overrides it for a base held in another dtype."""
        return paddle.matmul(x, w)

    def grouped(self, p: str, x: paddle.Tensor, sizes: list[int], used: list[int]) -> paddle.Tensor:
        """x [M, in] in expert-sorted groups (sizes) -> each group @ W_p[its expert], as [M, out].

        In FP8 all groups are quantised in one call (fp8_grouped_matmul); float32 on CPU takes one
        MKL batched GEMM (nn/grouped_gemm.py; without a gradient, a decode step's groups of a few
        rows take the kn kernel there); otherwise one GEMM per group.
        """
        return self.grouped_many((p,), x, sizes, used)[0]

    def grouped_many(
        self, ps: tuple[str, ...], x: paddle.Tensor, sizes: list[int], used: list[int]
    ) -> list[paddle.Tensor]:
        """`grouped` for projections sharing the input x (gate and up): in FP8, x is quantised once for all."""
        ws = [self.param(p) for p in ps]
        if self.fp8_block:
            return fp8_grouped_matmuls(x, ws, sizes, used, block=self.fp8_block, grad_format=self.fp8_grad_format)
        if grouped_gemm.usable(x, ws):  # float32 on CPU: what base_matmul computes, one MKL call for all
            return grouped_gemm.grouped_matmuls(x, ws, sizes, used)
        xs = split_rows(x, sizes)
        out = []
        for w in ws:
            W = paddle.unbind(w)
            out.append(concat_rows([self.base_matmul(g, W[e]) for g, e in zip(xs, used)]))
        return out

    def forward(
        self, x: paddle.Tensor, topk_idx: paddle.Tensor, topk_weight: paddle.Tensor, keep: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        """x [T, H]; returns sum_k weight_k * expert_{idx_k}(x) as [T, H] (dropped assignments add 0).

        Assignments are sorted by expert and split into one contiguous group per expert, so each
        expert runs one GEMM over exactly its tokens (a grouped GEMM). Padding every group to the
        largest one and using one bmm was measured 2.5-4x slower on real data: repeated tokens
        (chat-template words) all route alike, so groups are very unequal. The SwiGLU between the
        projections runs once over all groups.
        """
        if self.expert_parallel is not None:
            return self.expert_parallel.run(
                self._forward_expert_parallel, x, topk_idx, topk_weight, keep, self.expert_params()
            )
        if self.replicated is not None:
            return self.replicated.run(self._forward_replicated, x, topk_idx, topk_weight, keep, self.expert_params())
        if not paddle.in_dynamic_mode():
            return self._forward_every_expert(x, topk_idx, topk_weight, keep)
        return self._forward_grouped(x, topk_idx, topk_weight, keep)

    def _forward_grouped(
        self,
        x: paddle.Tensor,
        topk_idx: paddle.Tensor,
        topk_weight: paddle.Tensor,
        keep: paddle.Tensor | None,
        idle: dict[str, paddle.Tensor] | None = None,
    ) -> paddle.Tensor:
        """idle: weights that must join the graph even when no assignment is kept (weight 0)."""
        d = dispatch(topk_idx, topk_weight, self.num_experts, keep)
        out = paddle.zeros_like(x)
        if not d.token.shape[0]:
            sums = [p.sum() for p in (idle or {}).values() if not p.stop_gradient]
            return out + 0 * paddle.add_n(sums).astype(x.dtype) if sums else out
        y = self._swiglu(paddle.gather(x, d.token), d.counts)
        return paddle.index_add(out, d.token, 0, y * d.weight.astype(x.dtype).unsqueeze(-1))

    def _forward_replicated(
        self,
        x: paddle.Tensor,
        topk_idx: paddle.Tensor,
        topk_weight: paddle.Tensor,
        keep: paddle.Tensor | None,
        local: dict[str, paddle.Tensor],
    ) -> paddle.Tensor:
        """This process's tokens x [T, H] through the whole (replicated) experts as local tensors:
        a data-parallel rank's experts see only its own tokens; `replicated` sums the weight
        gradients over the data ranks. Every trainable expert tensor joins the graph (weight 0 if
        no token came; with any token the grouped GEMMs use every expert tensor whole), so every
        rank makes the same gradient all-reduces."""
        self._local = local
        try:
            return self._forward_grouped(x, topk_idx, topk_weight, keep, idle=local)
        finally:
            self._local = {}

    def _forward_every_expert(
        self, x: paddle.Tensor, topk_idx: paddle.Tensor, topk_weight: paddle.Tensor, keep: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        """Every expert on every token, summed with the gate weights (0 off the top-k): the same
        result without data-dependent shapes, which a static graph (the `paddle` / `onnx` export,
        erniekit/export/static.py) cannot hold; E / k times the expert FLOPs."""
        w = topk_weight if keep is None else topk_weight * keep.astype(topk_weight.dtype)
        comb = paddle.sum(F.one_hot(topk_idx, self.num_experts) * w.unsqueeze(-1), axis=1)  # [T, E]
        xe = x.unsqueeze(0)  # [1, T, H] against [E, H, I]
        h = F.silu(paddle.matmul(xe, self.gate_proj)) * paddle.matmul(xe, self.up_proj)
        y = paddle.matmul(h, self.down_proj)  # [E, T, H]
        return paddle.sum(comb.astype(x.dtype).transpose([1, 0]).unsqueeze(-1) * y, axis=0)

    def _swiglu(self, xs: paddle.Tensor, counts: list[int]) -> paddle.Tensor:
        """Rows sorted into consecutive groups of counts[e] rows for expert e -> the experts' outputs."""
        sizes = [c for c in counts if c > 0]
        used = [e for e, c in enumerate(counts) if c > 0]
        gate, up = self.grouped_many(("gate_proj", "up_proj"), xs, sizes, used)
        return self.grouped("down_proj", swiglu(gate, up), sizes, used)

    def expert_params(self) -> dict[str, paddle.Tensor]:
        """Parameters indexed by expert (leading dim E): split with the experts under expert parallelism."""
        return {
            n: p
            for n, p in self.named_parameters(include_sublayers=False)
            if p.ndim >= 2 and p.shape[0] == self.num_experts
        }

    def _forward_expert_parallel(
        self,
        x: paddle.Tensor,
        topk_idx: paddle.Tensor,
        topk_weight: paddle.Tensor,
        keep: paddle.Tensor | None,
        local: dict[str, paddle.Tensor],
    ) -> paddle.Tensor:
        """This process's tokens x [T, H] and its slice of the experts (`local`, experts
        [r*E/n, (r+1)*E/n) on exchange rank r of n): dispatch by all-to-all, the local experts' GEMMs,
        combine by the reverse all-to-all. Rows arrive grouped by source process, then by expert; they
        are reordered expert-major for the grouped GEMM and back before the return trip."""
        ex = self.expert_parallel
        n_local = self.num_experts // ex.size
        d = dispatch(topk_idx, topk_weight, self.num_experts, keep)
        to_send = np.asarray(d.counts, dtype="int64").reshape(ex.size, n_local)  # [destination, its expert]
        got = ex.exchange_counts(to_send)  # [source, my expert]: rows each source sends to each of my experts
        send, recv = to_send.sum(axis=1).tolist(), got.sum(axis=1).tolist()
        rows = ex.all_to_all(paddle.gather(x, d.token), send, recv)
        # collective backward: every rank's return trip and expert slice must be in its graph, also
        # when no token went out or came in (a slice without gradient would skip the optimizer's
        # all-reduces on one rank only); such parts join with weight 0
        idle = []
        self._local = local
        try:
            if rows.shape[0]:
                order = source_to_expert_order(got)
                y = self._swiglu(paddle.gather(rows, paddle.to_tensor(order)), got.sum(axis=0).tolist())
                rows = paddle.gather(y, paddle.to_tensor(np.argsort(order)))  # back to source-major order
            else:
                idle += [p.sum() for p in local.values() if not p.stop_gradient]
        finally:
            self._local = {}
        back = ex.all_to_all(rows, recv, send)
        out = paddle.zeros_like(x)
        if d.token.shape[0]:
            out = paddle.index_add(out, d.token, 0, back * d.weight.astype(x.dtype).unsqueeze(-1))
        else:
            idle.append(back.sum())
        return out + 0 * paddle.add_n(idle).astype(x.dtype) if idle else out


def source_to_expert_order(blocks: np.ndarray) -> np.ndarray:
    """blocks [S, E]: rows from source s for expert e, laid out source-major (s outer, e inner).
    Returns the int64 row indices that lay them out expert-major (e outer, s inner), keeping each
    block's own row order: expert e's rows from every source end up contiguous."""
    sizes = blocks.reshape(-1)
    starts = np.cumsum(sizes) - sizes  # block (s, e) starts at starts[s * E + e]
    em = np.ascontiguousarray(blocks.T).reshape(-1)  # block sizes in expert-major order
    em_starts = np.ascontiguousarray(starts.reshape(blocks.shape).T).reshape(-1)
    offsets = np.arange(int(em.sum()), dtype="int64") - np.repeat(np.cumsum(em) - em, em)
    return np.repeat(em_starts, em).astype("int64") + offsets


# ---- router losses ---------------------------------------------------------------------------
def settle_router_losses(layers) -> None:
    """The router losses of the layers whose last forward ran beside data ranks, from their counts
    summed over the ranks in one collective (every rank's layers ran the same forward)."""
    pending = [m for m in layers if m.pending_stats is not None]
    if not pending:
        return
    stats = [m.pending_stats[0] for m in pending]
    whole = pending[0].data_sum(paddle.concat(stats) if len(stats) > 1 else stats[0])
    start = 0
    for m, s in zip(pending, stats):
        m.finish_router_losses(whole[start : start + s.shape[0]])
        start += s.shape[0]


def router_loss_sum(layers) -> paddle.Tensor | None:
    """The weighted router losses of `layers`' last forward (training), summed; None without any."""
    settle_router_losses(layers)
    losses = [m.router_loss for m in layers if m.router_loss is not None]
    return paddle.add_n(losses) if losses else None


def load_balancing_loss(
    probs: paddle.Tensor, topk_idx: paddle.Tensor, num_experts: int, whole: tuple[paddle.Tensor, float] | None = None
) -> paddle.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e f_e * P_e, where f_e is the fraction of
    assignments routed to expert e and P_e the mean router probability of e (1.0 when uniform).
    whole: (assignments per expert, tokens) of the whole batch when data ranks split it; f_e and
    the token count are then the whole batch's, and this rank's term carries its tokens' share of
    P_e, so the terms (and their gradients) add up over the ranks to the loss of the whole batch."""
    k = topk_idx.shape[1]
    if whole is None:
        counts = paddle.bincount(topk_idx.reshape([-1]), minlength=probs.shape[1]).astype("float32")
        return num_experts * paddle.sum(counts / (topk_idx.shape[0] * k) * probs.mean(axis=0))
    counts, total = whole
    return num_experts * paddle.sum(counts / (total * k) * probs.sum(axis=0) / total)


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


def check_modality_ids(modality: paddle.Tensor, num_tokens: int, num_modalities: int) -> paddle.Tensor:
    """Flat int64 modality ids, checked with one min/max: an id outside [0, M) would silently skip
    its tokens' routed experts."""
    mod = modality.reshape([-1]).astype("int64")
    if mod.shape[0] != num_tokens:
        raise DataError(
            f"token_type_ids has {mod.shape[0]} entries for {num_tokens} tokens: give one modality id per input token"
        )
    if not num_tokens:
        return mod
    lo, hi = int(mod.min()), int(mod.max())
    if lo < 0 or hi >= num_modalities:
        raise DataError(
            f"token_type_ids holds modality id {lo if lo < 0 else hi} but the model has {num_modalities} "
            f"modalit{'y' if num_modalities == 1 else 'ies'} (ids 0..{num_modalities - 1}, one per entry of "
            "moe_num_experts): fix the data's token_type_ids or the model config"
        )
    return mod


class MoEBlock(nn.Layer):
    """Routed experts plus always-on shared experts (ERNIE 4.5 `Ernie4_5_MoeSparseMoeBlock`).

    Modality-isolated routing (ERNIE-4.5-VL; config lists, index = modality id, 0 = text): modality
    m has its own router and experts of its own intermediate size (`gate`/`experts` for text, so
    text-only checkpoints are unchanged; `gate_m`/`experts_m` for m >= 1). Tokens are split by
    modality id, each part routed among its own experts only, and the outputs gathered back in
    token order; the shared experts see every token. Expert ids in `last_topk_idx` and
    `load_counts` are global: modality m's experts are numbered after those of modalities < m.
    """

    def __init__(self, config, mlp_cls):
        super().__init__()
        c = config
        self.experts_per_modality = list(c.experts_per_modality)
        self.num_modalities = len(self.experts_per_modality)
        self.num_experts = c.total_experts
        self.offsets = [sum(self.experts_per_modality[:m]) for m in range(self.num_modalities)]
        self.capacity_factor = c.moe_capacity_factor
        self.coefs = {
            "aux": c.router_aux_loss_coef,
            "z": c.router_z_loss_coef,
            "orthogonal": c.router_orthogonal_loss_coef,
        }
        for m, (n, size) in enumerate(zip(self.experts_per_modality, c.expert_sizes)):
            suffix = f"_{m}" if m else ""
            setattr(self, "gate" + suffix, TopKRouter(c.hidden_size, n, c.moe_k, c.moe_norm_min))
            setattr(self, "experts" + suffix, StackedExperts(n, c.hidden_size, size))
            self.expert_set(m).expert_offset = self.offsets[m]
        self.shared_experts = (
            mlp_cls(c, c.expert_sizes[0] * c.moe_num_shared_experts) if c.moe_num_shared_experts > 0 else None
        )
        self.router_loss: paddle.Tensor | None = None  # weighted sum of router losses (training only)
        self.pending_stats: tuple | None = None  # beside data ranks: this forward's counts, until settled
        self.loss_parts: dict[str, paddle.Tensor] = {}  # unweighted, detached, for logging
        # assignments per (global) expert since the last correction-bias update (aux-loss-free balancing)
        self.register_buffer("load_counts", paddle.zeros([self.num_experts], dtype="float32"), persistable=False)
        # a pipeline stage beside data parallelism: sums over the data ranks that split each batch,
        # so router losses and load counts are the whole batch's (erniekit/distributed/collective/pipeline.py)
        self.data_sum = None
        self.data_ranks = 1
        # routing of the last forward, for statistics and pictures (detached; overwritten each call)
        self.last_topk_idx: paddle.Tensor | None = None  # [T, k] int64 global expert ids
        # [T, total experts] float32: each token's own modality's router softmax at its global expert
        # columns, 0 at every other modality's experts (rows sum to 1)
        self.last_probs: paddle.Tensor | None = None
        self.last_modality: paddle.Tensor | None = None  # [T] int64 modality id, None when text only
        self.last_dropped: float = 0.0  # fraction of assignments dropped by the capacity limit
        self.routing_reference: RoutingReference | None = None  # set around a forward by erniekit.routing.replay
        self.last_changed: tuple[int, int] | None = (
            None  # (tokens whose routing differs from the reference, tokens compared)
        )

    def router(self, m: int) -> TopKRouter:
        """Modality m's router (`gate` for text)."""
        return getattr(self, "gate" if m == 0 else f"gate_{m}")

    def modality_experts(self) -> list[list[int]] | None:
        """Global expert ids each modality routes to (RoutingAccumulator's modality_experts);
        None for a text-only block."""
        if self.num_modalities == 1:
            return None
        return [list(range(o, o + n)) for o, n in zip(self.offsets, self.experts_per_modality)]

    def expert_set(self, m: int) -> StackedExperts:
        """Modality m's routed experts (`experts` for text); may be a LoRA-wrapped StackedExperts."""
        return getattr(self, "experts" if m == 0 else f"experts_{m}")

    def forward(self, hidden_states: paddle.Tensor, modality: paddle.Tensor | None = None) -> paddle.Tensor:
        """hidden_states [..., H]; modality: one id per token (any shape with that many entries),
        None = every token is text."""
        shape = hidden_states.shape
        x = hidden_states.reshape([-1, shape[-1]])
        mod = None if modality is None else check_modality_ids(modality, x.shape[0], self.num_modalities)
        if mod is not None and self.num_modalities > 1 and x.is_dist():
            return self._forward_in_place(x, mod).reshape(shape)
        if mod is None or self.num_modalities == 1:
            parts: list[tuple[paddle.Tensor | None, int]] = [(None, 0)]  # every token, text experts
        else:
            parts = [(paddle.nonzero(mod == m).reshape([-1]), m) for m in range(self.num_modalities)]
            parts = [(idx, m) for idx, m in parts if idx.shape[0]] or [(None, 0)]  # no token at all
        ref = self.routing_reference
        if ref is not None and len(parts) > 1:
            raise DataError(
                "routing replay covers text-only batches; this batch has several modalities "
                "(token_type_ids): set routing_replay=false"
            )
        routed = [self._route(m, x if idx is None else paddle.gather(x, idx), ref) for idx, m in parts]
        if ref is not None:
            own = self.router(parts[0][1]).last_own_idx + self.offsets[parts[0][1]]
            self.last_changed = (
                int(routing_changed(own, ref.topk_idx, ref.mask).astype("int64").sum()),
                int(ref.mask.astype("int64").sum()),
            )
        order = None if parts[0][0] is None else paddle.argsort(paddle.concat([idx for idx, _ in parts]))

        def in_token_order(ts: list[paddle.Tensor]) -> paddle.Tensor:
            t = paddle.concat(ts) if len(ts) > 1 else ts[0]
            return t if order is None else paddle.gather(t, order)

        y = in_token_order([r[0] for r in routed])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        topk = in_token_order([r.topk_idx + self.offsets[m] for (_, m), (_, r, _) in zip(parts, routed)])
        if self.capacity_factor > 0:
            kept = sum(float(keep.astype("float32").sum()) for _, _, keep in routed)
            self.last_dropped = 1.0 - kept / max(topk.shape[0] * topk.shape[1], 1)
        if self.training:
            self._router_losses(parts, routed, topk)
        self.last_topk_idx = topk.detach()
        self.last_probs = in_token_order(
            [self._global_probs(m, r.probs) for (_, m), (_, r, _) in zip(parts, routed)]
        ).detach()
        self.last_modality = None if mod is None else mod.detach()
        return y.reshape(shape)

    def _forward_in_place(self, x: paddle.Tensor, mod: paddle.Tensor) -> paddle.Tensor:
        """Modality-isolated routing over a distributed batch (a collective job's tokens, split
        over ranks): picking each modality's tokens out would gather the whole batch onto every
        rank, and expert parallelism would then run every token once per rank. Instead every
        modality's router sees all tokens and its experts take only their own (the others'
        assignments dropped, as the capacity limit drops them); router losses and statistics read
        each modality's own tokens."""
        if self.capacity_factor > 0:
            raise DataError(
                "moe_capacity_factor with modality-isolated routing runs in one process or plain data "
                "parallelism in this version; set it to 0 for expert or tensor parallelism"
            )
        if self.routing_reference is not None:
            raise DataError("routing replay covers text-only batches; set routing_replay=false")
        if not mod.is_dist():  # the ids as the tokens are laid out over the ranks
            import paddle.distributed as dist

            rows = [p if p.is_shard() and p.get_dim() == 0 else dist.Replicate() for p in x.placements]
            mod = dist.shard_tensor(mod, x.process_mesh, rows)
        y, parts, routed = None, [], []
        topk = paddle.zeros([x.shape[0], self.router(0).active_k or self.router(0).k], dtype="int64")
        probs = paddle.zeros([x.shape[0], self.num_experts], dtype="float32")
        for m in range(self.num_modalities):
            own = mod == m
            r = self.router(m)(x)
            keep = own.unsqueeze(-1).expand(r.topk_idx.shape)
            out = self.expert_set(m)(self._after(x, y, m), r.topk_idx, r.topk_weight, keep)
            y = out if y is None else y + out
            topk = paddle.where(keep, r.topk_idx + self.offsets[m], topk)
            probs = probs + own.unsqueeze(-1).astype("float32") * self._global_probs(m, r.probs)
            idx = paddle.nonzero(own).reshape([-1])
            if idx.shape[0]:  # this modality's own tokens, for its router losses
                parts.append((idx, m))
                r_own = RouterOutput(*(paddle.gather(t, idx) for t in (r.logits, r.probs, r.topk_idx, r.topk_weight)))
                routed.append((None, r_own, None))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        if self.training:
            self._router_losses(parts, routed, topk)
        self.last_topk_idx, self.last_probs, self.last_modality = topk.detach(), probs.detach(), mod.detach()
        return y

    def _after(self, x: paddle.Tensor, y: paddle.Tensor | None, m: int) -> paddle.Tensor:
        """x for expert set m, made to depend on the sets before it when they exchange tokens between
        ranks: each set's all-to-alls are blocking pairs on one group, so every rank must run them in
        the same order in the backward too, and Paddle's autograd orders independent branches by the
        graph's shape, which differs on a rank whose experts got no rows (it hung in a recv)."""
        if y is None or self.expert_set(m).expert_parallel is None:
            return x
        return x + 0 * y  # the same values; set m's backward now ends before set m-1's begins

    def _route(
        self, m: int, x: paddle.Tensor, ref: RoutingReference | None = None
    ) -> tuple[paddle.Tensor, RouterOutput, paddle.Tensor | None]:
        """Modality m's tokens x [T_m, H] through its router and experts (local expert ids)."""
        gate = self.router(m)
        if ref is not None and self.offsets[m]:
            ref = RoutingReference(ref.topk_idx - self.offsets[m], ref.mask, ref.force)
        r = gate(x, ref)
        keep = None
        if self.capacity_factor > 0:
            cap = expert_capacity(x.shape[0], r.topk_idx.shape[1], gate.n_active, self.capacity_factor)
            keep = capacity_keep(r.topk_idx, gate.num_experts, cap)
        return self.expert_set(m)(x, r.topk_idx, r.topk_weight, keep), r, keep

    def _global_probs(self, m: int, probs: paddle.Tensor) -> paddle.Tensor:
        """[T_m, E_m] -> [T_m, total experts], zeros outside modality m's columns."""
        if self.num_modalities == 1:
            return probs
        T, before = probs.shape[0], self.offsets[m]
        after = self.num_experts - before - probs.shape[1]
        pieces = [paddle.zeros([T, before], probs.dtype)] if before else []
        pieces.append(probs)
        if after:
            pieces.append(paddle.zeros([T, after], probs.dtype))
        return paddle.concat(pieces, axis=1) if len(pieces) > 1 else probs

    def _router_losses(self, parts, routed, topk: paddle.Tensor) -> None:
        """Beside data ranks (data_sum set) the losses need the whole batch's counts: this layer's
        are kept for `settle_router_losses`, which sums every layer's in one collective after the
        forward (one wait for the other ranks instead of one per layer). A recomputed layer's second
        run changes nothing: the counts are not differentiable, so the replay needs none of them."""
        if self.data_sum is None or not (self.coefs["aux"] or self.coefs["z"]):  # no whole-batch count needed
            self._set_losses(parts, routed, [None] * len(parts))
        elif not recomputing():
            self.pending_stats = (self._batch_stats(parts, routed), parts, routed)
            self.router_loss, self.loss_parts = None, {}
        if recomputing():  # the backward's second run of a recomputed layer: already counted
            return
        with paddle.no_grad():
            self.load_counts += paddle.bincount(topk.reshape([-1]), minlength=self.num_experts).astype("float32")

    def _batch_stats(self, parts, routed) -> paddle.Tensor:
        """[total experts + modalities]: assignments per (global) expert, then tokens per modality
        (zeros for a modality without tokens here: every rank sends the same sizes)."""
        by_m = {m: r for (_, m), (_, r, _) in zip(parts, routed)}
        pieces, tokens = [], []
        for m, n in enumerate(self.experts_per_modality):
            r = by_m.get(m)
            counts = None if r is None else paddle.bincount(r.topk_idx.reshape([-1]), minlength=r.probs.shape[1])
            pieces.append(paddle.zeros([n], "float32") if counts is None else counts.astype("float32"))
            tokens.append(0.0 if r is None else float(r.topk_idx.shape[0]))
        return paddle.concat([*pieces, paddle.to_tensor(tokens, dtype="float32")])

    def finish_router_losses(self, whole: paddle.Tensor) -> None:
        """The pending losses from `whole`, this layer's `_batch_stats` summed over the data ranks."""
        _, parts, routed = self.pending_stats
        self.pending_stats = None
        glob = []
        for (_, m), (_, r, _) in zip(parts, routed):
            off = self.offsets[m]
            glob.append((whole[off : off + r.probs.shape[1]], whole[self.num_experts + m].item()))
        self._set_losses(parts, routed, glob)

    def _set_losses(self, parts, routed, whole: list) -> None:
        """Each modality's losses on its own tokens and router, summed over modalities (the
        orthogonal loss covers every router, also one whose modality has no token in the batch).
        whole: per part, (counts, tokens) of the whole batch over the data ranks, or None."""
        terms: dict[str, list[paddle.Tensor]] = {}
        for (_, m), (_, r, _), w in zip(parts, routed, whole):
            gate = self.router(m)
            n = gate.n_active
            if self.coefs["aux"]:
                terms.setdefault("aux", []).append(load_balancing_loss(r.probs, r.topk_idx, n, w))
            if self.coefs["z"]:
                logits = r.logits if n == gate.num_experts else r.logits[:, :n]
                if w is None:
                    terms.setdefault("z", []).append(router_z_loss(logits))
                else:  # this rank's tokens' share of the whole batch's mean
                    terms.setdefault("z", []).append(router_z_loss(logits) * (logits.shape[0] / w[1]))
        if self.coefs["orthogonal"]:
            for m in range(self.num_modalities):
                gate = self.router(m)
                n = gate.n_active
                ortho = router_orthogonal_loss(gate.weight, n if n < gate.num_experts else None)
                # every data rank adds it and their gradients are summed: each carries 1/ranks
                terms.setdefault("orthogonal", []).append(ortho if self.data_ranks == 1 else ortho / self.data_ranks)
        losses = {k: (v[0] if len(v) == 1 else paddle.add_n(v)) for k, v in terms.items()}
        self.router_loss = paddle.add_n([self.coefs[k] * v for k, v in losses.items()]) if losses else None
        self.loss_parts = {k: v.detach() for k, v in losses.items()}

    @paddle.no_grad()
    def update_correction_bias(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3, carried by ERNIE 4.5 checkpoints as
        e_score_correction_bias): b_e += rate * sign(mean load - load_e) over the active experts
        of each modality (balanced within the modality), from the assignments counted since the
        last update."""
        load = self.load_counts if self.data_sum is None else self.data_sum(self.load_counts)
        for m in range(self.num_modalities):
            gate = self.router(m)
            n, off = gate.n_active, self.offsets[m]
            counts = load[off : off + n]
            if float(counts.sum()) > 0:
                delta = rate * paddle.sign(counts.mean() - counts)
                if n < gate.num_experts:
                    delta = paddle.concat([delta, paddle.zeros([gate.num_experts - n], dtype=delta.dtype)])
                bias = gate.e_score_correction_bias
                bias.set_value(bias + delta.unsqueeze(0))
        self.load_counts.zero_()
