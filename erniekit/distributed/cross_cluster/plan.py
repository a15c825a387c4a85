"""Cross-cluster planner: step time of one model trained at several sites joined by a slow link,
and the sync interval and compression that keep the link out of the way (docs/cross_cluster.md).

Every site runs the same layout (dp, tp, pp, ...) on its own devices; rank r of one site exchanges
its chunk (its trainable parameters / dp, in local mode with the routers' correction biases when
moe_bias_update_rate > 0 moves them: replica i syncs chunk i) with rank r of every other site,
then the site all-gathers the chunks on its own fast link. Per optimizer step:

  step_s     = intra_s + (sync_s - hidden_s) / H + gather_s / H
  intra_s    = planner.predict's step time of the config's layout on the slowest site
               (or a measured step time: `measured_step_s`)
  sync_s     = latency_s x EXCHANGE_LATENCIES + wire bytes through the narrowest pipe / bandwidth
  wire bytes = link.frame_bytes(payload) (header and MACs added), sent to each other site; when the link is
               shared by the site (a real WAN), all dp x tp x pp ranks' messages cross it, when it is
               per rank pair (the localhost emulation shapes each connection) one rank's do
  gradients  H = 1, payload = 4 x chunk (float32, uncompressed), nothing hidden (the optimizer
               step needs the sum)
  local      H = sync_every, payload = compress.payload_nbytes(kind, chunk, topk_ratio), hidden_s =
               min(sync_s, overlap_steps x intra_s) (the exchange runs behind that many local steps)
  gather_s   the site's all-gather of the dp chunks (ring: (dp-1) x chunk x 4 bytes + latency)

tokens/s = (sites x the site's global batch x seq_len) / step_s. The visible sync fraction is
(step_s - intra_s) / step_s. Paddle is not imported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from erniekit.distributed import planner
from erniekit.distributed.cross_cluster import adaptive
from erniekit.distributed.cross_cluster.compress import payload_nbytes
from erniekit.distributed.cross_cluster.link import frame_bytes
from erniekit.errors import ConfigError

MODES = ("gradients", "local")
KINDS = ("none", "int8", "topk")  # least lossy first: the order recommend() prefers
EXCHANGE_LATENCIES = 1  # an all_gather sends to every peer at once, then receives: one one-way latency
INTERVALS = tuple(2**i for i in range(9))  # 1 .. 256
TAG = "sync"  # a message tag (its size is fixed on the wire)


# ---- the sites file -------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """The wide-area link between every two sites. latency_ms is one way."""

    bandwidth_mbit: float
    latency_ms: float
    per_rank_pair: bool = False  # True: each rank pair has this bandwidth to itself; False: a site's ranks share it

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


@dataclass(frozen=True)
class Site:
    name: str
    cluster: planner.Cluster


@dataclass(frozen=True)
class Sites:
    name: str
    sites: tuple[Site, ...]
    link: Link

    @property
    def world(self) -> int:
        """Devices of one site (every site has as many: they run the same layout)."""
        return self.sites[0].cluster.world


def _number(value, where: str, minimum: float, strict: bool) -> float:
    try:  # YAML reads 1.5e14 (no exponent sign) as a string: accept what float() reads, as load_cluster does
        number = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not math.isfinite(number) or not number >= minimum or (strict and number == minimum):
        raise ConfigError(f"{where}={value!r} must be a finite number {'>' if strict else '>='} {minimum:g}")
    return number


def _unknown(raw: dict, known: tuple[str, ...], where: str) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")


def load_sites(path: str) -> Sites:
    """A sites YAML -> Sites. Format:

    name: two-sites            # optional
    link: {bandwidth_mbit: 100, latency_ms: 50, per_rank_pair: false}
    sites:
      - name: a
        cluster: cpu-2core.yaml          # a cluster file, relative to this file's folder
      - name: b
        cluster: {nodes: 1, devices_per_node: 2, device_flops: 4.8e10, ...}   # or inline
    """
    raw = planner.read_yaml(path, "sites", "give a sites YAML (examples/clusters/two_sites.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sites file is a mapping with link: and sites: (examples/clusters/two_sites.yaml)")
    _unknown(raw, ("name", "link", "sites"), path)
    wan = _link(raw.get("link"), path)
    entries = raw.get("sites")
    if not isinstance(entries, list) or len(entries) < 2:
        raise ConfigError(f"{path}: sites: must be a list of at least 2 sites (got {entries!r})")
    sites: list[Site] = []
    for i, entry in enumerate(entries):
        sites.append(_site(entry, f"{path}: sites[{i}]", os.path.dirname(path), sites))
    return Sites(str(raw.get("name", os.path.splitext(os.path.basename(path))[0])), tuple(sites), wan)


def _link(link, path: str) -> Link:
    if not isinstance(link, dict):
        raise ConfigError(f"{path}: link: must be a mapping {{bandwidth_mbit, latency_ms}} (got {link!r})")
    _unknown(link, ("bandwidth_mbit", "latency_ms", "per_rank_pair"), f"{path}: link")
    for key in ("bandwidth_mbit", "latency_ms"):
        if key not in link:
            raise ConfigError(f"{path}: link.{key} is missing")
    pair = link.get("per_rank_pair", False)
    if not isinstance(pair, bool):
        raise ConfigError(f"{path}: link.per_rank_pair={pair!r} must be true or false")
    return Link(
        _number(link["bandwidth_mbit"], f"{path}: link.bandwidth_mbit", 0, strict=True),
        _number(link["latency_ms"], f"{path}: link.latency_ms", 0, strict=False),
        pair,
    )


def _site(entry, where: str, base: str, before: list[Site]) -> Site:
    """One entry of sites: (its cluster path relative to the sites file's folder `base`)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping with name: and cluster:")
    _unknown(entry, ("name", "cluster"), where)
    name, cluster = entry.get("name"), entry.get("cluster")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name is missing or not a string")
    if name in (s.name for s in before):
        raise ConfigError(f"{where}.name={name!r} is used twice; give each site its own name")
    if isinstance(cluster, str):
        try:
            c = planner.load_cluster(os.path.join(base, cluster))
        except ConfigError as e:
            raise ConfigError(f"{where}.cluster: {e}") from None
    elif isinstance(cluster, dict):
        c = planner.cluster_from_mapping(cluster, f"{where}.cluster")
    else:
        raise ConfigError(f"{where}.cluster must be a cluster file path or an inline cluster mapping")
    if before and c.world != before[0].cluster.world:
        raise ConfigError(
            f"{where}.cluster has {c.world} devices, site {before[0].name!r} {before[0].cluster.world}; every "
            "site runs the same layout, so give each the same nodes x devices_per_node"
        )
    return Site(name, c)


# ---- what each site trains -----------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """What every site trains per optimizer step: the model config, one site's workload, the layout,
    and the parameters of one rank a sync moves: the trainable ones, and in local mode the frozen
    ones each site moves on its own."""

    model: object  # Ernie4_5Config
    work: planner.Workload  # one site's global batch x seq_len
    plan: planner.Plan
    rank_trainable: int
    # the routers' e_score_correction_bias on one rank when moe_bias_update_rate > 0: never trained, but
    # each site moves them by its own loads, so the runner's local sync averages them too
    rank_frozen_synced: int = 0

    def synced(self, mode: str) -> int:
        """Elements one rank syncs: its trainable parameters (gradients: their gradients), and in
        local mode the frozen ones the sites move apart (erniekit/train/runners/cross_cluster.py
        `_synced_tensors`)."""
        return self.rank_trainable + (self.rank_frozen_synced if mode == "local" else 0)


def job_from_config(cfg, cluster: planner.Cluster) -> Job:
    """The config's layout on a site's devices (its degrees; data_parallel_degree -1 = the rest)."""
    from erniekit.distributed.collective.layout import layout_from_config

    lay = layout_from_config(cfg.parallelism, cluster.world)
    c = planner.model_config_of(cfg)
    rc = cfg.recompute_granularity if cfg.recompute else "none"
    dp = lay.dp * lay.sharding
    p = planner.Plan(
        dp,
        lay.tp,
        lay.pp,
        lay.ep,
        lay.sharding_stage,
        rc,
        cfg.per_device_train_batch_size,
        cfg.gradient_accumulation_steps,
    )
    work = planner.workload_from_config(cfg, cluster.world, cluster.device, model=c)
    # what one rank trains and so syncs: its share of every parameter, or with LoRA of the adapters
    # (the planner's count of what apply_lora builds for lora_target_modules; erniekit/distributed/lora_cost.py)
    trainable = round(planner.predict(c, cluster, work, p).parts["trainable_params"])
    return Job(c, work, p, trainable, _frozen_synced(c, p))


def _frozen_synced(c, p: planner.Plan) -> int:
    """The routers' correction biases one rank holds (whole over tp and ep, its pipeline stage's share)
    when moe_bias_update_rate > 0 moves them during training; 0 otherwise."""
    if getattr(c, "moe_bias_update_rate", 0.0) <= 0:
        return 0
    return round(planner.param_counts(c).frozen / p.pp)


# ---- the prediction -------------------------------------------------------------------------
@dataclass
class CrossPrediction:
    mode: str
    sync_every: int
    compress: str  # none / int8 / topk (gradients: none)
    topk_ratio: float
    overlap_steps: int
    intra_s: float  # the slowest site's own step
    sync_s: float  # one exchange, wall time
    hidden_s: float  # of sync_s, what runs behind local steps
    gather_s: float  # the site's all-gather of the chunks after an exchange
    step_s: float  # mean optimizer step, sync included
    chunk: int  # elements one rank syncs
    payload_bytes: int  # one message's payload
    bytes_per_step: float  # wire bytes one rank sends per step (to all other sites)
    site_bytes_per_step: float  # wire bytes a site sends per step
    tokens_per_s: float  # all sites together
    slowest_site: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def sync_fraction(self) -> float:
        """Share of the step spent visibly waiting on the cross-cluster sync."""
        return (self.step_s - self.intra_s) / self.step_s

    def describe(self) -> str:
        if self.mode == "gradients":
            return "gradients every step"
        kind = f"topk {self.topk_ratio:g}" if self.compress == "topk" else self.compress
        return f"local every {self.sync_every}, {kind}" + (
            f", overlap {self.overlap_steps}" if self.overlap_steps else ""
        )


def exchange_s(payload: int, sites: Sites, ranks: int) -> float:
    """Wall time of one exchange: each of `ranks` ranks of a site sends `payload` bytes to the same
    rank of every other site at once (duplex: receiving runs beside sending)."""
    peers = len(sites.sites) - 1
    wire = frame_bytes(TAG, payload)
    through = wire if sites.link.per_rank_pair else wire * peers * ranks  # the narrowest pipe's load
    return EXCHANGE_LATENCIES * sites.link.latency_s + through / sites.link.bandwidth_bytes_s


def gather_s(cluster: planner.Cluster, plan: planner.Plan, chunk: int) -> float:
    """The site's ring all-gather of dp chunks of `chunk` float32 elements."""
    if plan.dp <= 1:
        return 0.0
    span = plan.tp * plan.dp > cluster.devices_per_node
    bw = cluster.inter_node_bandwidth if span else cluster.intra_node_bandwidth
    lat = cluster.inter_node_latency_s if span else cluster.intra_node_latency_s
    return lat + (plan.dp - 1) * chunk * planner.BYTES / bw


