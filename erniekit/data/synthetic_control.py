"""Synthetic controllable arithmetic: the answer to "51-8=" in digits ("43") or in words
("forty-three"), as the record's `"control": {"style": "digits" | "words"}` asks.

Training records carry one style each (half and half, at random); the held-out file asks every
problem twice, once per style, so the control-following rate of both settings is measured on the
same prompts. Problems are the embedded default's (1-2 digit operands, + and -, uniform values) and
held-out problems come from its fixed partition (erniekit/data/synthetic.py is_heldout), so none is
trained on.
"""

from __future__ import annotations

import os
import random

from erniekit.data.synthetic import DEFAULT_HELDOUT_FRACTION, OPS, is_heldout, write_jsonl
from erniekit.errors import DataError

STYLES = ("digits", "words")
N_TRAIN, N_EVAL = 5000, 100  # the bundled files (examples/data/control)
MAX_OPERAND = 99  # the embedded default's 1-2 digit operands: answers -99..198
_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words of an integer in (-1000, 1000): -37 -> "minus thirty-seven", 123 -> "one hundred twenty-three"."""
    if not -1000 < n < 1000:
        raise DataError(f"number_words: {n} is outside (-1000, 1000)")
    if n < 0:
        return "minus " + number_words(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_words(rest))


def styled_answer(value: int, style: str) -> str:
    if style not in STYLES:
        raise DataError(f"styled_answer: style={style!r}; use one of {STYLES}")
    return str(value) if style == "digits" else number_words(value)


def _problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    op = "+-"[rng.randrange(2)]
    return f"{a}{op}{b}=", OPS[op](a, b)


def make_control_records(n: int, seed: int, split: str) -> list[dict]:
    """`split` "train": n records of training problems, each in a random style; "eval": n distinct
    held-out problems, each twice (digits, then words)."""
    if split not in ("train", "eval"):
        raise DataError(f"make_control_records: split={split!r}; use 'train' or 'eval'")
    rng = random.Random(f"control-{seed}-{split}")
    rows, seen, tries = [], set(), 0
    while len(seen if split == "eval" else rows) < n:
        tries += 1
        if tries > 1000 * n + 10_000:
            raise DataError(f"make_control_records: only {len(rows)} of {n} {split} problems found")
        problem, value = _problem(rng)
        if is_heldout(problem, DEFAULT_HELDOUT_FRACTION) != (split == "eval"):
            continue
        if split == "train":
            style = STYLES[rng.randrange(2)]
            rows.append({"src": [problem], "tgt": [styled_answer(value, style)], "control": {"style": style}})
        elif problem not in seen:
            seen.add(problem)
            rows += [{"src": [problem], "tgt": [styled_answer(value, s)], "control": {"style": s}} for s in STYLES]
    return rows


def write_control_dataset(out_dir: str, n_train: int, n_eval: int, seed: int) -> dict[str, str]:
    """Write train.jsonl and eval.jsonl (erniekit SFT records with control) under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("eval", n_eval)):
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        write_jsonl(paths[split], make_control_records(n, seed, split))
    return paths


if __name__ == "__main__":  # python -m erniekit.data.synthetic_control examples/data/control
    import sys

    print(write_control_dataset(sys.argv[1] if len(sys.argv) > 1 else "examples/data/control", N_TRAIN, N_EVAL, 0))
