"""Deterministic synthetic arithmetic task with exactly checkable answers.

Problems look like ``"12+345="`` with answer ``"357"``. The held-out split is a fixed,
seed-independent partition of the problem space (a stable hash of the problem text), so an
eval problem can never appear in training data, whatever seeds the two sides use.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Iterable, Sequence

from erniekit.errors import DataError

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
DEFAULT_HELDOUT_FRACTION = 0.05


def is_heldout(problem: str, fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    """True when ``problem`` (e.g. "12+3=") belongs to the eval partition (stable across runs)."""
    h = int.from_bytes(hashlib.blake2b(problem.encode(), digest_size=8).digest(), "big")
    return h % 1_000_000 < fraction * 1_000_000


def split_heldout(rows: Iterable[dict], fraction: float = DEFAULT_HELDOUT_FRACTION) -> tuple[list[dict], list[dict]]:
    """Partition rows ``{"src": [problem], ...}`` into (train, eval) by :func:`is_heldout`."""
    train, held = [], []
    for row in rows:
        (held if is_heldout(row["src"][0], fraction) else train).append(row)
    return train, held


SAMPLINGS = ("digits", "value")


def _operand(rng: random.Random, min_digits: int, max_digits: int, sampling: str = "digits") -> int:
    if sampling == "value":  # every number of the range equally likely, as in the held-out partition
        return rng.randint(0 if min_digits == 1 else 10 ** (min_digits - 1), 10**max_digits - 1)
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_arithmetic(
    n: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    split: str | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    unique: bool = False,
    sampling: str = "digits",
) -> list[dict]:
    """Return ``n`` rows ``{"src": ["a+b="], "tgt": ["answer"]}``.

    ``sampling="digits"``: each operand first draws its digit count uniformly in [min_digits,
    max_digits], so short and long numbers are equally common (a quarter of 1-2 digit problems
    are then one of the 200 one-digit ones). ``sampling="value"``: each operand is uniform over
    the range, so problems are drawn as the held-out partition holds them (81% two-digit pairs
    at 1-2 digits); the embedded default uses it (docs/reproducibility.md). ``split`` = "train" keeps only non-held-out problems,
    "eval" only held-out ones, None keeps all. ``unique`` forbids repeated problems.
    """
    if not 1 <= min_digits <= max_digits:
        raise DataError(f"make_arithmetic: need 1 <= min_digits <= max_digits, got {min_digits}..{max_digits}")
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise DataError(f"make_arithmetic: unknown ops {bad or list(ops)}; use some of {sorted(OPS)}")
    if sampling not in SAMPLINGS:
        raise DataError(f"make_arithmetic: sampling={sampling!r}; use one of {SAMPLINGS}")
    if split not in (None, "train", "eval"):
        raise DataError(f"make_arithmetic: split={split!r}; use None, 'train' or 'eval'")
    rng = random.Random(f"arith-{seed}-{split}")
    rows, seen, tries = [], set(), 0
    max_tries = 1000 * n + 10_000
    while len(rows) < n:
        tries += 1
        if tries > max_tries:
            raise DataError(
                f"make_arithmetic: only {len(rows)} of {n} {split or 'any'} problems found with "
                f"{min_digits}-{max_digits} digits; ask for fewer or allow more digits/ops"
            )
        a, b = _operand(rng, min_digits, max_digits, sampling), _operand(rng, min_digits, max_digits, sampling)
        op = ops[rng.randrange(len(ops))]
        problem = f"{a}{op}{b}="
        if split is not None and is_heldout(problem, heldout_fraction) != (split == "eval"):
            continue
        if unique:
            if problem in seen:
                continue
            seen.add(problem)
        rows.append({"src": [problem], "tgt": [str(OPS[op](a, b))]})
    return rows


def answer(problem: str) -> str:
    """Compute the exact answer of a problem string like "12-345=" (used to check rows)."""
    body = problem.rstrip("=")
    for i in range(1, len(body)):  # operator is the first op char after a leading digit
        if body[i] in OPS:
            return str(OPS[body[i]](int(body[:i]), int(body[i + 1 :])))
    raise DataError(f"answer: {problem!r} is not of the form 'a<op>b='")


def exact_match(prediction: str, reference: str) -> bool:
    """Exact string match after stripping surrounding whitespace."""
    return prediction.strip() == reference.strip()


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    """One compact JSON object per line, written atomically (the bundled datasets' format)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def wrong_answer(problem: str, rng: random.Random) -> str:
    """A plausible mistake for `problem`: off by one, a dropped/extra carry (+-10), a flipped sign,
    or swapped digits; never the right answer."""
    right = int(answer(problem))
    candidates = [right + 1, right - 1, right + 10, right - 10]
    if right != 0:
        candidates.append(-right)
    digits = str(abs(right))
    if len(digits) >= 2 and digits[0] != digits[1]:
        candidates.append(int(("-" if right < 0 else "") + digits[1] + digits[0] + digits[2:]))
    return str(rng.choice([c for c in candidates if c != right]))


def make_arithmetic_preferences(rows: Sequence[dict], seed: int) -> list[dict]:
    """ERNIEKit DPO rows: the right answer is chosen, a plausible wrong one rejected; the order
    inside `response` is random and `sort` ranks them (higher = chosen)."""
    rng = random.Random(f"arith-pref-{seed}")
    out = []
    for r in rows:
        problem, right = r["src"][0], r["tgt"][0]
        wrong = wrong_answer(problem, rng)
        if rng.random() < 0.5:
            out.append({"src": [problem], "tgt": [], "response": [[right], [wrong]], "sort": [1, 0]})
        else:
            out.append({"src": [problem], "tgt": [], "response": [[wrong], [right]], "sort": [0, 1]})
    return out


def pretrain_text(row: dict, index: int) -> str:
    """A pretraining document in one of the formats arithmetic appears in on the web: bare
    (``12+34=46``) or as a question/answer transcript (``Q: 12+34=\nA: 46``), alternating.

    The second keeps the answer a few tokens after the problem, as a chat template does, so a
    base model pretrained on both has seen the skill at chat-like distances and LoRA SFT only has
    to teach the chat format (measured in issue #4: bare-only pretraining left LoRA at ~0.1).
    """
    problem, ans = row["src"][0], row["tgt"][0]
    return f"Q: {problem}\nA: {ans}" if index % 2 else problem + ans


def write_arithmetic_dataset(
    out_dir: str,
    n_train: int,
    n_eval: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    sampling: str = "value",
) -> dict[str, str]:
    """Write train.jsonl / eval.jsonl (SFT form), pretrain.jsonl (``{"text": ...}``, see
    pretrain_text),
    dpo_train.jsonl / dpo_eval.jsonl (preference pairs, ERNIEKit DPO form, n_train // 5 for training)
    and rl_prompts.jsonl (RL prompts ``{"prompt", "answer"}``, see rl_prompt_rows).

    Eval problems are distinct and come from the held-out partition; train and pretrain rows
    come from the rest (repeats allowed when n_train exceeds the problem space).
    """
    kw = dict(min_digits=min_digits, max_digits=max_digits, ops=ops, heldout_fraction=heldout_fraction)
    train = make_arithmetic(n_train, seed, split="train", sampling=sampling, **kw)
    evals = make_arithmetic(n_eval, seed, split="eval", unique=True, sampling=sampling, **kw)
    pretrain = make_arithmetic(n_train, seed + 1, split="train", sampling=sampling, **kw)
    os.makedirs(out_dir, exist_ok=True)
    names = ("train", "eval", "pretrain", "dpo_train", "dpo_eval", "rl_prompts")
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in names}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evals)
    write_jsonl(paths["pretrain"], ({"text": pretrain_text(r, i)} for i, r in enumerate(pretrain)))
    dpo_rows = make_arithmetic(n_train // 5, seed + 2, split="train", sampling=sampling, **kw)
    write_jsonl(paths["dpo_train"], make_arithmetic_preferences(dpo_rows, seed))
    write_jsonl(paths["dpo_eval"], make_arithmetic_preferences(evals, seed + 1))
    write_jsonl(paths["rl_prompts"], rl_prompt_rows(train, n_train // 5, seed + 3, **kw))
    return paths


def rl_prompt_rows(
    sft_rows: Sequence[dict],
    n: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
) -> list[dict]:
    """Up to n distinct training-partition problems that no SFT row contains, as RL prompts
    ``{"prompt": "12+34=", "answer": "46"}``: problems the SFT model has not been taught, where a
    verifier's reward carries signal (on the SFT problems themselves the model is mostly right
    already); none is held out, so the eval split stays unseen."""
    seen = {r["src"][0] for r in sft_rows}
    lo = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    numbers = range(lo, 10**max_digits)
    problems = [
        (a, op, b)
        for a in numbers
        for b in numbers
        for op in ops
        if f"{a}{op}{b}=" not in seen and not is_heldout(f"{a}{op}{b}=", heldout_fraction)
    ]
    random.Random(f"rl-prompts-{seed}").shuffle(problems)
    return [{"prompt": f"{a}{op}{b}=", "answer": str(OPS[op](a, b))} for a, op, b in problems[:n]]