def _job(job, sites: Sites) -> Job:
    return job if isinstance(job, Job) else job_from_config(job, sites.sites[0].cluster)


# the runner (erniekit/train/runners/cross_cluster.py) and the plan refuse the same combination
BIASES_WITH_GRADIENTS = (
    "moe_bias_update_rate > 0 with cross_cluster_sync=gradients: each cluster would move its router "
    "biases by its own rows' loads; use cross_cluster_sync=local (they are averaged at each sync) "
    "or model_overrides.moe_bias_update_rate=0"
)


def _check_sync(mode: str, sync_every: int, compress: str, overlap_steps: int, measured_step_s: float | None) -> None:
    if mode not in MODES:
        raise ConfigError(f"cross_cluster_sync={mode!r}: use one of {', '.join(MODES)}")
    if compress not in KINDS:
        raise ConfigError(f"cross_cluster_compress={compress!r}: use one of {', '.join(KINDS + ('adaptive',))}")
    if mode == "local" and (not isinstance(sync_every, int) or sync_every < 1):
        raise ConfigError(f"cross_cluster_sync_every={sync_every!r} must be an integer >= 1")
    if mode == "local" and not 0 <= overlap_steps <= sync_every:
        raise ConfigError(
            f"cross_cluster_overlap_steps={overlap_steps} must be in [0, cross_cluster_sync_every={sync_every}]"
        )
    if measured_step_s is not None and measured_step_s <= 0:
        raise ConfigError(f"measured step time {measured_step_s!r} s must be > 0")


