"""`erniekit eval MODEL_DIR --elastic`: one row per elastic sub-model of a checkpoint.

Each row is the sub-model cut out as a standalone model (erniekit.elastic.submodels.extract_submodel,
i.e. exactly what `erniekit export ... elastic.*=` writes): its total and active (per-token)
parameters, held-out exact match of greedy replies (the SFT stage's metric) and greedy decode
speed on a fixed batch. The table is also written as elastic_table.json.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from erniekit.errors import ConfigError, ErniekitError

DECODE_BATCH = 16  # prompts in the timed generation
DECODE_TOKENS = 32  # tokens generated per prompt in the timed generation (no stop tokens)


def _run_config(model_dir: str) -> dict:
    """The run_config.yaml next to the model ({} when there is none); a file that is not a YAML
    mapping is one ConfigError naming it."""
    path = os.path.join(model_dir, "run_config.yaml")
    if not os.path.isfile(path):
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise ConfigError(
            f"{path}{line}: cannot read the run's config ({str(e).splitlines()[0]}); fix or remove the file"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(cfg).__name__}; fix or remove it")
    return cfg


def run_choices(model_dir: str) -> dict[str, list[int]]:
    """elastic_depth / elastic_experts / elastic_top_k of the run that wrote `model_dir`
    (its run_config.yaml), {} when there is none or the run was not elastic."""
    cfg = _run_config(model_dir)
    out = {}
    for k in ("depth", "experts", "top_k"):
        value = cfg.get(f"elastic_{k}") or []
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(
                f"{os.path.join(model_dir, 'run_config.yaml')}: elastic_{k}={value!r} is not a list of integers; "
                "fix or remove the file"
            )
        out[k] = list(value)
    return out if cfg else {}


def specs_for(config, depths: list[int], experts: list[int], top_ks: list[int]) -> list:
    """Full model first, then every depth x experts x top_k combination that is valid, largest first."""
    from erniekit.elastic.submodels import ElasticSpec

    full = ElasticSpec().resolved(config)
    ds = sorted(set(depths or [full.depth]), reverse=True)
    ns = sorted(set(experts or [full.experts]), reverse=True)
    ks = sorted(set(top_ks or [full.top_k]), reverse=True)
    out = [full]
    for d, n, k in itertools.product(ds, ns, ks):
        spec = ElasticSpec(d, n, k)
        if spec not in out and (n is None or k is None or k <= n):
            out.append(spec)
    dropped = [n for n in ns if n is not None and all(k is not None and k > n for k in ks)]
    if dropped:  # every row of that expert count would be skipped: say so instead of a silently shorter table
        raise ConfigError(
            f"--experts {dropped[0]} is below every top-k ({','.join(map(str, ks))}): a token cannot go to more "
            f"experts than exist; add --top-k {dropped[0]} (or a smaller value)"
        )
    return out


def _check_specs(config, depths: list[int], experts: list[int], top_ks: list[int]) -> list:
    """specs_for, each checked against the model config (one-line ConfigError naming the option)."""
    from erniekit.elastic.submodels import check_spec

    specs = specs_for(config, depths, experts, top_ks)
    for s in specs:
        check_spec(config, s, key="--elastic")
    return specs


def decode_speed(model, prompts: list[list[int]], pad_id: int) -> float:
    """Greedy tokens/s of one batched generation of DECODE_TOKENS tokens per prompt (after a warm-up)."""
    from erniekit.infer.generate import SamplingParams, generate

    batch = prompts[:DECODE_BATCH]
    generate(model, batch, SamplingParams(max_new_tokens=2), pad_id=pad_id)  # warm-up
    t0 = time.perf_counter()
    outs = generate(model, batch, SamplingParams(max_new_tokens=DECODE_TOKENS), pad_id=pad_id)
    dt = time.perf_counter() - t0
    return sum(len(o) for o in outs) / max(dt, 1e-9)


def elastic_report(
    model_dir: str,
    data_path: str,
    depths: list[int] | None = None,
    experts: list[int] | None = None,
    top_ks: list[int] | None = None,
    max_samples: int = 500,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    out_dir: str | None = None,
) -> dict:
    """Score every requested sub-model of `model_dir` on `data_path`; choices default to the run's."""
    from erniekit.data.formats import load_sft_examples
    from erniekit.elastic.submodels import count_params, extract_submodel
    from erniekit.models.registry import load_model_or_adapter, load_tokenizer, model_config
    from erniekit.train.evaluation import exact_match_eval, prompt_ids
    from erniekit.utils.io import atomic_write_json

    if not os.path.isdir(model_dir):
        raise ErniekitError(
            f"{model_dir}: checkpoint directory not found; pass a directory written by 'erniekit train'"
        )
    if max_samples < 1 or batch_size < 1:
        raise ErniekitError(f"--max-samples {max_samples} --batch-size {batch_size}: both must be positive")
    run = run_choices(model_dir)
    depths, experts, top_ks = (
        a if a else run.get(k, []) for a, k in ((depths, "depth"), (experts, "experts"), (top_ks, "top_k"))
    )
    if os.path.isfile(os.path.join(model_dir, "config.json")):  # a bad choice is reported before the weights load
        _check_specs(model_config(model_dir), depths, experts, top_ks)
    tokenizer = load_tokenizer(model_dir)
    model = load_model_or_adapter(model_dir)
    model.eval()
    specs = _check_specs(model.config, depths, experts, top_ks)
    convs = load_sft_examples(data_path)[:max_samples]
    new_tokens = max_new_tokens or _run_max_new_tokens(model_dir)
    prompts = [prompt_ids(c, tokenizer) for c in convs]
    rows = []
    for s in specs:
        sub = extract_submodel(model, s)
        total, active = count_params(sub)
        em = exact_match_eval(sub, tokenizer, convs, batch_size, new_tokens)
        rows.append(
            {
                "depth": s.depth,
                "experts": s.experts,
                "top_k": s.top_k,
                "active_params": active,
                "total_params": total,
                "exact_match": em,
                "decode_tokens_per_s": decode_speed(sub, prompts, tokenizer.pad_token_id or 0),
            }
        )
    table = {
        "model_dir": model_dir,
        "data": data_path,
        "samples": len(convs),
        "max_new_tokens": new_tokens,
        "decode": {"batch": min(DECODE_BATCH, len(prompts)), "tokens_per_prompt": DECODE_TOKENS},
        "rows": rows,
    }
    table["path"] = os.path.join(out_dir or model_dir, "elastic_table.json")
    atomic_write_json(table["path"], table)
    return table


def _run_max_new_tokens(model_dir: str) -> int:
    """eval_max_new_tokens of the run (replies of the embedded task are short), else 16."""
    value = _run_config(model_dir).get("eval_max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 16


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def format_elastic_table(table: dict) -> str:
    """The table `erniekit eval --elastic` prints."""
    lines = [
        f"elastic sub-models of {table['model_dir']}: exact match on {table['samples']} examples of "
        f"{os.path.basename(table['data'])}, decode speed greedy {table['decode']['batch']} x "
        f"{table['decode']['tokens_per_prompt']} tokens",
        f"{'depth':>5}  {'experts':>7}  {'top_k':>5}  {'active M':>8}  {'total M':>7}  {'exact match':>11}  "
        f"{'decode tok/s':>12}",
    ]
    for r in table["rows"]:
        lines.append(
            f"{_cell(r['depth']):>5}  {_cell(r['experts']):>7}  {_cell(r['top_k']):>5}  "
            f"{r['active_params'] / 1e6:8.3f}  {r['total_params'] / 1e6:7.3f}  {r['exact_match']:11.3f}  "
            f"{r['decode_tokens_per_s']:12.0f}"
        )
    return "\n".join(lines)
