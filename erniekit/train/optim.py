"""AdamW written with Paddle tensor ops, and global-norm clipping we can log.

Why not `paddle.optimizer.AdamW`: in the PyPI CPU build (3.3.1) one step of Paddle's fused
adam/adamw kernel on a tensor of ~1e5 elements makes every later GEMM in the process 3-5x slower
(measured with a 2048x128x384 matmul: 6.3 ms before, 22-37 ms after, also with lr=0; SGD and
Momentum do not do it; the tools/ benchmark shows the whole-step effect). The same update in
plain tensor ops costs ~1 ms/step for the tiny model and has no such effect. State is keyed by
parameter name, which also makes checkpoints independent of Paddle's auto-generated names.

In a multi-process run parameters are DistTensors: a gradient arrives as a partial sum over the
data ranks and is reduced to the parameter's placements here; with ZeRO-1 sharding the moments
live split over the sharding ranks (`state_placements`) and the update is gathered back.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.distributed as dist

from erniekit.nn import native
from erniekit.utils.dtensor import host_view, is_dist, replicated_local, to_dense


def reduce_to(g: paddle.Tensor, like: paddle.Tensor) -> paddle.Tensor:
    """Gradient g (a DistTensor, possibly holding partial sums) in the placements of `like`.
    Partial -> Shard would be a reduce-scatter, which Paddle's CPU build lacks (a ZeRO-1 MoE run
    stopped on it at step 26, measured): reduce to Replicate first (an all-reduce), then take the
    local shard, which moves nothing."""
    if any(pl.is_partial() for pl in g.placements) and any(pl.is_shard() for pl in like.placements):
        g = dist.reshard(g, like.process_mesh, [dist.Replicate() if pl.is_partial() else pl for pl in g.placements])
    return dist.reshard(g, like.process_mesh, like.placements)


def _numpy_step(p, g, m, v, b1, b2, lr_bc1, bc2, eps, decay) -> bool:
    """The AdamW update of one parameter in numpy, in place, when p, g and the moments are dense
    float32 CPU tensors; False (nothing done) otherwise.

    Why: the Paddle-op update issues ~16 eager ops per parameter (~900 a step for the embedded
    default's 57 tensors, 6 ms of its ~88 ms step); numpy's in-place kernels do the same arithmetic
    in ~2 ms. Same formula and order as the Paddle path; the values differ in the last bit where
    Paddle's CPU sqrt and divide are not correctly rounded (numpy's are).
    """
    views = [host_view(t) for t in (p, g, m, v)]  # a replicated DistTensor: its local value
    if any(a is None for a in views):
        return False
    P, G, M, V = views
    if _native_adamw(P, G, M, V, b1, b2, lr_bc1, bc2, eps, decay):
        return True
    f = np.float32
    M *= f(b1)
    M += G * f(1 - b1)
    V *= f(b2)
    V += (G * G) * f(1 - b2)
    if decay is not None:
        P *= f(decay)
    den = V / f(bc2)
    np.sqrt(den, out=den)
    den += f(eps)
    upd = M * f(-lr_bc1)
    upd /= den
    P += upd
    return True


def _native_adamw(P, G, M, V, b1, b2, lr_bc1, bc2, eps, decay) -> bool:
    """`_numpy_step`'s update by kernels/adamw.c (one pass instead of ~12, cut over the threads,
    the same bits: tests); False without the compiled kernel. numpy's passes run on one core and
    took 0.66 s of the 3.5 s dense-1024 step at 2 threads (80M parameters)."""
    fn = native.adamw()
    if fn is None or not all(a.flags.c_contiguous for a in (P, G, M, V)):
        return False
    f = np.float32
    consts = (f(b1), f(1 - b1), f(b2), f(1 - b2), int(decay is not None), f(decay if decay is not None else 1.0))
    consts += (f(bc2), f(eps), f(-lr_bc1))
    ptrs = (P.ctypes.data, G.ctypes.data, M.ctypes.data, V.ctypes.data)
    native.over_chunks(fn, P.size, P.nbytes, *ptrs, *consts)  # a parameter under 1 MB: one chunk
    return True


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter):

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    """

    def __init__(
        self,
        named_params: list[tuple[str, paddle.Tensor]],
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 0.0,
        no_decay: set[str] = frozenset(),
        lr_mult: dict[str, float] | None = None,
    ):
        self.params = [(n, p) for n, p in named_params if not p.stop_gradient]
        self.lr, self.beta1, self.beta2, self.eps, self.wd = lr, beta1, beta2, epsilon, weight_decay
        self.no_decay = set(no_decay)
        self.lr_mult = dict(lr_mult or {})  # per-parameter learning-rate multipliers (LoRA+)
        self.t = 0
        self.m: dict[str, paddle.Tensor] = {}
        self.v: dict[str, paddle.Tensor] = {}
        self.state_placements = None  # callable(param) -> placements of its moments (multi-process runs)
        self._cleared: list[paddle.Tensor] = []  # plain parameters whose gradient clear_grad dropped

    def _zeros_for(self, p: paddle.Tensor) -> paddle.Tensor:
        return self._place(p, paddle.zeros(p.shape, "float32"))

    def _place(self, p: paddle.Tensor, full: paddle.Tensor) -> paddle.Tensor:
        """A moment tensor (full value) placed for parameter `p`."""
        if not is_dist(p):
            return full
        placements = self.state_placements(p) if self.state_placements else p.placements
        return dist.shard_tensor(full, p.process_mesh, placements)

    def state_numel(self) -> tuple[int, int]:
        """(values of the moments held by this process, values of the full moments)."""
        ts = list(self.m.values()) + list(self.v.values())
        local = sum(int((t._local_value() if is_dist(t) else t).numel()) for t in ts)
        return local, sum(int(t.numel()) for t in ts)

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def get_lr(self) -> float:
        return self.lr

    @paddle.no_grad()
    def step(self, grads: dict[int, paddle.Tensor] | None = None) -> None:
        """grads: id(param) -> gradient already reduced (`reduced_grads`); default p.grad."""
        self.t += 1
        b1, b2, lr = self.beta1, self.beta2, self.lr
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        for name, p in self.params:
            g = p.grad if grads is None else grads.get(id(p))
            if g is None:
                continue
            g = g if g.dtype == paddle.float32 else g.astype("float32")
            if name not in self.m:
                self.m[name] = self._zeros_for(p)
                self.v[name] = self._zeros_for(p)
            m, v = self.m[name], self.v[name]
            if is_dist(g):  # reduce partial sums, keep this rank's shard of the moments' layout
                g = reduce_to(g, m)
            plr = lr * self.lr_mult.get(name, 1.0)
            decay = 1 - plr * self.wd if self.wd and name not in self.no_decay else None
            if _numpy_step(p, g, m, v, b1, b2, plr / bc1, bc2, self.eps, decay):
                continue
            m.scale_(b1).add_(g * (1 - b1))
            v.scale_(b2).add_(g * g * (1 - b2))
            if decay is not None:
                p.scale_(decay)
            update = (-(plr / bc1) * m / (paddle.sqrt(v / bc2) + self.eps)).astype(p.dtype)
            if is_dist(update) and update.placements != p.placements:  # ZeRO-1: gather the update
                update = dist.reshard(update, p.process_mesh, p.placements)
            p.add_(update)

    def clear_grad(self) -> None:
        """Give the gradients' memory back before the next forward, as torch's
        zero_grad(set_to_none=True) does: Paddle's clear_gradient(set_to_zero=False) keeps each buffer
        allocated (Paddle 3.3: a model's worth of float32 held through the next forward, 305 MiB on
        dense-1024; docs/performance.md, thirteenth round). A DistTensor parameter keeps Paddle's
        clear: `grad = None` there leaves an undefined tensor the next step cannot read."""
        self._cleared = []
        for _, p in self.params:
            if is_dist(p):
                p.clear_gradient(set_to_zero=False)
            elif p.grad is not None:
                p.grad = None
                self._cleared.append(p)

    def restore_unused_grads(self) -> None:
        """After the step's backward: zeros for a parameter whose gradient `clear_grad` dropped and
        that got none this step, which is what Paddle's clear left it, so it still takes AdamW's step
        on zeros (momentum, decay) as before and as data-parallel replicas (zero-filled) do."""
        for p in self._cleared:
            if p.grad is None:
                p.grad = paddle.zeros_like(p)
        self._cleared = []

    def state_dict(self) -> dict[str, paddle.Tensor]:
        sd = {"__step__": paddle.to_tensor([self.t], dtype="int64")}
        for name in self.m:  # full values (a collective in multi-process runs)
            sd[f"{name}::exp_avg"] = to_dense(self.m[name])
            sd[f"{name}::exp_avg_sq"] = to_dense(self.v[name])
        return sd

    def set_state_dict(self, sd: dict[str, paddle.Tensor]) -> None:
        params = dict(self.params)
        self.t = int(sd["__step__"].numpy()[0])
        for key, value in sd.items():
            if key == "__step__":
                continue
            name, kind = key.rsplit("::", 1)
            if name not in params:
                raise KeyError(name)
            (self.m if kind == "exp_avg" else self.v)[name] = self._place(params[name], value.astype("float32"))