def predict_cross_cluster(
    job,
    sites: Sites,
    sync_every: int = 1,
    compress: str = "none",
    topk_ratio: float = 0.1,
    mode: str = "local",
    overlap_steps: int = 0,
    measured_step_s: float | None = None,
    max_sync_fraction: float = 0.1,
) -> CrossPrediction:
    """The step of `job` (a training config or a Job) on `sites` with this sync (module docstring).
    measured_step_s replaces the predicted intra-cluster step (calibration with a measured run);
    compress="adaptive" predicts what the run's adaptive choice picks (adaptive_choice)."""
    job = _job(job, sites)
    if compress == "adaptive":
        if mode != "local":
            raise ConfigError("cross_cluster_compress=adaptive works with cross_cluster_sync=local only")
        c = adaptive_choice(job, sites, max_sync_fraction, topk_ratio, overlap_steps, measured_step_s)
        return predict_cross_cluster(job, sites, c.interval, c.kind, topk_ratio, mode, overlap_steps, measured_step_s)
    _check_sync(mode, sync_every, compress, overlap_steps, measured_step_s)
    if mode == "gradients" and job.rank_frozen_synced:  # set when moe_bias_update_rate > 0
        raise ConfigError(BIASES_WITH_GRADIENTS)
    preds = {s.name: planner.predict(job.model, s.cluster, job.work, job.plan) for s in sites.sites}
    slowest = max(sites.sites, key=lambda s: preds[s.name].step_s)
    intra = measured_step_s if measured_step_s is not None else preds[slowest.name].step_s
    p = job.plan
    chunk = math.ceil(job.synced(mode) / p.dp)
    if mode == "gradients":
        H, overlap, kind, payload = 1, 0, "none", planner.BYTES * chunk
    else:
        H, overlap, kind, payload = sync_every, overlap_steps, compress, payload_nbytes(compress, chunk, topk_ratio)
    sync = exchange_s(payload, sites, p.dp * p.tp * p.pp)
    hidden = min(sync, overlap * intra)
    gather = max(gather_s(s.cluster, p, chunk) for s in sites.sites)
    step = intra + (sync - hidden + gather) / H
    per_rank = frame_bytes(TAG, payload) * (len(sites.sites) - 1) / H
    tokens = len(sites.sites) * job.work.global_batch * job.work.seq_len
    return CrossPrediction(
        mode=mode,
        sync_every=H,
        compress=kind,
        topk_ratio=topk_ratio,
        overlap_steps=overlap,
        intra_s=intra,
        sync_s=sync,
        hidden_s=hidden,
        gather_s=gather,
        step_s=step,
        chunk=chunk,
        payload_bytes=payload,
        bytes_per_step=per_rank,
        site_bytes_per_step=per_rank * p.dp * p.tp * p.pp,
        tokens_per_s=tokens / step,
        slowest_site=slowest.name,
        parts={"predicted_intra_s": preds[slowest.name].step_s, "ranks_per_site": p.dp * p.tp * p.pp},
    )


