"""Config checks of training across clusters (docs/cross_cluster.md), before any process starts."""

from __future__ import annotations

from erniekit.errors import ConfigError

MAX_TIMEOUT_S = 1e8  # a longer wait overflows the platform's clock in queue.get / Thread.join


def normalise_cross_cluster(cfg) -> dict:
    """cross_cluster_sizes on one machine: every cluster runs the layout of its size (the parent's
    own degree checks then see a cluster's process count)."""
    sizes = list(cfg.cross_cluster_sizes)
    if not sizes or cfg.cross_cluster_id >= 0:
        return {}
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"cross_cluster_sizes={sizes}: give each cluster's process count, >= 1")
    if len(set(sizes)) != 1:
        raise ConfigError(
            f"cross_cluster_sizes={sizes}: every cluster runs the same layout (rank r syncs with rank r of the "
            "others); give the clusters the same process count"
        )
    if cfg.nproc_per_node not in (1, sizes[0]):
        raise ConfigError(
            f"nproc_per_node={cfg.nproc_per_node} with cross_cluster_sizes={sizes}: the processes of each cluster "
            f"come from cross_cluster_sizes; drop nproc_per_node or set it to {sizes[0]}"
        )
    return {"nproc_per_node": sizes[0]}


def check_cross_cluster(cfg, supports) -> None:
    """supports: the stage's Supports. Every collective layout runs inside a cluster unchanged."""
    sites = cfg.cross_cluster_id >= 0 or bool(cfg.cross_cluster_peers)
    if not cfg.cross_cluster_sizes and not sites:
        return
    if cfg.cross_cluster_sizes and len(cfg.cross_cluster_sizes) < 2:
        raise ConfigError(f"cross_cluster_sizes={list(cfg.cross_cluster_sizes)}: name at least 2 clusters")
    if sites:
        peers = list(cfg.cross_cluster_peers)
        if len(peers) < 2:
            raise ConfigError(
                f"cross_cluster_peers={peers}: give host:port of every cluster's link in cluster order (at least 2)"
            )
        if not 0 <= cfg.cross_cluster_id < len(peers):
            raise ConfigError(
                f"cross_cluster_id={cfg.cross_cluster_id}: set this site's index in cross_cluster_peers (0 to "
                f"{len(peers) - 1})"
            )
        from erniekit.distributed.cross_cluster.link import parse_address

        _check_ports([parse_address(p, f"cross_cluster_peers[{i}]") for i, p in enumerate(peers)], peers, cfg)
        from erniekit.distributed.cross_cluster.auth import load_key

        load_key(cfg.cross_cluster_key_file)  # a missing or short key stops here, not at the first sync
    _range(cfg.cross_cluster_sync_every >= 1, "cross_cluster_sync_every", cfg.cross_cluster_sync_every, ">= 1")
    _range(cfg.cross_cluster_overlap_steps >= 0, "cross_cluster_overlap_steps", cfg.cross_cluster_overlap_steps, ">= 0")
    if cfg.cross_cluster_sync == "local" and cfg.cross_cluster_overlap_steps >= cfg.cross_cluster_sync_every:
        raise ConfigError(
            f"cross_cluster_overlap_steps={cfg.cross_cluster_overlap_steps}: a sync must land before the next one "
            f"starts; set it below cross_cluster_sync_every={cfg.cross_cluster_sync_every}"
        )
    ratio = cfg.cross_cluster_topk_ratio
    _range(0 < ratio <= 1, "cross_cluster_topk_ratio", ratio, "in (0, 1]")
    _range(cfg.cross_cluster_outer_lr > 0, "cross_cluster_outer_lr", cfg.cross_cluster_outer_lr, "> 0")
    mom = cfg.cross_cluster_outer_momentum
    _range(0 <= mom < 1, "cross_cluster_outer_momentum", mom, "in [0, 1)")
    frac = cfg.cross_cluster_max_sync_fraction
    _range(0 < frac <= 1, "cross_cluster_max_sync_fraction", frac, "in (0, 1]")
    _range(cfg.cross_cluster_link_mbit >= 0, "cross_cluster_link_mbit", cfg.cross_cluster_link_mbit, ">= 0")
    lat = cfg.cross_cluster_link_latency_ms
    _range(lat >= 0, "cross_cluster_link_latency_ms", lat, ">= 0")
    t = cfg.cross_cluster_timeout_s  # Python's waits overflow past ~1e9 s
    _range(0 < t <= MAX_TIMEOUT_S, "cross_cluster_timeout_s", t, f"in (0, {MAX_TIMEOUT_S:g}] seconds")
    if 0 < cfg.save_total_limit < 2:
        raise ConfigError(
            f"save_total_limit={cfg.save_total_limit} with clusters: a cluster may stop while writing its newest "
            "checkpoint, so the others must keep the one before it; set save_total_limit >= 2 (or 0: keep all)"
        )
    if cfg.distributed_mode == "ps":
        raise ConfigError(
            "distributed_mode=ps with cross-cluster training: a cluster runs the collective layouts in this version; "
            "set distributed_mode=collective"
        )
    if supports.rollouts:
        raise ConfigError(
            f"stage {cfg.stage} with cross-cluster training: RL stages sample rollouts per step, not run across "
            "clusters in this version; use an SFT, pretrain, DPO or Distill stage"
        )
    if cfg.online_distill_students or cfg.fp16:
        raise ConfigError(
            "cross-cluster training syncs one model's trainable parameters with float32 steps; drop "
            "online_distill_students and fp16"
        )


def _range(ok: bool, key: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: must be {rule}")


def _check_ports(where: list[tuple[str, int]], peers: list[str], cfg) -> None:
    """Rank r of cluster c listens on port_c + r: every port must exist, and two clusters that listen
    (all but the last) on one host must not share a port (the second could not listen, or a higher
    cluster would reach the wrong rank)."""
    ranks = max(1, cfg.nproc_per_node) * max(1, cfg.nnodes)
    for i, (_, port) in enumerate(where):
        if port + ranks - 1 > 65535:
            raise ConfigError(
                f"cross_cluster_peers[{i}]={peers[i]}: its {ranks} ranks listen on ports {port}..{port + ranks - 1}, "
                f"past 65535; use a base port of at most {65536 - ranks}"
            )
    for i in range(len(where) - 1):
        for j in range(i + 1, len(where) - 1):
            (hi, pi), (hj, pj) = where[i], where[j]
            if hi == hj and pi < pj + ranks and pj < pi + ranks:
                raise ConfigError(
                    f"cross_cluster_peers[{i}]={peers[i]} and [{j}]={peers[j]}: both clusters listen on ports "
                    f"{ranks} wide from there on one host, and the ranges overlap; give them base ports at least "
                    f"{ranks} apart"
                )
