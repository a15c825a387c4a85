"""`erniekit plan --mode ps`: the placement the schedulers choose for a model on a heterogeneous
cluster, with its predicted throughput and cost beside greedy, exact (small models) and every
single-type placement (CPU-only, GPU-only: the comparison Paddle-HeterPS reports)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from erniekit.distributed.ps.cost_model import Evaluation, HeteroCluster, PlacementProblem, model_parts
from erniekit.distributed.ps.scheduler import EXACT_LIMIT, best_reachable, exact, greedy, rl_search
from erniekit.errors import ConfigError


@dataclass
class Row:
    name: str
    placement: tuple[str, ...] | None
    evaluation: Evaluation | None


def describe(ev: Evaluation) -> str:
    """'cpu x1 [embedding] | gpu x3 [layer0..layer17] | ...'"""
    parts = []
    for t, names, n in ev.stages:
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        parts.append(f"{t} x{n} [{span}]")
    return " | ".join(parts)


def check_parts_fit(parts, cluster: HeteroCluster) -> None:
    """Every part must fit some device type: its parameters with gradients and AdamW moments on
    one device (a row-sharded table: over all devices of the type). One-line error otherwise."""
    from erniekit.distributed.ps.cost_model import BYTES, STATE

    for p in parts:
        need = STATE * BYTES * p.params
        room = max(t.memory * (t.count if p.sharded else 1) for t in cluster.types)
        if need > room:
            raise ConfigError(f"cluster {cluster.name}: no device type can hold {p.name}: its parameters, gradients "
                              f"and optimizer state need {need / 1e9:.1f} GB, the most any type offers is "
                              f"{room / 1e9:.1f} GB; add a device type with more memory (device_types[].memory)")


def default_target(problem_of, cluster: HeteroCluster) -> float:
    """Half the throughput of the fastest single-type placement that fits."""
    probe = problem_of(1.0)
    best, _ = best_reachable(probe)
    return 0.5 * best


def plan_placement(model_config, cluster: HeteroCluster, seq_len: int, global_batch: int,
                   target: float | None = None, seed: int = 0, iterations: int = 150) -> tuple[list[Row], float]:
    """Rows (RL, greedy, exact when small, each single type) and the target used. An unreachable
    target is a one-line error naming the best throughput found."""
    tokens = seq_len * global_batch
    parts = model_parts(model_config, seq_len)
    check_parts_fit(parts, cluster)

    def problem_of(t: float) -> PlacementProblem:
        return PlacementProblem(parts, cluster, tokens, t)

    target = target if target is not None else default_target(problem_of, cluster)
    prob = problem_of(target)
    g = greedy(prob)
    rl = rl_search(prob, seed=seed, iterations=iterations, warm_start=g.placement)
    rows = [Row("RL scheduler", rl.placement, rl.evaluation), Row("greedy", g.placement, g.evaluation)]
    if len(prob.type_names) ** len(parts) <= EXACT_LIMIT:
        ex = exact(prob)
        rows.append(Row("exact", ex.placement, ex.evaluation))
    for t in prob.base_names:
        pl = tuple([t] * len(parts))
        rows.append(Row(f"{t} only", pl, prob.evaluate(pl)))
    if rl.placement is None:
        best, pl = best_reachable(prob, [r.placement for r in rows if r.placement is not None])
        raise ConfigError(f"throughput target {target:.0f} tokens/s is unreachable on cluster {cluster.name}: the best "
                          f"placement found reaches {best:.0f} tokens/s ({describe(prob.evaluate(pl))}); lower --target "
                          "or add devices")
    return rows, target


def format_rows(rows: list[Row], tokens: int) -> str:
    lines = ["| placement | feasible | tokens/s | $ per 1M tokens | devices | stages |", "|---|---|---|---|---|---|"]
    for r in rows:
        ev = r.evaluation
        if ev is None:
            lines.append(f"| {r.name} | no | - | - | - | none found |")
            continue
        per_m = ev.cost_per_batch / tokens * 1e6 if ev.feasible else math.inf
        dev = ", ".join(f"{t} {n}" for t, n in ev.devices.items())
        lines.append(f"| {r.name} | {'yes' if ev.feasible else 'no: ' + ev.why} | {ev.throughput:.0f} | "
                     f"{per_m:.4f} | {dev} | {describe(ev)} |")
    return "\n".join(lines)
