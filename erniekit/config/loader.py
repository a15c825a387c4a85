"""Read a flat YAML config, apply `key=value` overrides, type-check, and write it back.

Precedence: dataclass defaults < YAML file < command-line overrides (left to right).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
import typing
from typing import Any, Iterable

import yaml

import erniekit
from erniekit.config.schema import SECTION_KEYS, TrainConfig, field_types, format_value, unwrap_optional
from erniekit.errors import ConfigError

CLI = "command line"
# headers a YAML file may group flat keys under (`data:` then indented keys); "train" for the rest
SECTION_NAMES = frozenset(SECTION_KEYS) | {"train", "training"}

# PyYAML (YAML 1.1) reads "3e-4" as a string; this is what we accept as a number instead.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def load_config(path: str | None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Build a TrainConfig from an optional YAML file plus `key=value` overrides."""
    types = field_types()
    values: dict[str, Any] = {}
    if path is not None:
        for key, value, where in _read_yaml(path):
            _check_known(key, where, types)
            values[key] = _coerce(key, value, types[key], where)
    for token in overrides:
        key, sep, raw = token.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{token}' (command line) is not key=value; write e.g. max_steps=10")
        name, _, subkey = key.partition(".")
        _check_known(name, CLI, types, shown=key)
        tp = types[name]
        if subkey:
            if unwrap_optional(tp)[0] is not dict:
                raise ConfigError(
                    f"'{key}' (command line): {name} is not a mapping, so it takes no dotted "
                    f"sub-key; write {name}=VALUE"
                )
            merged = dict(values.get(name, default(name)))
            _set_dotted(merged, subkey.split("."), _numbers(_yaml_value(raw)))
            values[name] = merged
        else:
            values[name] = _coerce(name, _yaml_value(raw), tp, CLI, raw=raw)
    return TrainConfig(**values)


