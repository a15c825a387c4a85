#!/usr/bin/env python
"""Write the bundled synthetic arithmetic dataset (deterministic).

Outputs train.jsonl and eval.jsonl in erniekit SFT form ({"src": ["12+34="], "tgt": ["46"]})
and pretrain.jsonl ({"text": "12+34=46"}). Eval problems are distinct and come from a fixed
held-out partition of the problem space, so none of them appears in train or pretrain.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from erniekit.data.synthetic import write_arithmetic_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "examples", "data", "arithmetic"),
        help="output directory (default: %(default)s)",
    )
    parser.add_argument("--n-train", type=int, default=20000, help="train (and pretrain) rows (default: %(default)s)")
    parser.add_argument(
        "--n-eval", type=int, default=500, help="distinct held-out eval problems (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--min-digits", type=int, default=1, help="fewest digits per operand (default: %(default)s)")
    parser.add_argument("--max-digits", type=int, default=2, help="most digits per operand (default: %(default)s)")
    parser.add_argument("--ops", default="+-", help="operators to use, any of '+-*' (default: %(default)s)")
    parser.add_argument(
        "--sampling",
        default="value",
        choices=("value", "digits"),
        help="value: operands uniform over the range; digits: digit count uniform first (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    paths = write_arithmetic_dataset(
        args.out,
        args.n_train,
        args.n_eval,
        args.seed,
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        ops=tuple(args.ops),
        sampling=args.sampling,
    )
    for name, path in paths.items():
        print(f"{name}: {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
