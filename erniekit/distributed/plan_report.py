"""`erniekit plan`: what the planners predict for a training config on a described cluster,
printed as a table and optionally written as JSON (docs/planner.md, docs/ps.md)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os

from erniekit.errors import ErniekitError

# the parallel degrees and process counts train checks (config/checks.py: _check_parallel)


def load_checked_config(path: str | None, overrides: list[str]):
    """The training config (as loaded), after the value checks `erniekit train` runs on it: finite
    numbers and every key's range (batch sizes, accumulation, max_seq_len >= 8, ...) and the parallel
    degrees >= 1; one-line ConfigError naming the key.

    Not `erniekit.config.validate`: that also wants the dataset files, the checkpoint and output_dir
    on this machine (it probes output_dir by creating a directory there), refuses bf16 without a
    local GPU and resolves `parallel: auto` against the launch's process count; a plan reads none of
    the files and may describe another machine (a laptop planning a GPU cluster)."""
    from erniekit.config import checks, load_config

    cfg = load_config(path, overrides)
    checks.check_values(_normalised(cfg))  # the device- and file-independent part of checks.check
    return cfg


def _normalised(cfg):
    """A normalised copy (canonical spellings, typed lists), as the checks read it; dataset_dir names
    a directory of data the plan does not read, which normalising would require to exist here."""
    from erniekit.config import checks

    return checks.normalise(dataclasses.replace(cfg, dataset_dir=None))


def _check_top(top: int) -> None:
    if top < 1:
        raise ErniekitError(f"plan: --top {top} must be >= 1 (the number of rows to print)")


def _check_json_path(json_path: str | None) -> None:
    """Refuse a --json path that cannot be written before anything is computed or printed."""
    if json_path is None:
        return
    if os.path.isdir(json_path):
        raise ErniekitError(
            f"plan --json {json_path}: is a directory; give a file path, e.g. {os.path.join(json_path, 'plans.json')}"
        )
    parent = os.path.dirname(os.path.abspath(json_path))
    if not os.path.isdir(parent):
        raise ErniekitError(
            f"plan --json {json_path}: directory {parent} does not exist; create it or give another path"
        )


def _write_json(json_path: str, obj: object) -> None:
    try:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
    except OSError as e:
        raise ErniekitError(f"plan --json {json_path}: {e.strerror}; give a writable file path") from None


def collective_plan(path: str | None, overrides: list[str], top: int, include_all: bool, json_path: str | None) -> int:
    """Rank the data / tensor / expert / pipeline / sharding layouts; exit status 0 when a layout fits
    and `erniekit train` runs it, else 1, with or without --all."""
    from erniekit.distributed import planner

    _check_top(top)
    _check_json_path(json_path)
    cfg = load_checked_config(path, overrides)
    if not cfg.cluster:
        raise ErniekitError("plan needs cluster=FILE, a cluster description (see examples/clusters/)")
    cluster = planner.load_cluster(cfg.cluster)
    c = planner.model_config_of(cfg)
    # the config's global batch on the cluster's devices, as their kind runs it
    work = planner.workload_from_config(cfg, cluster.world, cluster.device, model=c)
    # every layout, each marked with the reason `erniekit train` would refuse it for this config on
    # the cluster's device kind (the check train runs): left out unless --all
    refusal = planner.config_refusal(_normalised(cfg), cluster.device)
    preds = [dataclasses.replace(r, refused=refusal(r.plan)) for r in planner.plan(c, cluster, work)]
    refused = [r for r in preds if r.refused]
    runnable = any(r.fits and not r.refused for r in preds)
    if not include_all:
        preds = [r for r in preds if not r.refused]
    print(
        f"model {cfg.model_name_or_path}: {c.num_hidden_layers} layers, hidden {c.hidden_size}"
        f"{f', {c.moe_num_experts} experts top-{c.moe_k}' if c.is_moe else ''}; global batch {work.global_batch} x "
        f"{work.seq_len} tokens; cluster {cluster.name}: {cluster.nodes} x {cluster.devices_per_node} "
        f"{cluster.device} devices, {cluster.device_memory / 1e9:.1f} GB each{_trains(work)}"
    )
    print(planner.format_table(preds, top))
    if refused and not include_all:
        print(left_out_lines(refused))
    if json_path:
        rows = [
            {
                "layout": r.plan.describe(),
                "plan": dataclasses.asdict(r.plan),
                "step_s": r.step_s,
                "memory_bytes": r.memory,
                "fits": r.fits,
                "why": r.why,
                "refused": r.refused,
                "parts": r.parts,
            }
            for r in preds
        ]
        _write_json(json_path, rows)
    return 0 if runnable else 1


def _trains(work) -> str:
    """What a LoRA config trains, for the header line ('' for full fine-tuning)."""
    if work.lora is None:
        return ""
    return f"; LoRA rank {work.lora.rank}: {work.lora.params / 1e6:.3f}M trainable parameters (the base frozen)"


LEFT_OUT_REASONS = 5  # distinct reasons printed under the table; --all shows every refused layout


def left_out_lines(refused: list) -> str:
    """How many layouts were left out as refused, and why, most frequent reason first."""
    reasons = collections.Counter(r.refused for r in refused).most_common()
    lines = [f"left out {len(refused)} layouts that `erniekit train` refuses for this config (--all lists them):"]
    lines += [f"  {n} x {why}" for why, n in reasons[:LEFT_OUT_REASONS]]
    if len(reasons) > LEFT_OUT_REASONS:
        lines.append(f"  ... and {len(reasons) - LEFT_OUT_REASONS} more reasons")
    return "\n".join(lines)


def _read_yaml(path: str):
    """A file given to `plan --mode ps`; one-line errors name the file (and line)."""
    from erniekit.distributed.planner import read_yaml

    return read_yaml(
        path, "cluster or config", "give a cluster file with device_types (examples/clusters/) or a training config"
    )


def _split_files(files: list[str]) -> tuple[str | None, str | None]:
    """(cluster file, training config): a YAML file with device_types is the cluster."""
    cluster_path, config_path = None, None
    for f in files:
        raw = _read_yaml(f)
        if isinstance(raw, dict) and "device_types" in raw:
            cluster_path = f
        else:
            config_path = f
    return cluster_path, config_path


def ps_plan(items: list[str], top: int, target: float | None, json_path: str | None) -> int:
    """`erniekit plan --mode ps CLUSTER.yaml [CONFIG.yaml] [key=value ...]`: place the model's parts
    on a heterogeneous cluster to meet a throughput target at least cost (default config: the
    embedded one's keys)."""
    from erniekit.distributed import planner
    from erniekit.distributed.ps.cost_model import load_hetero_cluster
    from erniekit.distributed.ps.plan import format_rows, plan_placement

    _check_top(top)
    _check_json_path(json_path)
    overrides = [i for i in items if "=" in i]
    cluster_path, config_path = _split_files([i for i in items if "=" not in i])
    cfg = load_checked_config(config_path, [o for o in overrides if not o.startswith("cluster=")])
    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("cluster=")), None)
    if not cluster_path and given:
        _read_yaml(given)  # load_hetero_cluster reads it again; this gives a malformed file its one line
    cluster_path = cluster_path or given
    if not cluster_path:
        raise ErniekitError(
            "plan --mode ps needs a cluster file with device_types (see examples/clusters/hetero-cpu-gpu.yaml)"
        )
    cluster = load_hetero_cluster(cluster_path)
    c = planner.model_config_of(cfg)
    workers = max(1, cfg.nproc_per_node * cfg.nnodes - (cfg.ps_servers if cfg.distributed_mode == "ps" else 0))
    batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * workers
    rows, target = plan_placement(c, cluster, cfg.max_seq_len, batch, target, seed=cfg.seed)
    tokens = batch * cfg.max_seq_len
    print(
        f"model {cfg.model_name_or_path}: embedding, {c.num_hidden_layers} layers, head; global batch {batch} x "
        f"{cfg.max_seq_len} tokens; cluster {cluster.name}: "
        + ", ".join(f"{t.count} {t.name} (${t.price_per_hour}/h)" for t in cluster.types)
        + f"; target {target:.0f} tokens/s"
    )
    print(format_rows(rows[:top], tokens))
    if json_path:
        _write_json(
            json_path, {"target_tokens_per_s": target, "tokens_per_batch": tokens, "rows": [r.as_dict() for r in rows]}
        )
    return 0