def adaptive_choice(
    job,
    sites: Sites,
    max_sync_fraction: float,
    topk_ratio: float,
    overlap_steps: int,
    measured_step_s: float | None = None,
) -> adaptive.Choice:
    """What cross_cluster_compress=adaptive picks at run time (adaptive.choose) when it measures this
    link and the predicted (or measured) step of the slowest site without the sync."""
    job = _job(job, sites)
    plain = predict_cross_cluster(job, sites, 1, "none", topk_ratio, "local", 0, measured_step_s)
    ranks = 1 if sites.link.per_rank_pair else plain.parts["ranks_per_site"]
    return adaptive.choose(
        plain.intra_s,
        plain.chunk,
        sites.link.bandwidth_bytes_s / ranks,
        sites.link.latency_s,
        max_sync_fraction,
        overlap_steps,
        topk_ratio=topk_ratio,
        n_clusters=len(sites.sites),
    )


# ---- the recommendation ---------------------------------------------------------------------
@dataclass
class Recommendation:
    target: str  # what was asked, in words
    choice: CrossPrediction | None  # the smallest interval, then the least lossy compression, meeting it
    table: list[CrossPrediction]  # gradients every step, then every interval x compression
    why: str = ""  # when nothing meets the target


def recommend(
    job,
    sites: Sites,
    max_sync_fraction: float | None = 0.1,
    tokens_per_s: float | None = None,
    topk_ratio: float = 0.1,
    overlap_steps: int = 0,
    measured_step_s: float | None = None,
    intervals: tuple[int, ...] = INTERVALS,
    kinds: tuple[str, ...] = KINDS,
) -> Recommendation:
    """The local-SGD interval and compression to use: the smallest interval, then the least lossy
    compression (none < int8 < topk), whose prediction spends at most max_sync_fraction of the step
    visibly syncing, or (tokens_per_s given) trains at least that many tokens/s."""
    if (max_sync_fraction is None) == (tokens_per_s is None):
        raise ConfigError("recommend needs one target: a max sync fraction or a tokens/s target")
    if max_sync_fraction is not None and not 0 < max_sync_fraction < 1:
        raise ConfigError(f"cross_cluster_max_sync_fraction={max_sync_fraction!r} must be in (0, 1)")
    if tokens_per_s is not None and tokens_per_s <= 0:
        raise ConfigError(f"tokens/s target {tokens_per_s!r} must be > 0")
    job = _job(job, sites)
    kw = dict(topk_ratio=topk_ratio, measured_step_s=measured_step_s)
    # gradients mode first, for comparison; not with router biases that move (BIASES_WITH_GRADIENTS)
    table = [] if job.rank_frozen_synced else [predict_cross_cluster(job, sites, mode="gradients", **kw)]
    first_local = len(table)
    for h in sorted(intervals):
        for kind in [k for k in KINDS if k in kinds]:
            table.append(predict_cross_cluster(job, sites, h, kind, overlap_steps=min(overlap_steps, h), **kw))
    if tokens_per_s is not None:
        target = f"at least {tokens_per_s:.0f} tokens/s"
        meets = [r for r in table[first_local:] if r.tokens_per_s >= tokens_per_s]
    else:
        target = f"visible sync at most {max_sync_fraction:.0%} of the step"
        meets = [r for r in table[first_local:] if r.sync_fraction <= max_sync_fraction]
    if meets:  # as the adaptive run chooses: a dense codec at any interval before top-k
        return Recommendation(target, min(meets, key=lambda r: r.compress == "topk"), table)
    best = max(table, key=lambda r: r.tokens_per_s)
    why = (
        f"no interval up to {max(intervals)} meets {target} on {sites.name} (best: {best.describe()}, "
        f"{best.sync_fraction:.0%} syncing, {best.tokens_per_s:.0f} tokens/s); allow more overlap, topk, or a lower target"
    )
    return Recommendation(target, None, table, why)


