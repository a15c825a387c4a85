"""Placement search for the heterogeneous mode: an exact search for small instances, a greedy
baseline, and an RL scheduler (Paddle-HeterPS) for the rest.

The RL scheduler is a policy over per-part placement decisions: part l's device type (or a type
that starts a new stage) is drawn from softmax(theta[l, choice of part l-1]), so it can learn to
keep neighbours together (fewer activation transfers) or cut a long run of one type into
pipeline stages (smaller all-reduces). It is trained with REINFORCE and a moving-average baseline; the
reward is -log(cost) for a feasible placement and, for an infeasible one, the reward of the most
expensive feasible placement possible minus 1 minus the shortfall, so it is pushed towards
feasibility first. The best feasible placement it has sampled is returned.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from erniekit.distributed.ps.cost_model import Evaluation, PlacementProblem
from erniekit.errors import ConfigError

EXACT_LIMIT = 200_000  # placements the exact search enumerates at most


@dataclass
class Result:
    placement: tuple[str, ...] | None
    evaluation: Evaluation | None
    tried: int  # placements evaluated

    @property
    def cost(self) -> float:
        return self.evaluation.cost_per_batch if self.evaluation is not None and self.evaluation.feasible else math.inf


def _better(a: Evaluation | None, b: Evaluation) -> bool:
    return b.feasible and (a is None or not a.feasible or b.cost_per_batch < a.cost_per_batch)


def exact(problem: PlacementProblem) -> Result:
    """Every placement: the optimum (ties broken by enumeration order)."""
    T, L = len(problem.type_names), len(problem.parts)
    if T**L > EXACT_LIMIT:
        raise ConfigError(
            f"exact placement search over {T}^{L} placements is too large (limit {EXACT_LIMIT}); use the RL scheduler"
        )
    best, best_p = None, None
    for pl in itertools.product(problem.type_names, repeat=L):
        ev = problem.evaluate(pl)
        if _better(best, ev):
            best, best_p = ev, pl
    return Result(best_p, best, T**L)


def greedy(problem: PlacementProblem) -> Result:
    """Each part alone on the type where it is cheapest (devices it needs x price), ignoring
    stage merges, cuts and transfers: what a per-layer rule of thumb gives."""
    pl = []
    for i in range(len(problem.parts)):
        costs = []
        for t in problem.base_names:
            n, time, _ = problem.stage(t, i, i + 1)
            price = problem.cluster.type(t).price_per_hour
            costs.append(n * price * time if n is not None else math.inf)
        k = int(np.argmin(costs)) if np.isfinite(costs).any() else 0
        pl.append(problem.base_names[k])
    pl = tuple(pl)
    return Result(pl, problem.evaluate(pl), 1)


def rl_schedule(
    problem: PlacementProblem,
    seed: int = 0,
    iterations: int = 200,
    samples: int = 32,
    lr: float = 0.5,
    warm_start: tuple[str, ...] | None = None,
    cut_prior: float = 2.0,
) -> Result:
    """REINFORCE over per-part type choices conditioned on the previous part's type.
    warm_start: a placement (the greedy one) the initial policy leans towards (logit +1) and that
    counts as sampled, so the result is never worse than it."""
    rng = np.random.default_rng(seed)
    T, L = len(problem.type_names), len(problem.parts)
    theta = np.zeros((L, T + 1, T))  # row T of the middle axis: "no previous part"
    theta[:, :, len(problem.base_names) :] = -cut_prior  # stage cuts start rare: most parts continue a stage
    worst_ok = -math.log(problem.max_cost) if problem.max_cost > 0 else 0.0
    baseline = None
    best, best_p, tried = None, None, 0
    if warm_start is not None:
        idx = [problem.type_names.index(t) for t in warm_start]
        for l, c in enumerate(idx):
            theta[l, :, c] += 1.0
        ev = problem.evaluate(tuple(warm_start))
        tried += 1
        if ev.feasible:
            best, best_p = ev, tuple(warm_start)
    cache: dict[tuple[int, ...], float] = {}
    for _ in range(iterations):
        choice = np.zeros((samples, L), dtype=np.int64)
        prev = np.full(samples, T)
        grads = np.zeros((samples, L, T + 1, T))
        for l in range(L):
            logits = theta[l, prev]  # [samples, T]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            c = (p.cumsum(axis=1) > rng.random((samples, 1))).argmax(axis=1)
            choice[:, l] = c
            g = -p
            g[np.arange(samples), c] += 1.0  # d log p(c) / d logits
            grads[np.arange(samples), l, prev] = g
            prev = c
        rewards = np.empty(samples)
        for s in range(samples):
            key = tuple(choice[s])
            if key not in cache:
                pl = tuple(problem.type_names[i] for i in key)
                ev = problem.evaluate(pl)
                tried += 1
                cache[key] = -math.log(ev.cost_per_batch) if ev.feasible else worst_ok - 1.0 - min(ev.shortfall, 10.0)
                if _better(best, ev):
                    best, best_p = ev, pl
            rewards[s] = cache[key]
        mean = rewards.mean()
        baseline = mean if baseline is None else 0.9 * baseline + 0.1 * mean
        adv = rewards - baseline
        scale = adv.std() or 1.0
        theta += lr * np.tensordot(adv / scale, grads, axes=1) / samples
    return Result(best_p, best, tried)


SEARCH_SEEDS = 4  # RL runs per search, each from its own seed (rl_search)


def rl_search(
    problem: PlacementProblem,
    seed: int = 0,
    iterations: int = 150,
    warm_start: tuple[str, ...] | None = None,
    seeds: int = SEARCH_SEEDS,
) -> Result:
    """The best of RL runs from `seeds` seeds (seed, seed + 1, ...) x two priors: stage cuts as
    likely as any choice at first (explores small instances fully), and rare at first (keeps long
    chains contiguous until a cut pays). Measured on the test instances: the first prior alone hit
    the exact optimum on 40/40 small ones but beat greedy on 1/4 large ones; the second 33/40 and
    3/4. One seed's answer for ERNIE-4.5-0.3B at 2e5 tokens/s on hetero-cpu-gpu.yaml ranged over
    1.41x in cost across seeds 0-9; the best of 4 consecutive seeds found the cheapest in 39 of 47
    windows (at worst 1.20x), so the plan no longer hangs on one seed's luck."""
    runs = [
        rl_schedule(problem, seed=seed + k, iterations=iterations, warm_start=warm_start, cut_prior=prior)
        for k in range(seeds)
        for prior in (0.0, 2.0)
    ]
    best = min(runs, key=lambda r: r.cost)
    return Result(best.placement, best.evaluation, sum(r.tried for r in runs))


