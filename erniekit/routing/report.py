"""`erniekit eval MODEL_DIR --routing`: how an MoE checkpoint routes the tokens of a dataset.

Runs the model forward (no generation, no gradients) over the first --max-samples examples of SFT
or pretraining data, read as they are routed (erniekit.routing.data), adds up the routing of every
MoE layer with padding excluded into counts (erniekit.routing.stats), and writes
`routing-load.png` (layer x expert load), `routing-modality.png` (only with more than one
modality) and `routing_stats.json` into the output directory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from itertools import islice
from typing import Any

from erniekit.errors import CheckpointError, ErniekitError
from erniekit.routing.data import RoutingData

REPORT_VERSION = 1


def _check_moe_config(model_dir: str) -> None:
    """Fail before loading weights when config.json says the model is dense."""
    from erniekit.models.registry import model_config

    if os.path.isfile(os.path.join(model_dir, "config.json")) and not model_config(model_dir).is_moe:
        raise ErniekitError(f"{model_dir} has no MoE layers: routing report needs an MoE model")


def load_model_and_tokenizer(model_dir: str) -> tuple[Any, Any]:
    """Checkpoint (full or LoRA adapter, merged) in eval mode, and its tokenizer."""
    from erniekit.models.registry import load_model_or_adapter, load_tokenizer

    if not os.path.isdir(model_dir):
        raise CheckpointError(
            f"{model_dir}: checkpoint directory not found; pass a directory written by "
            "'erniekit train' or a Hugging Face ERNIE-4.5 checkpoint"
        )
    _check_moe_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    model = load_model_or_adapter(model_dir)
    if not model.moe_layers():
        raise ErniekitError(f"{model_dir} has no MoE layers: routing report needs an MoE model")
    model.eval()
    return model, tokenizer


WINDOW_BATCHES = 16  # pieces are sorted by length within this many batches: less padding, bounded memory


def accumulate_routing(model: Any, seqs: Iterable[Any], batch_size: int, pad_id: int):
    """RoutingAccumulator over the sequences (an iterable read as it goes; batched by length within
    windows of WINDOW_BATCHES batches, padding masked out). Memory: one window and the counts."""
    import paddle

    from erniekit.routing.stats import RoutingAccumulator

    acc = RoutingAccumulator()
    it = iter(seqs)
    with paddle.no_grad():
        while window := list(islice(it, batch_size * WINDOW_BATCHES)):
            _route_window(model, acc, window, batch_size, pad_id)
    return acc


def _route_window(model: Any, acc: Any, window: list, batch_size: int, pad_id: int) -> None:
    """Forward one window's pieces in batches of similar length; add their routing to `acc`."""
    import numpy as np
    import paddle

    from erniekit.data.encode import pad_batch

    order = np.argsort([len(s) for s in window], kind="stable")  # similar lengths together: less padding
    for i in range(0, len(order), batch_size):
        b = pad_batch([window[j] for j in order[i : i + batch_size]], pad_id=pad_id)
        model(paddle.to_tensor(b["input_ids"]))  # right padding + causal attention: real tokens unaffected
        acc.update(model, b["segment_ids"] > 0)


def _finite(x: Any) -> Any:
    """JSON-safe: NaN/inf become null (json.dumps would write the non-standard NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def routing_report(
    model_dir: str,
    data_path: str,
    out_dir: str | None = None,
    batch_size: int = 16,
    max_seq_len: int = 1024,
    max_samples: int | None = None,
) -> dict:
    """Route the first `max_samples` examples of `data_path` (all with None) through the MoE
    checkpoint at `model_dir`; write pictures and routing_stats.json into `out_dir` (default
    MODEL_DIR/routing) and return the stats."""
    from erniekit.routing.plots import save_load_heatmap, save_modality_usage
    from erniekit.utils.io import atomic_write_json

    if batch_size < 1 or max_seq_len < 1 or (max_samples is not None and max_samples < 1):
        raise ErniekitError(
            f"batch_size={batch_size}, max_seq_len={max_seq_len}, max_samples={max_samples}: all must be positive"
        )
    out_dir = out_dir or os.path.join(model_dir, "routing")
    model, tokenizer = load_model_and_tokenizer(model_dir)
    data = RoutingData(data_path, tokenizer, max_seq_len, max_samples)
    acc = accumulate_routing(model, data, batch_size, tokenizer.pad_token_id or 0)
    name = os.path.basename(os.path.normpath(model_dir))
    pictures = {
        "load": save_load_heatmap(
            acc.load_matrix(),
            os.path.join(out_dir, "routing-load.png"),
            f"{name}: expert load on {os.path.basename(data_path)}",
            acc.layer_ids,
        )
    }
    if acc.num_modalities > 1:
        pictures["modality"] = save_modality_usage(
            acc.modality_matrix(), os.path.join(out_dir, "routing-modality.png"), f"{name}: expert usage per modality"
        )
    load = acc.load_matrix()
    layers = [{**row, "load": load[r].tolist()} for r, row in enumerate(acc.layer_table())]
    stats = {
        "version": REPORT_VERSION,
        "model_dir": model_dir,
        "data": data_path,
        "examples": data.examples,
        "max_samples": max_samples,
        "max_samples_reached": data.capped,
        "sequences": data.sequences,
        "tokens": data.tokens,
        "num_experts": acc.num_experts,
        "moe_k": int(model.config.moe_k),
        "num_modalities": acc.num_modalities,
        "summary": {k: v for k, v in acc.scalars(prefix="").items() if not k.startswith("layer")},  # per layer: below
        "layers": layers,
        "pictures": pictures,
    }
    if acc.num_modalities > 1:
        stats["modality_usage"] = acc.modality_matrix().tolist()
    stats = _finite(stats)
    stats["stats_path"] = os.path.join(out_dir, "routing_stats.json")
    atomic_write_json(stats["stats_path"], stats)
    return stats


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_routing_table(stats: dict) -> str:
    """The per-layer table `erniekit eval --routing` prints."""
    k, e = stats["moe_k"], stats["num_experts"]
    capped = f"; --max-samples {stats['max_samples']} reached" if stats.get("max_samples_reached") else ""
    lines = [
        f"routing of {stats['tokens']} tokens ({stats['sequences']} sequences from {stats['examples']} examples"
        f"{capped}), top-{k} of {e} experts (uniform share {100 / e:.1f}%)",
        f"{'layer':>5}  {'entropy':>7}  {'/log E':>6}  {'imbalance':>9}  {'cv':>5}  top expert (share)",
    ]
    for row in stats["layers"]:
        lines.append(
            f"{row['layer']:>5}  {_num(row['entropy'], '7.3f')}  {_num(row['entropy_norm'], '6.3f')}  "
            f"{_num(row['load_imbalance'], '9.2f')}  {_num(row['load_cv'], '5.2f')}  "
            f"{row['top_expert']:>3} ({100 * row['top_expert_share']:.1f}%)"
        )
    s = stats["summary"]
    lines.append(
        f"{'mean':>5}  {_num(s.get('entropy'), '7.3f')}  {_num(s.get('entropy_norm'), '6.3f')}  "
        f"{_num(s.get('load_imbalance'), '9.2f')}  {_num(s.get('load_cv'), '5.2f')}"
    )
    return "\n".join(lines)
