#!/usr/bin/env python
"""Run the credibility demo (examples/configs/tiny/sft_credibility.yaml: the trained embedded default
fine-tuned with the credibility loss) over seeds and record its held-out numbers in
bench_results/credibility_demo.json (docs/control.md), with the CPU, threads, seeds and config.

Beside the run's own AUC line, each finished model is scored again here with the sampled replies split
by form: a sample that is a well-formed integer (a wrong value in the data's format: "122" for 123) and
one that is not ("12518ay"). The AUC over well-formed samples only is what says whether the head judges
the value and not merely the form. The training run needs output/tiny-sft (the embedded default's run).

    python tools/credibility_demo.py --seeds 1,2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from control_demo import cpu_model, train_run  # noqa: E402

CONFIG = "examples/configs/tiny/sft_credibility.yaml"
INTEGER = re.compile(r"-?\d+")


def split_auc(model_dir: str, cfg: dict, seed: int) -> dict:
    """Held-out AUC of real vs sampled replies, over all samples and over well-formed ones only,
    sampled as the run's own evaluation samples them (its temperature, its seed)."""
    import numpy as np

    from erniekit.data.formats import load_sft_examples
    from erniekit.infer.chat import load_chat_model
    from erniekit.infer.credibility import prompt_sequence, reply_sequence, roc_auc, sample_replies, score_sequences
    from erniekit.nn.credibility import load_credibility_head

    model, tok = load_chat_model(model_dir)
    head = load_credibility_head(model_dir, model.config.hidden_size)
    convs = load_sft_examples(str(ROOT / cfg["eval_dataset_path"]))[: cfg["eval_max_samples"]]
    prompts = [prompt_sequence(c, tok) for c in convs]
    temp, batch = cfg["credibility_temperature"], cfg["per_device_eval_batch_size"]
    sampled = sample_replies(model, tok, prompts, temp, cfg["credibility_max_new_tokens"], batch, seed)
    real_text = [c.turns[-1][1].strip() for c in convs]
    pad = tok.pad_token_id or 0
    real = score_sequences(model, head, [reply_sequence(c, r, tok) for c, r in zip(convs, real_text)], pad, batch)
    differ = [i for i, (s, r) in enumerate(zip(sampled, real_text)) if s != r]
    gen = score_sequences(model, head, [reply_sequence(convs[i], sampled[i], tok) for i in differ], pad, batch)
    formed = np.array([bool(INTEGER.fullmatch(sampled[i])) for i in differ], dtype=bool)
    return {
        "examples": len(convs),
        "sampled_differ_fraction": len(differ) / len(convs),
        "well_formed_fraction_of_differing": float(formed.mean()) if len(differ) else float("nan"),
        "auc_all": roc_auc(real, gen),
        "auc_well_formed": roc_auc(real, gen[formed]) if formed.any() else float("nan"),
        "auc_malformed": roc_auc(real, gen[~formed]) if (~formed).any() else float("nan"),
        "well_formed_examples": [[real_text[i], sampled[i]] for i, f in zip(differ, formed) if f][:8],
    }


def _split(out: str) -> dict:
    import yaml

    cfg = yaml.safe_load(open(os.path.join(out, "run_config.yaml")))
    return split_auc(out, cfg, cfg["seed"])


def run_one(seed: int, threads: int, overrides: list[str]) -> dict:
    metrics = ("credibility_auc", "credibility_identical", "exact_match")
    return train_run(CONFIG, seed, threads, overrides, metrics, _split)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2", help="comma-separated seeds")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--out", default=str(ROOT / "bench_results" / "credibility_demo.json"))
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config (recorded)")
    ns = p.parse_args()
    if not (ROOT / "output" / "tiny-sft" / "config.json").is_file():
        print("output/tiny-sft is missing: run `erniekit train examples/configs/tiny/sft.yaml` first", file=sys.stderr)
        return 2
    key = {"config": CONFIG, "overrides": ns.overrides}
    doc = json.load(open(ns.out)) if os.path.isfile(ns.out) else {}
    if doc.get("key") != key:
        doc = {"key": key, "runs": []}
    doc.update(cpu=cpu_model(), cores=os.cpu_count())
    done = {(r["seed"], r["threads"]) for r in doc["runs"] if r["returncode"] == 0}
    for seed in [int(s) for s in ns.seeds.split(",") if s]:
        if (seed, ns.threads) in done:
            continue
        run = run_one(seed, ns.threads, ns.overrides)
        print(json.dumps({k: v for k, v in run.items() if k not in ("lines", "well_formed_examples")}), flush=True)
        doc["runs"] = [r for r in doc["runs"] if (r["seed"], r["threads"]) != (seed, ns.threads)] + [run]
        Path(ns.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
