"""`erniekit plan --mode ps`: the placement the schedulers choose for a model on a heterogeneous
cluster, with its predicted throughput and cost beside greedy, exact (small models) and every
single-type placement (CPU-only, GPU-only: the comparison Paddle-HeterPS reports)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from erniekit.distributed.ps.cost_model import Evaluation, HeteroCluster, PlacementProblem, model_parts
from erniekit.distributed.ps.scheduler import best_reachable, schedule
from erniekit.errors import ConfigError


@dataclass
class Row:
    name: str
    placement: tuple[str, ...] | None
    evaluation: Evaluation | None

    def as_dict(self) -> dict:
        """For JSON (`erniekit plan --json`, output_dir/ps_placement.json)."""
        ev = self.evaluation
        return {
            "name": self.name,
            "placement": list(self.placement) if self.placement else None,
            "feasible": bool(ev and ev.feasible),
            "tokens_per_s": ev.throughput if ev else None,
            "cost_per_batch": ev.cost_per_batch if ev and ev.feasible else None,
            "devices": ev.devices if ev else None,
        }


def scheduler_rows(prob: PlacementProblem, seed: int = 0, iterations: int = 150) -> list[Row]:
    """RL (warm-started from greedy), greedy and, when the instance is small enough, exact."""
    rl, g, ex = schedule(prob, seed=seed, iterations=iterations)
    rows = [Row("RL scheduler", rl.placement, rl.evaluation), Row("greedy", g.placement, g.evaluation)]
    if ex is not None:
        rows.append(Row("exact", ex.placement, ex.evaluation))
    return rows


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
            raise ConfigError(
                f"cluster {cluster.name}: no device type can hold {p.name}: its parameters, gradients "
                f"and optimizer state need {need / 1e9:.1f} GB, the most any type offers is "
                f"{room / 1e9:.1f} GB; add a device type with more memory (device_types[].memory)"
            )


def default_target(problem_of, cluster: HeteroCluster) -> float:
    """Half the throughput of the fastest single-type placement that fits."""
    probe = problem_of(1.0)
    best, _ = best_reachable(probe)
    return 0.5 * best


def plan_placement(
    model_config,
    cluster: HeteroCluster,
    seq_len: int,
    global_batch: int,
    target: float | None = None,
    seed: int = 0,
    iterations: int = 150,
) -> tuple[list[Row], float]:
    """Rows (RL, greedy, exact when small, each single type) and the target used. An unreachable
    target is a one-line error naming the best throughput found."""
    tokens = seq_len * global_batch
    parts = model_parts(model_config, seq_len)
    check_parts_fit(parts, cluster)

    def problem_of(t: float) -> PlacementProblem:
        return PlacementProblem(parts, cluster, tokens, t)

    target = target if target is not None else default_target(problem_of, cluster)
    prob = problem_of(target)
    rows = scheduler_rows(prob, seed, iterations)
    for t in prob.base_names:
        pl = tuple([t] * len(parts))
        rows.append(Row(f"{t} only", pl, prob.evaluate(pl)))
    if rows[0].placement is None:  # the RL scheduler found nothing feasible
        best, pl = best_reachable(prob, [r.placement for r in rows if r.placement is not None])
        raise ConfigError(
            f"throughput target {target:.0f} tokens/s is unreachable on cluster {cluster.name}: the best "
            f"placement found reaches {best:.0f} tokens/s ({describe(prob.evaluate(pl))}); lower --target "
            "or add devices"
        )
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
        lines.append(
            f"| {r.name} | {'yes' if ev.feasible else 'no: ' + ev.why} | {ev.throughput:.0f} | "
            f"{per_m:.4f} | {dev} | {describe(ev)} |"
        )
    return "\n".join(lines)


@dataclass
class AutoPlacement:
    """What `ps_placement: auto` applies: the workers' pipeline stages (layers, device type and
    device of each), the data-parallel copies of the pipeline, and the process count."""

    stage_layers: list[int]
    stage_types: list[str]
    stage_devices: list[str]
    replicas: int
    servers: int
    evaluation: Evaluation
    rows: list[Row]
    target: float

    @property
    def processes(self) -> int:
        return self.servers + len(self.stage_layers) * self.replicas

    def overrides(self) -> list[str]:
        """key=value overrides that run it (passed to every launched process)."""
        return [
            f"pipeline_parallel_degree={len(self.stage_layers)}",
            f"pipeline_stage_layers=[{','.join(map(str, self.stage_layers))}]",
            f"ps_stage_devices=[{','.join(self.stage_devices)}]",
            f"nproc_per_node={self.processes}",
            "ps_placement=manual",
        ]

    def describe(self) -> str:
        return (
            f"{len(self.stage_layers)} stage(s) x {self.replicas} worker(s): "
            + describe(self.evaluation)
            + f"; predicted {self.evaluation.throughput:.0f} tokens/s (target {self.target:.0f}), "
            f"${self.evaluation.cost_per_batch:.3g} per batch"
        )


def auto_placement(
    model_config,
    cluster: HeteroCluster,
    seq_len: int,
    micro_batch: int,
    accum: int,
    replicas: int,
    servers: int,
    target: float | None = None,
    seed: int = 0,
) -> AutoPlacement:
    """The placement of the workers' decoder layers on `cluster`: RL (warm-started from greedy)
    and, when the instance is small enough, exact search, each stage with `replicas` workers; the
    cheaper one that meets the target. The embedding and head are not placed: in PS mode they
    live on the `servers` parameter servers whatever the placement, so their cost is the same for
    every choice. An unreachable target is a one-line error naming the best throughput found."""
    parts = model_parts(model_config, seq_len)[1:-1]
    check_parts_fit(parts, cluster)
    tokens = seq_len * micro_batch * accum * replicas

    def problem_of(t: float) -> PlacementProblem:
        return PlacementProblem(parts, cluster, tokens, t, replicas=replicas)

    target = target or default_target(problem_of, cluster)
    prob = problem_of(target)
    rows = scheduler_rows(prob, seed)
    found = [r for r in rows if r.evaluation is not None and r.evaluation.feasible]
    if not found:
        best, pl = best_reachable(prob, [r.placement for r in rows if r.placement is not None])
        if not pl:
            raise ConfigError(
                f"ps_placement=auto: no placement fits the cluster's device counts with ps_stage_workers="
                f"{replicas} on cluster {cluster.name}; lower ps_stage_workers or add devices"
            )
        how = f" ({describe(prob.evaluate(pl))})"
        raise ConfigError(
            f"ps_target {target:.0f} tokens/s is unreachable with ps_stage_workers={replicas} on cluster "
            f"{cluster.name}: the best placement found reaches {best:.0f} tokens/s{how}; lower "
            "ps_target, raise ps_stage_workers or add devices"
        )
    best = min(found, key=lambda r: r.evaluation.cost_per_batch)
    ev = best.evaluation
    return AutoPlacement(
        [len(names) for _, names, _ in ev.stages],
        [t for t, _, _ in ev.stages],
        [cluster.type(t).device for t, _, _ in ev.stages],
        replicas,
        servers,
        ev,
        rows,
        target,
    )


def placement_for_config(cfg) -> AutoPlacement:
    """`ps_placement: auto` of a training config: its model, batch and cluster file. The launched
    process count must be the placement's (nproc_per_node left at 1 lets it decide)."""
    from erniekit.distributed.planner import model_config_of
    from erniekit.distributed.ps.cost_model import load_hetero_cluster

    if cfg.nnodes > 1:
        raise ConfigError(
            "ps_placement=auto places the workers of one machine in this version; set nnodes=1 or "
            "place by hand (pipeline_parallel_degree, pipeline_stage_layers, ps_stage_devices)"
        )
    auto = auto_placement(
        model_config_of(cfg),
        load_hetero_cluster(cfg.cluster),
        cfg.max_seq_len,
        cfg.per_device_train_batch_size,
        cfg.gradient_accumulation_steps,
        cfg.ps_stage_workers,
        cfg.ps_servers,
        cfg.ps_target or None,
        seed=cfg.seed,
    )
    if cfg.nproc_per_node not in (1, auto.processes):
        raise ConfigError(
            f"ps_placement=auto needs {auto.processes} processes ({cfg.ps_servers} server(s) + "
            f"{len(auto.stage_layers)} stage(s) x {auto.replicas} worker(s)), but nproc_per_node="
            f"{cfg.nproc_per_node}; drop nproc_per_node (it follows the placement) or set it to "
            f"{auto.processes}"
        )
    return auto
