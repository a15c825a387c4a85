#!/usr/bin/env python
"""Build on-policy preference pairs for the embedded arithmetic task from a trained model.

For each training problem the model answers by sampling; every wrong answer becomes the rejected
reply of a pair whose chosen reply is the right answer (ERNIEKit DPO format). Pairs built from
the model's own mistakes are what DPO can correct; problems are taken from the training split,
so held-out evaluation stays clean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="checkpoint directory (e.g. output/tiny-sft)")
    p.add_argument("--data", default=os.path.join(ROOT, "examples/data/arithmetic/train.jsonl"))
    p.add_argument("--out", default="output/tiny-dpo-pairs.jsonl")
    p.add_argument("--problems", type=int, default=4000, help="training problems to try (default: %(default)s)")
    p.add_argument("--samples", type=int, default=2, help="sampled answers per problem (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from erniekit.data.formats import load_sft_examples
    from erniekit.infer.generate import SamplingParams, generate
    from erniekit.infer.stops import decodable_vocab
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer
    from erniekit.models.registry import load_model_or_adapter
    from erniekit.train.evaluation import prompt_ids

    tok = ErnieTokenizer.from_pretrained(args.model_dir)
    model = load_model_or_adapter(args.model_dir)
    convs = list({c.turns[-1][0]: c for c in load_sft_examples(args.data)}.values())[: args.problems]
    stops = [tok.sep_token_id, tok.eos_token_id]
    pairs, seen = [], set()
    for s in range(args.samples):
        params = SamplingParams(
            max_new_tokens=8, temperature=args.temperature, stop_token_ids=stops, seed=args.seed + s
        )
        for i in range(0, len(convs), 250):
            chunk = convs[i : i + 250]
            prompts = [prompt_ids(c, tok) for c in chunk]
            outs = generate(model, prompts, params, pad_id=tok.pad_token_id, vocab=decodable_vocab(model, tok))
            for c, o in zip(chunk, outs):
                problem, right, said = c.turns[-1][0], c.turns[-1][1].strip(), tok.decode(o).strip()
                if said != right and said and (problem, said) not in seen:
                    seen.add((problem, said))
                    pairs.append({"src": [problem], "tgt": [], "response": [[right], [said]], "sort": [1, 0]})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in pairs:
            f.write(json.dumps(row) + "\n")
    print(f"{len(pairs)} on-policy pairs from {len(convs)} problems x {args.samples} samples -> {args.out}")


if __name__ == "__main__":
    main()