def build_optimizer(
    model: paddle.nn.Layer,
    optim,
    extra: list[tuple[str, paddle.Tensor]] = (),
    lora_plus_scale: float = 1.0,
    state_placements=None,
    lr_ratios: dict[str, float] | None = None,
) -> AdamW:
    """AdamW over the model's trainable parameters plus `extra` named ones (a PPO value head).
    optim: the run config's `optim` section (learning_rate, adam_*, weight_decay); lora_plus_scale:
    LoRA+'s learning-rate ratio of the B matrices (1: none); state_placements: (param) -> where its
    moments live over a collective job's mesh (the step runner's; None: beside the parameter);
    lr_ratios: parameter-name prefix -> learning-rate ratio (a stage's, e.g. VL-SFT's vit_lr_ratio)."""
    named = list(model.named_parameters()) + list(extra)
    no_decay = {n for n, p in named if p.ndim < 2 or "norm" in n or "embed_tokens" in n}
    lr_mult = None
    if lora_plus_scale != 1.0:
        from erniekit.nn.lora import lora_param_groups

        lr_mult = lora_param_groups(model, lora_plus_scale)
    for prefix, ratio in (lr_ratios or {}).items():
        if ratio != 1.0:
            lr_mult = dict(lr_mult or {})
            for n, _ in named:
                if n.startswith(prefix):
                    lr_mult[n] = lr_mult.get(n, 1.0) * ratio
    opt = AdamW(
        named,
        optim.learning_rate,
        optim.adam_beta1,
        optim.adam_beta2,
        optim.adam_epsilon,
        optim.weight_decay,
        no_decay,
        lr_mult,
    )
    if state_placements is not None:
        opt.state_placements = state_placements
    return opt


