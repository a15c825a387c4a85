"""Verifiable rewards: built-in ones for the embedded task and user functions from config.

A reward function has the TRL signature

    def my_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]

with one entry per sample. kwargs carry `completion_ids` (token ids, stop token excluded) and
every field of the prompt record (`answer` and any extra keys), as lists aligned with the
samples. A named parameter without a default (`def r(prompts, completions, answer)`) declares a
field the dataset must have: that is checked before the first step. Config:
`reward_funcs: [accuracy, format, my_pkg.rewards:length_penalty, path/to/file.py:fn]`,
`reward_weights: [1.0, 0.2, ...]` (default all 1); the total reward is the weighted sum.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from erniekit.errors import ConfigError, DataError

_INTEGER = re.compile(r"-?\d+")
_SAMPLE_KEYS = ("prompts", "completions", "completion_ids")


def accuracy(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 when the completion equals the reference answer (surrounding whitespace ignored), else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def integer_format(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1 when the completion is one (signed) integer and nothing else: the embedded task's answer format."""
    return [float(_INTEGER.fullmatch(c.strip()) is not None) for c in completions]


BUILTIN_REWARDS: dict[str, Callable] = {"accuracy": accuracy, "exact_match": accuracy, "format": integer_format}


@dataclass
class RewardFunction:
    name: str  # as written in reward_funcs
    fn: Callable
    weight: float
    fields: list[str]  # prompt-record fields the function needs
    takes_kwargs: bool  # accepts **kwargs: gets every field, not only the named ones


def _import(spec: str) -> Callable:
    """`module.path:function` or `path/to/file.py:function` -> the callable."""
    where = f"reward_funcs entry {spec!r}"
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{where}: write a built-in name ({', '.join(BUILTIN_REWARDS)}) or module.path:function")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise FileNotFoundError(f"no file {target} (cwd {os.getcwd()})")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(target)[:-3], target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as e:  # any failure while importing user code is reported as a config error
        raise ConfigError(
            f"{where}: cannot import {target} ({type(e).__name__}: {e}); check the module path "
            "and that it is importable (PYTHONPATH)"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {target} has no function {attr!r}; check the name after ':'")
    return fn


def _signature_fields(name: str, fn: Callable) -> tuple[list[str], bool]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return [], True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(
            f"reward function {name}: it must take (prompts, completions, **kwargs); "
            f"it takes ({', '.join(p.name for p in params)})"
        )
    required = [
        p.name
        for p in list(params)[2:]
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in _SAMPLE_KEYS
    ]
    return required, any(p.kind == p.VAR_KEYWORD for p in params)


def load_reward_functions(specs: list[str], weights: list[float]) -> list[RewardFunction]:
    if not specs:
        raise ConfigError("reward_funcs is empty; give at least one, e.g. reward_funcs=[accuracy]")
    if weights and len(weights) != len(specs):
        raise ConfigError(
            f"reward_weights has {len(weights)} values for {len(specs)} reward_funcs; give one weight per function"
        )
    out = []
    for i, spec in enumerate(specs):
        fn = BUILTIN_REWARDS.get(spec) or _import(spec)
        fields, takes_kwargs = _signature_fields(spec, fn)
        out.append(RewardFunction(spec, fn, float(weights[i]) if weights else 1.0, fields, takes_kwargs))
    return out


def check_fields(funcs: list[RewardFunction], records: list[dict[str, Any]], sources: list[str]) -> None:
    """Every record has the fields every reward function names (before the first step)."""
    for f in funcs:
        for name in f.fields:
            for rec, src in zip(records, sources):
                if name not in rec:
                    have = ", ".join(sorted(rec)) or "none"
                    raise DataError(
                        f"{src}: reward function {f.name} needs field '{name}', which this prompt record "
                        f"lacks (fields: {have}); add '{name}' to every record or change reward_funcs"
                    )


def _call(f: RewardFunction, prompts, completions, completion_ids, fields: dict[str, list]) -> list:
    kwargs = dict(fields) if f.takes_kwargs else {k: fields[k] for k in f.fields}
    if f.takes_kwargs:
        kwargs["completion_ids"] = completion_ids
    return f.fn(prompts, completions, **kwargs)


def _sample(prompts: list[str], completions: list[str], i: int) -> str:
    return f"sample {i} (prompt {prompts[i]!r}, completion {completions[i]!r})"


def compute_rewards(
    funcs: list[RewardFunction],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    fields: dict[str, list],
) -> np.ndarray:
    """[n_funcs, B] float rewards; a function that raises, returns the wrong count or a
    non-number stops the run with an error naming the function and the sample."""
    out = np.zeros((len(funcs), len(completions)), np.float64)
    for j, f in enumerate(funcs):
        try:
            values = _call(f, prompts, completions, completion_ids, fields)
        except Exception as e:  # user code: locate the sample that makes it fail, then report
            bad = _failing_sample(f, prompts, completions, completion_ids, fields)
            where = _sample(prompts, completions, bad) if bad is not None else f"a batch of {len(completions)} samples"
            raise DataError(
                f"reward function {f.name} raised {type(e).__name__}: {e} on {where}; fix the function"
            ) from None
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
            raise DataError(
                f"reward function {f.name} returned {got} for {len(completions)} samples; return one number per sample"
            )
        for i, v in enumerate(values):
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float, np.integer, np.floating))
                or not math.isfinite(float(v))
            ):
                raise DataError(
                    f"reward function {f.name} returned {v!r} for {_sample(prompts, completions, i)}; "
                    "rewards must be finite numbers"
                )
            out[j, i] = float(v)
    return out


def _failing_sample(f: RewardFunction, prompts, completions, completion_ids, fields) -> int | None:
    for i in range(len(completions)):
        try:
            _call(
                f,
                prompts[i : i + 1],
                completions[i : i + 1],
                completion_ids[i : i + 1],
                {k: v[i : i + 1] for k, v in fields.items()},
            )
        except Exception:  # the first sample on which the function fails on its own
            return i
    return None