def schedule(problem: PlacementProblem, seed: int = 0, iterations: int = 150) -> tuple[Result, Result, Result | None]:
    """(RL warm-started from greedy, greedy, exact when the instance is small enough, else None)."""
    g = greedy(problem)
    rl = rl_search(problem, seed=seed, iterations=iterations, warm_start=g.placement)
    ex = exact(problem) if len(problem.type_names) ** len(problem.parts) <= EXACT_LIMIT else None
    return rl, g, ex


def best_reachable(problem: PlacementProblem, tried: list[tuple[str, ...]] = ()) -> tuple[float, tuple[str, ...]]:
    """The highest throughput among every single-type placement and `tried`, each with as many
    devices as its stages may use: what an unreachable target's error reports."""
    best, best_p = 0.0, ()
    cands = [tuple([t] * len(problem.parts)) for t in problem.base_names] + list(tried)
    for pl in cands:
        ev = problem.evaluate(pl)
        if all(n <= problem.cluster.type(t).count for t, n in ev.devices.items()) and ev.throughput > best:
            best, best_p = ev.throughput, pl
    return best, best_p


def synthetic_instance(rng: np.random.Generator, parts: int, types: int):
    """A random chain of parts and a random cluster (speeds over 3.5 decades, prices rising with
    speed, counts 2-16): the scheduler tests' and benchmark's instances."""
    from erniekit.distributed.ps.cost_model import DeviceType, HeteroCluster, Part

    ts = []
    for t in range(types):
        speed = 10 ** rng.uniform(10.5, 14)
        ts.append(
            DeviceType(
                f"type{t}",
                int(rng.integers(2, 17)),
                speed,
                10 ** rng.uniform(9.5, 11),
                10 ** rng.uniform(9, 11),
                float(speed / 1e13 * rng.uniform(0.5, 2) + 0.05),
            )
        )
    ps = [
        Part(
            f"part{i}",
            flops=10 ** rng.uniform(6, 9),
            params=int(10 ** rng.uniform(6, 8.5)),
            activation=float(rng.integers(256, 4096)),
            saved=float(rng.integers(1000, 20000)),
            memory_traffic=float(rng.choice([0, 8000])),
        )
        for i in range(parts)
    ]
    return HeteroCluster(ts, "synthetic"), ps


def feasible_target(parts, cluster, tokens: int, solver=None) -> PlacementProblem | None:
    """The problem at the highest of 30 targets (1e6 down to 1e2 tokens/s, geometric) that `solver`
    (default: exact) finds a feasible placement for; None if none."""
    for target in np.geomspace(1e6, 1e2, 30):
        prob = PlacementProblem(parts, cluster, tokens, float(target))
        res = (solver or exact)(prob)
        if res.placement is not None and res.evaluation.feasible:
            return prob
    return None


def against_exact(seeds) -> list[tuple[float, float]]:
    """(RL cost, exact cost) on seeded small enumerable instances (4-5 parts, 2-3 types, instance
    `seed` drawn from default_rng(seed)), each at the highest target some placement meets; seeds
    with none are skipped. The scheduler's quality test and tools/bench_ps.py; one seed per search,
    so it measures what a single RL run finds (a plan takes the best of SEARCH_SEEDS)."""
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        cluster, parts = synthetic_instance(rng, int(rng.integers(4, 6)), int(rng.integers(2, 4)))
        prob = feasible_target(parts, cluster, 4096)
        if prob is not None:
            out.append((rl_search(prob, seed=seed, seeds=1).cost, exact(prob).cost))
    return out


def against_greedy(seeds) -> list[tuple[float, float]]:
    """(RL cost, greedy cost) on seeded 40-part, 3-type instances (default_rng(100 + seed)), each at
    the highest target greedy meets; RL warm-started from the greedy placement, one seed a search."""
    out = []
    for seed in seeds:
        rng = np.random.default_rng(100 + seed)
        cluster, parts = synthetic_instance(rng, 40, 3)
        prob = feasible_target(parts, cluster, 4096, solver=greedy)
        if prob is not None:
            g = greedy(prob)
            out.append((rl_search(prob, seed=seed, warm_start=g.placement, seeds=1).cost, g.cost))
    return out