def _reduced(p: paddle.Tensor, g: paddle.Tensor) -> paddle.Tensor:
    if not is_dist(g) or all(not pl.is_partial() for pl in g.placements):
        return g
    return dist.reshard(g, p.process_mesh, p.placements)


def _all_ranks_partial(p: paddle.Tensor, g: paddle.Tensor) -> bool:
    """g holds sums over every rank of the job for a parameter replicated everywhere (plain data
    parallelism, ZeRO-1): one job-wide all-reduce of its local value makes it the full gradient.
    Either Paddle marked g Partial, or the parameter's gradient was computed on local tensors and
    says so (`grad_sums_over_ranks`, set by erniekit/distributed/collective/replicated_experts.py)."""
    if not (is_dist(g) and is_dist(p)) or not all(pl.is_replicated() for pl in p.placements):
        return False
    if getattr(p, "grad_sums_over_ranks", False):
        return all(pl.is_replicated() for pl in g.placements)
    sizes = p.process_mesh.shape
    partial = [n for n, pl in zip(sizes, g.placements) if pl.is_partial()]
    if not partial or any(not (pl.is_replicated() or pl == dist.Partial()) for pl in g.placements):
        return False
    return math.prod(partial) == math.prod(sizes) > 1


def _bucketed_all_reduce(pairs: list[tuple[paddle.Tensor, paddle.Tensor]]) -> dict[int, paddle.Tensor]:
    """The gradients of `_all_ranks_partial` pairs reduced by one all-reduce per dtype over a
    flat buffer instead of one reshard each: 57 collectives a step -> 1 for the embedded model."""
    out: dict[int, paddle.Tensor] = {}
    by_dtype: dict = {}
    for p, g in pairs:
        by_dtype.setdefault(g.dtype, []).append((p, g))
    for group in by_dtype.values():
        local = [g._local_value().reshape([-1]) for _, g in group]
        flat = paddle.concat(local) if len(local) > 1 else local[0].clone()
        dist.all_reduce(flat)
        for (p, g), part in zip(group, paddle.split(flat, [int(t.shape[0]) for t in local])):
            full = part.reshape(g._local_value().shape)
            out[id(p)] = dist.auto_parallel.api.dtensor_from_local(full, p.process_mesh, list(p.placements))
    return out