def dump_config(cfg: TrainConfig, path: str) -> None:
    """Write the resolved config as YAML (atomically) so a run can be reproduced from it."""
    text = f"# resolved erniekit {erniekit.__version__} config; rerun with: erniekit train {os.path.basename(path)}\n"
    text += yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, default_flow_style=False)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _read_yaml(path: str) -> list[tuple[str, Any, str]]:
    """(key, value, 'path:line') per setting; one-level sections such as `data:` are flattened."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}; pass a UTF-8 YAML file") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return []
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(
                f"{path}: top level must be a mapping of 'key: value' lines, got a "
                f"{'list' if isinstance(root, yaml.SequenceNode) else 'single value'}; "
                f"write one 'key: value' per line"
            )
        types = field_types()
        entries: list[tuple[str, Any, str]] = []
        for key_node, value_node in root.value:
            key = str(loader.construct_object(key_node, deep=True))
            is_section = key not in types and isinstance(value_node, yaml.MappingNode)
            if is_section and key not in SECTION_NAMES:  # a misspelled mapping key, not a section header
                where = f"{path}:{key_node.start_mark.line + 1}"
                if difflib.get_close_matches(key, list(types), n=1, cutoff=0.6):
                    _check_known(key, where, types)  # raises, suggesting the mapping field it is close to
                close = difflib.get_close_matches(key, list(SECTION_NAMES), n=1, cutoff=0.6)
                hint = f"did you mean '{close[0]}'?" if close else f"sections are {', '.join(sorted(SECTION_NAMES))};"
                raise ConfigError(f"unknown section '{key}' ({where}); {hint} or write its keys without a section")
            pairs = value_node.value if is_section else [(key_node, value_node)]
            for k_node, v_node in pairs:
                k = str(loader.construct_object(k_node, deep=True))
                v = loader.construct_object(v_node, deep=True)
                entries.append((k, v, f"{path}:{k_node.start_mark.line + 1}"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        raise ConfigError(f"{where}: invalid YAML ({problem}); fix the syntax there") from None
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())
        raise ConfigError(f"{path}: invalid YAML ({problem}); fix the syntax") from None
    finally:
        loader.dispose()
    seen: dict[str, str] = {}
    for key, _, where in entries:
        if key in seen:
            raise ConfigError(f"{where}: key '{key}' is set twice (first at {seen[key]}); keep one")
        seen[key] = where
    return entries


# names other toolkits (LLaMA-Factory, transformers' TrainingArguments, PaddleFormers / ERNIEKit)
# give a setting, and what erniekit calls it: spelling alone would suggest a wrong key
ELSEWHERE = {
    "dataset": "erniekit's key is train_dataset_path",
    "train_dataset": "erniekit's key is train_dataset_path",
    "eval_dataset": "erniekit's key is eval_dataset_path",
    "cutoff_len": "erniekit's key is max_seq_len",
    "max_length": "erniekit's key is max_seq_len",
    "model_name": "erniekit's key is model_name_or_path",
    "finetuning_type": "erniekit's key is fine_tuning",
    "template": "erniekit's key is chat_template",
    "lora": "write fine_tuning=LoRA",
    "lora_target": "erniekit's key is lora_target_modules",
    "gradient_checkpointing": "erniekit's key is recompute",
    "learning_rate_scheduler": "erniekit's key is lr_scheduler_type",
    "lr_scheduler": "erniekit's key is lr_scheduler_type",
    "save_strategy": "erniekit saves every save_steps steps",
    "eval_strategy": "erniekit evaluates every eval_steps steps",
    "evaluation_strategy": "erniekit evaluates every eval_steps steps",
    "deepspeed": "erniekit shards with sharding (stage1 / stage2 / stage3) and sharding_parallel_degree",
    "unified_checkpoint": "erniekit always writes one Hugging Face layout checkpoint: remove it",
    "overwrite_output_dir": "erniekit never overwrites an earlier run: resume it (resume_from_checkpoint=auto), "
    "or use a new output_dir",
    "val_size": "erniekit evaluates on eval_dataset_path: split the file yourself",
}


def _check_known(key: str, where: str, types: dict[str, Any], shown: str | None = None) -> None:
    """Reject a key that is not a TrainConfig field, suggesting the closest one."""
    if key in types:
        return
    shown = shown or key
    if key in ELSEWHERE:
        raise ConfigError(
            f"unknown config key '{shown}' ({where}); {ELSEWHERE[key]} ('erniekit help train' lists the keys)"
        )
    close = []
    for candidate in (shown, shown.rsplit(".", 1)[-1], key):
        close = close or difflib.get_close_matches(candidate, list(types), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "run 'erniekit help train' to list keys"
    raise ConfigError(f"unknown config key '{shown}' ({where}); {hint}")


def default(name: str) -> Any:
    """The dataclass default of one field (calling default_factory for mutable ones)."""
    f = TrainConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _yaml_value(raw: str) -> Any:
    """Parse a command-line value the way YAML would; text YAML rejects stays a string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _numbers(value: Any) -> Any:
    """Turn '3e-4'-style strings into floats, recursively (for free-form mappings)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
        return int(number) if re.fullmatch(r"[-+]?\d+", value.strip()) else number
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _set_dotted(target: dict, keys: list[str], value: Any) -> None:
    """target[a][b][c] = value for keys [a, b, c], creating inner mappings as needed."""
    for k in keys[:-1]:
        inner = target.get(k)
        target[k] = dict(inner) if isinstance(inner, dict) else {}
        target = target[k]
    target[keys[-1]] = value


def _coerce(key: str, value: Any, tp: Any, where: str, raw: str | None = None) -> Any:
    """Check (and gently convert) one value to the field's type; `raw` is the command-line text."""
    base, optional = unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise _type_error(key, base, optional, where, raw if raw is not None else "null")
    if base is str:
        if raw is not None:  # surrounding blanks and one pair of quotes dropped, the rest as typed
            text = raw.strip()
            quoted = len(text) > 1 and text[0] == text[-1] and text[0] in "'\""
            return text[1:-1] if quoted else text  # no escapes: a regex's \. or C:\new stays as typed
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str):
            return value
    elif base is bool:
        if raw is not None:
            text = raw.strip().lower()
            if text in ("true", "1"):
                return True
            if text in ("false", "0"):
                return False
        elif isinstance(value, bool):
            return value
        elif isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif base is int:
        number = _numbers(value) if isinstance(value, str) else value
        if isinstance(number, int) and not isinstance(number, bool):
            return number
        if isinstance(number, float) and number.is_integer():
            return int(number)
    elif base is float:
        number = _numbers(value) if isinstance(value, str) else value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return float(number)
    elif base is dict:
        if isinstance(value, dict):
            return _numbers(value)
    elif typing.get_origin(base) is list:  # a scalar is a list of one, "a,b" a list of two
        (kind,) = typing.get_args(base)
        try:
            return typed_list(key, _numbers(value) if kind is not str else value, kind)
        except ConfigError:
            raise _type_error(key, base, optional, where, raw if raw is not None else value) from None
    else:
        return value
    raise _type_error(key, base, optional, where, raw if raw is not None else value)


_LIST_HINTS = {
    int: "integers such as [2, 4]",
    float: "numbers such as [1.0, 0.5]",
    str: "names such as [accuracy, format]",
}


def typed_list(key: str, value: object, kind: type) -> list:
    """[a, b], "a,b", one value or [] -> a list of `kind`; anything else is a one-line ConfigError."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    items = items if isinstance(items, list) else [items]
    try:
        if kind is str:
            ok = all(isinstance(v, str) and v.strip() for v in items)
            out = [v.strip() for v in items] if ok else []
        else:
            ok = not any(isinstance(v, bool) for v in items)
            if kind is int:
                ok = ok and all(not isinstance(v, float) or v.is_integer() for v in items)
            out = [kind(v) for v in items]
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: it must be a list of {_LIST_HINTS[kind]}; change {key}")
    return out


_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
_EXPECTED.update({list[kind]: f"a list of {hint}" for kind, hint in _LIST_HINTS.items()})


def _type_error(key: str, base: Any, optional: bool, where: str, got: Any) -> ConfigError:
    expected = _EXPECTED.get(base, getattr(base, "__name__", str(base)))
    if optional:
        expected += " or null"
    return ConfigError(
        f"{key} must be {expected} ({where}), got {got!r}; fix the value (default: {key}={format_value(default(key))})"
    )