def format_table(rec: Recommendation) -> str:
    """The recommendation's alternatives as a text table; `*` marks the choice."""
    head = (
        f"    {'sync':32s} {'step s':>9} {'intra s':>9} {'sync s':>8} {'syncing':>8} {'tok/s':>9} {'KB/step/rank':>13}"
    )
    rows = [head, "-" * len(head)]
    for r in rec.table:
        mark = "*" if r is rec.choice else " "
        rows.append(
            f"  {mark} {r.describe():32s} {r.step_s:9.4f} {r.intra_s:9.4f} {r.sync_s:8.3f} {r.sync_fraction:8.1%} "
            f"{r.tokens_per_s:9.0f} {r.bytes_per_step / 1e3:13.1f}"
        )
    return "\n".join(rows)


def config_sync(cfg) -> dict:
    """The cross_cluster_* keys of a training config, as predict_cross_cluster's arguments (read with
    the schema's defaults, so the planner also reads configs of a schema without them)."""
    return {
        "mode": getattr(cfg, "cross_cluster_sync", "local"),
        "sync_every": getattr(cfg, "cross_cluster_sync_every", 16),
        "compress": getattr(cfg, "cross_cluster_compress", "int8"),
        "topk_ratio": getattr(cfg, "cross_cluster_topk_ratio", 0.1),
        "overlap_steps": getattr(cfg, "cross_cluster_overlap_steps", 0),
        "max_sync_fraction": getattr(cfg, "cross_cluster_max_sync_fraction", 0.1),
    }