def _synced_biases(job) -> str:
    """The routers' correction biases a rank's local sync averages beside its trainable parameters
    (moe_bias_update_rate > 0: never trained, moved by each site's own loads); '' without."""
    if not job.rank_frozen_synced:
        return ""
    return f" + {job.rank_frozen_synced} router correction biases its local syncs average (moe_bias_update_rate > 0)"


def cross_cluster_plan(
    path: str | None,
    overrides: list[str],
    sites_path: str | None,
    target: float | None,
    measured_step_s: float | None,
    json_path: str | None,
) -> int:
    """`erniekit plan CONFIG sites=SITES.yaml`: the config's cross_cluster_* sync predicted on the sites,
    and the interval and compression recommended for its max sync fraction (or --target tokens/s);
    exit status 1 when nothing meets the target (docs/cross_cluster.md)."""
    from erniekit.distributed.cross_cluster import plan as cc

    _check_json_path(json_path)
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("sites=")]
    sites = cc.load_sites(sites_path or given[-1])
    cfg = load_checked_config(path, [o for o in overrides if not o.startswith("sites=")])
    sizes = list(getattr(cfg, "cross_cluster_sizes", []))
    if sizes and sizes != [sites.world] * len(sites.sites):
        raise ErniekitError(
            f"cross_cluster_sizes={sizes} but {sites_path or given[-1]} has {len(sites.sites)} sites of "
            f"{sites.world} devices; make them agree"
        )
    kinds = {s.cluster.device for s in sites.sites}
    if len(kinds) > 1:  # one job (workload, layout) is predicted on every site
        raise ErniekitError(
            f"{sites_path or given[-1]}: the sites' clusters mix device kinds ({', '.join(sorted(kinds))}); "
            "the cross-cluster planner predicts one job on every site, so plan sites of one kind"
        )
    job = cc.job_from_config(cfg, sites.sites[0].cluster)
    sync = cc.config_sync(cfg)
    print(
        f"model {cfg.model_name_or_path}: {job.rank_trainable / 1e6:.2f}M trainable parameters per rank "
        f"({cfg.fine_tuning}){_synced_biases(job)}; each site {job.plan.describe()}, global batch {job.work.global_batch} x "
        f"{job.work.seq_len} tokens; {sites.name}: {', '.join(s.name for s in sites.sites)} over "
        f"{sites.link.bandwidth_mbit:g} Mbit/s, {sites.link.latency_ms:g} ms"
        f"{' per rank pair' if sites.link.per_rank_pair else ' shared by each site'}"
    )
    pred = cc.predict_cross_cluster(job, sites, measured_step_s=measured_step_s, **sync)
    adaptive = " (adaptive)" if sync["compress"] == "adaptive" else ""
    print(
        f"config{adaptive}: {pred.describe()}: step {pred.step_s:.4f} s ({pred.intra_s:.4f} s local, "
        f"{pred.sync_fraction:.1%} syncing), {pred.tokens_per_s:.0f} tokens/s, "
        f"{pred.bytes_per_step / 1e3:.1f} KB per rank per step"
    )
    rec = cc.recommend(
        job,
        sites,
        None if target else sync["max_sync_fraction"],
        target,
        sync["topk_ratio"],
        sync["overlap_steps"],
        measured_step_s,
    )
    if rec.choice:
        print(f"recommended for {rec.target}: {rec.choice.describe()} (*)")
    else:
        print(f"recommended: none; {rec.why}")
    print(cc.format_table(rec))
    if json_path:
        out = {
            "sites": dataclasses.asdict(sites),
            "config": dataclasses.asdict(pred),
            "target": rec.target,
            "recommended": dataclasses.asdict(rec.choice) if rec.choice else None,
            "table": [dataclasses.asdict(r) for r in rec.table],
        }
        _write_json(json_path, out)
    return 0 if rec.choice else 1