@paddle.no_grad()
def reduced_grads(params: list[paddle.Tensor]) -> dict[int, paddle.Tensor]:
    """id(param) -> its gradient with partial sums reduced to the parameter's placements (the
    data-parallel all-reduce); p.grad itself in a single-process run. Clipping and the update
    share these: reducing in each moved every gradient twice (measured with
    tools/bench_scaling.py: 7.5 MB per device per step for tiny-dense dp=2, 2x its gradients).
    Gradients partial over every rank go in one bucketed all-reduce; the rest reshard one by one."""
    live = [(p, p.grad) for p in params if p.grad is not None]
    bucket = [(p, g) for p, g in live if _all_ranks_partial(p, g)]
    out = _bucketed_all_reduce(bucket) if bucket else {}
    for p, g in live:
        if id(p) not in out:
            out[id(p)] = _reduced(p, g)
    return out


def _shard_dims(g: paddle.Tensor) -> tuple[int, ...] | None:
    """The mesh dims a DistTensor gradient is sharded over (its local sum of squares is partial over
    exactly those), or None for a plain, replicated or partial one."""
    if not is_dist(g) or any(pl.is_partial() for pl in g.placements):
        return None
    dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
    return dims or None


def _sum_over_shards(group: list[paddle.Tensor], dims: tuple[int, ...]) -> paddle.Tensor:
    """The squares' sum of gradients sharded over the same mesh dims: their local sums added on this
    rank, then one all-reduce over those dims instead of one per gradient (every projection under tp,
    every expert tensor under ep). Measured, two alternating runs each: tp=2 tiny-dense 0.194 ->
    0.189 s a step, ep=2 tiny-moe 0.186 -> 0.174 s; most of what the per-gradient collectives
    seemed to cost in a profile was waiting for the other rank, which moves to the next collective."""
    local = paddle.add_n([paddle.sum(paddle.square(g._local_value().astype("float32"))) for g in group])
    mesh = group[0].process_mesh
    placements = [dist.Partial() if i in dims else dist.Replicate() for i in range(len(mesh.shape))]
    return to_dense(dist.auto_parallel.api.dtensor_from_local(local, mesh, placements))


@paddle.no_grad()
def clip_grad_norm_(
    params: list[paddle.Tensor], max_norm: float, grads: dict[int, paddle.Tensor] | None = None
) -> float:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; return the norm
    before. grads: from `reduced_grads` (they are the ones scaled); default: reduced here."""
    grads = reduced_grads(params) if grads is None else grads
    owned = [grads[id(p)] for p in params if id(p) in grads]
    if not owned:
        return 0.0
    # per-tensor sums of squares as full values (a partial sum is reduced before it is squared)
    # paddle.square: 40x faster on CPU than `** 2`, and a last-bit difference from it; the embedded
    # default is measured over seeds, threads and ISAs so it does not hang on such bits
    # (docs/reproducibility.md).
    sq, sharded = [], {}
    for g in owned:
        dims = _shard_dims(g)
        if dims is None:
            sq.append(to_dense(paddle.sum(paddle.square(replicated_local(g).astype("float32")))))
        else:
            mesh = g.process_mesh
            sharded.setdefault((tuple(mesh.process_ids), tuple(mesh.shape), dims), []).append(g)
    for (_, _, dims), group in sharded.items():
        sq.append(_sum_over_shards(group, dims))
    norm = float(paddle.sqrt(paddle.add_n(sq)))
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in owned:
            g.scale_(coef)
    return norm
