"""Cost model of a heterogeneous placement (Paddle-HeterPS): which device type runs each part of
the model, how many devices each stage gets, the throughput that gives and what it costs.

The model is a chain of parts: the embedding table, the decoder layers, the LM head (with its
loss). A placement gives each part a device type, optionally marked `*` to start a new stage;
consecutive parts on one type form a stage unless a `*` cuts it (so several GPU stages can follow
each other, each all-reducing only its own parameters), and stages form a pipeline over
micro-batches. A stage of n devices splits its batch n ways (data
parallel) and all-reduces its parameters' gradients; between stages the activations (and their
gradients) cross the slower of the two types' links. So, per global batch:

    stage time   = (FLOPs / flops_t + memory traffic / membw_t) / n + 2 (n-1)/n * grad bytes / bw_t
                   (a row-sharded table, as on parameter servers, is split over the n devices and
                   not all-reduced: its rows are pulled and pushed)
    link time    = 2 * activation bytes / min(bw_a, bw_b)
    batch time   = max over stages and links            (the pipeline's steady state)
    throughput   = tokens per batch / batch time
    cost / batch = batch time * sum over stages of n * price_t / 3600

Each stage gets the fewest devices that meet the throughput target (its time falls with n until
the all-reduce dominates); a placement is feasible when every stage meets the target, fits a
device's memory (parameters, gradients, moments and its share of activations), and the device
counts of every type suffice. The objective: least cost per batch, subject to throughput >= target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from erniekit.errors import ConfigError

BYTES = 4  # float32
STATE = 4  # parameter, gradient and two AdamW moments per parameter


@dataclass(frozen=True)
class DeviceType:
    name: str
    count: int
    flops: float  # achieved FLOP/s of one device
    memory: float  # bytes
    bandwidth: float  # bytes/s of its network link
    price_per_hour: float
    memory_bandwidth: float = 1e11  # bytes/s, for memory-bound parts (a table lookup)
    device: str = "cpu"  # what a worker of this type runs on (cpu or gpu): ps_placement auto's stage devices


@dataclass(frozen=True)
class Part:
    """One placeable part of the model, per token: FLOPs (forward + backward), bytes it touches."""

    name: str
    flops: float
    params: int
    activation: float  # floats per token sent to the next part (hidden size)
    saved: float  # floats per token kept for the backward
    memory_traffic: float = 0.0  # bytes per token of memory-bound work
    sharded: bool = False  # a row-sharded table (parameter-server style): split over the stage's
    # devices, no all-reduce (rows are pulled and pushed), not replicated like a data-parallel stage


@dataclass
class HeteroCluster:
    types: list[DeviceType]
    name: str = "hetero"

    def type(self, name: str) -> DeviceType:
        for t in self.types:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass
class Evaluation:
    feasible: bool
    cost_per_batch: float  # dollars; inf when infeasible
    throughput: float  # tokens/s
    devices: dict[str, int] = field(default_factory=dict)  # per type
    stages: list[tuple[str, list[str], int]] = field(default_factory=list)  # (type, parts, devices)
    why: str = ""
    shortfall: float = 0.0  # how far from feasible (0 when feasible): for the scheduler's penalty


def model_parts(config, seq_len: int) -> list[Part]:
    """The chain embedding, layers, head of an Ernie4_5Config (FLOPs from the planner's layer
    costs; attention's per-position part at `seq_len`). A tied table is counted on both ends: the
    head needs the whole table wherever it runs."""
    from erniekit.distributed.planner import layer_costs

    H, V = config.hidden_size, config.vocab_size
    parts = [
        Part("embedding", flops=0.0, params=V * H, activation=H, saved=0.0, memory_traffic=2 * BYTES * H, sharded=True)
    ]
    for i, lc in enumerate(layer_costs(config)):
        fwd = lc.attn_flops + lc.mlp_flops + lc.core_flops_per_s * seq_len
        parts.append(
            Part(
                f"layer{i}",
                flops=3 * fwd,
                params=lc.attn_params + lc.mlp_params,
                activation=H,
                saved=lc.attn_saved + lc.mlp_saved + lc.other_saved + lc.core_saved_per_s * seq_len,
            )
        )
    parts.append(Part("head", flops=3 * 2.0 * H * V, params=V * H, activation=0.0, saved=float(V)))
    return parts


class PlacementProblem:
    """Parts, cluster, batch and target together; `evaluate` is O(stages) (prefix sums and a
    closed form for each stage's device count), so schedulers can score many placements."""

    def __init__(self, parts: list[Part], cluster: HeteroCluster, tokens: int, target: float, replicas: int = 0):
        """replicas > 0: every stage has exactly that many devices (the PS workers' pipeline runs
        `replicas` data-parallel copies of itself, ps_stage_workers) instead of the fewest that
        meet the target."""
        if target <= 0:
            raise ConfigError(f"throughput target {target} must be positive (tokens/s)")
        self.parts, self.cluster, self.tokens, self.target = parts, cluster, tokens, target
        self.replicas = replicas
        self.base_names = [t.name for t in cluster.types]
        # the choices per part: a type, or a type that starts a new stage (`gpu*`)
        self.type_names = self.base_names + [n + "*" for n in self.base_names]
        self.budget = tokens / target  # seconds a batch may take
        acc = {"flops": [0.0], "traffic": [0.0], "params": [0.0], "table": [0.0], "saved": [0.0]}
        for p in parts:
            acc["flops"].append(acc["flops"][-1] + p.flops * tokens)
            acc["traffic"].append(acc["traffic"][-1] + p.memory_traffic * tokens)
            acc["params"].append(acc["params"][-1] + (0 if p.sharded else p.params))
            acc["table"].append(acc["table"][-1] + (p.params if p.sharded else 0))
            acc["saved"].append(acc["saved"][-1] + p.saved * tokens)
        self.acc = acc
        # the most any feasible placement can cost: every device busy for the whole budget
        self.max_cost = self.budget * sum(t.count * t.price_per_hour for t in cluster.types) / 3600
        self._stage_cache: dict[tuple[str, int, int], tuple[int | None, float, float]] = {}

    def _sum(self, key: str, i: int, j: int) -> float:
        return self.acc[key][j] - self.acc[key][i]

    def stage(self, tname: str, i: int, j: int) -> tuple[int | None, float, float]:
        """Parts [i, j) on type tname -> (fewest devices meeting the budget and fitting memory, or
        None; its time at that count (or at its best count); shortfall when None)."""
        key = (tname, i, j)
        if key in self._stage_cache:
            return self._stage_cache[key]
        t = self.cluster.type(tname)
        A = self._sum("flops", i, j) / t.flops + self._sum("traffic", i, j) / t.memory_bandwidth
        C = 2 * BYTES * self._sum("params", i, j) / t.bandwidth  # the ring all-reduce's limit for large n
        fixed = STATE * BYTES * self._sum("params", i, j)  # replicated on each device
        act = BYTES * self._sum("saved", i, j) + STATE * BYTES * self._sum("table", i, j)  # split n ways

        def time(n: int) -> float:
            return A / n + (C * (n - 1) / n if n > 1 else 0.0)

        if fixed >= t.memory:
            out = (None, time(self.replicas or 1), 10.0)
        elif self.replicas:
            n = self.replicas
            if act / n > t.memory - fixed:
                out = (None, time(n), 10.0)
            elif time(n) > self.budget:
                out = (None, time(n), time(n) / self.budget - 1.0)
            else:  # the type's device count is checked over all stages in `evaluate`
                out = (n, time(n), 0.0)
        else:
            n_mem = max(1, math.ceil(act / (t.memory - fixed)))
            if time(n_mem) <= self.budget:
                n = n_mem
            elif A > C and self.budget > C:  # time falls with n towards C
                n = max(n_mem, math.ceil((A - C) / (self.budget - C) - 1e-12))
                while time(n) > self.budget:  # rounding
                    n += 1
            else:
                n = None
            if n is not None and n <= t.count:
                out = (n, time(n), 0.0)
            else:  # the best it can do with what the cluster has
                best = min(time(k) for k in {max(n_mem, 1), t.count} if k <= t.count) if n_mem <= t.count else math.inf
                out = (None, best, (best / self.budget - 1.0) if best < math.inf else 10.0)
        self._stage_cache[key] = out
        return out

    def evaluate(self, placement) -> Evaluation:
        """Cost and throughput of `placement` (a device-type name per part) at the least devices
        that meet the target."""
        bounds, start = [], 0
        base = [t.rstrip("*") for t in placement]
        for k in range(1, len(placement) + 1):
            if k == len(placement) or base[k] != base[start] or placement[k].endswith("*"):
                bounds.append((base[start], start, k))
                start = k
        used: dict[str, int] = {}
        plan, worst, shortfall, why = [], 0.0, 0.0, ""
        for tname, i, j in bounds:
            n, time, short = self.stage(tname, i, j)
            names = [p.name for p in self.parts[i:j]]
            if n is None:
                shortfall += max(short, 1e-9)
                why = why or (
                    f"stage {names[0]}..{names[-1]} on {tname} cannot meet the target"
                    if short < 10.0
                    else f"stage {names[0]}..{names[-1]} does not fit one {tname} device's memory"
                )
                n = self.cluster.type(tname).count
            used[tname] = used.get(tname, 0) + n
            worst = max(worst, time)
            plan.append((tname, names, n))
        for (ta, _, j), (tb, _, _) in zip(bounds, bounds[1:]):
            bw = min(self.cluster.type(ta).bandwidth, self.cluster.type(tb).bandwidth)
            link = 2 * BYTES * self.tokens * self.parts[j - 1].activation / bw
            worst = max(worst, link)
            if link > self.budget:
                shortfall += link / self.budget - 1.0
                why = why or f"the link {ta} -> {tb} after {self.parts[j - 1].name} cannot meet the target"
        for tname, n in used.items():
            have = self.cluster.type(tname).count
            if n > have:
                shortfall += (n - have) / have
                why = why or f"needs {n} {tname} devices, the cluster has {have}"
        throughput = self.tokens / worst if worst > 0 else math.inf
        feasible = shortfall == 0.0
        cost = worst * sum(n * self.cluster.type(t).price_per_hour for t, _, n in plan) / 3600 if feasible else math.inf
        return Evaluation(feasible, cost, throughput, used, plan, why, shortfall)


def load_hetero_cluster(path: str) -> HeteroCluster:
    """A cluster YAML with a `device_types` list (name, count, flops, memory, bandwidth,
    price_per_hour, memory_bandwidth, device) -> HeteroCluster; one-line errors name file and key."""
    from erniekit.distributed.planner import read_yaml

    raw = read_yaml(path, "cluster", "give a cluster file such as examples/clusters/hetero-cpu-gpu.yaml")
    if not isinstance(raw, dict) or not isinstance(raw.get("device_types"), list) or not raw["device_types"]:
        raise ConfigError(
            f"{path}: a heterogeneous cluster file needs a non-empty device_types list "
            "(see examples/clusters/hetero-cpu-gpu.yaml)"
        )
    types = []
    need = ("name", "count", "flops", "memory", "bandwidth", "price_per_hour")
    for i, d in enumerate(raw["device_types"]):
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: device_types[{i}] must be a mapping with keys {', '.join(need)}")
        missing = [k for k in need if k not in d]
        if missing:
            raise ConfigError(f"{path}: device_types[{i}] lacks {missing[0]}")
        extra = set(d) - set(need) - {"memory_bandwidth", "device"}
        if extra:
            raise ConfigError(f"{path}: device_types[{i}] has unknown key {sorted(extra)[0]}")
        for k in need[1:] + ("memory_bandwidth",):
            if isinstance(d.get(k), str):  # YAML 1.1 reads 1.0e12 (no exponent sign) as a string
                try:
                    d[k] = float(d[k])
                except ValueError:
                    pass
        for k in need[1:]:
            if not isinstance(d[k], (int, float)) or isinstance(d[k], bool) or not 0 < d[k] < math.inf:
                raise ConfigError(f"{path}: device_types[{i}].{k}={d[k]!r} must be a positive finite number")
        if d["count"] != int(d["count"]) or d["count"] > 2**20:  # the collective planner's bound too
            raise ConfigError(f"{path}: device_types[{i}].count={d['count']!r} must be a whole number up to 2**20")
        device = str(d.get("device", "cpu")).lower()
        if device not in ("cpu", "gpu"):
            raise ConfigError(f"{path}: device_types[{i}].device={d['device']!r} must be cpu or gpu")
        types.append(
            DeviceType(
                str(d["name"]),
                int(d["count"]),
                float(d["flops"]),
                float(d["memory"]),
                float(d["bandwidth"]),
                float(d["price_per_hour"]),
                float(d.get("memory_bandwidth", 1e11)),
                device,
            )
        )
    if len({t.name for t in types}) != len(types):
        raise ConfigError(f"{path}: device type names must be unique")
    return HeteroCluster(types, str(raw.get("name", path)))
