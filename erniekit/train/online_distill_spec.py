"""`online_distill_students`: what each student of an online-distillation run is (docs/online_distillation.md).

An entry is a preset name or checkpoint directory (the student's model), or a mapping with
`name`, `teacher` (the main model, `teacher`, or another student's name: Titan's teacher
assistant), `model`, `auxiliary_layer`, `auxiliary_weight`, `hidden_weight`, `hidden_layer_map`
(the hidden-state loss of erniekit/train/hidden_distill.py), `lr_ratio` and any model config field
(num_hidden_layers, hidden_size, intermediate_size, moe_num_experts, ...) overriding the
shape. Kept free of paddle so config validation reads it before anything loads.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from erniekit.errors import ConfigError

MAIN_TEACHER = "teacher"  # the run's own model, taught by its data
SPEC_KEYS = (
    "name",
    "teacher",
    "model",
    "auxiliary_layer",
    "auxiliary_weight",
    "hidden_weight",
    "hidden_layer_map",
    "lr_ratio",
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a directory name under output_dir/students/
KEY = "online_distill_students"


@dataclass(frozen=True)
class StudentSpec:
    name: str
    teacher: str = MAIN_TEACHER  # who it distills from
    model: str | None = None  # preset or checkpoint directory; None: the teacher's config, fresh weights
    overrides: dict[str, Any] = field(default_factory=dict)  # model config fields
    auxiliary_layer: bool = False  # a temporary extra decoder layer distilling the teacher's hidden states
    auxiliary_weight: float = 1.0  # weight of that hidden-state loss
    lr_ratio: float = 1.0  # its learning rate over the run's (the main model's) at every step
    hidden_weight: float = 0.0  # weight of the layer-wise hidden-state loss per real token (0: off)
    hidden_layer_map: tuple[int, ...] | None = None  # its teacher's layer for each of its layers


def parse_students(value: Any) -> list[StudentSpec]:
    """The config value -> specs in the order written; one-line ConfigError naming the entry."""
    if value in (None, [], ""):
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{KEY}={value!r} is invalid: it must be a list of students (preset names or mappings)")
    specs = [_parse_one(i, entry) for i, entry in enumerate(value)]
    seen: set[str] = set()
    for i, s in enumerate(specs):
        if s.name in seen or s.name == MAIN_TEACHER:
            raise ConfigError(
                f"{KEY}[{i}]: name {s.name!r} is "
                + ("taken by the main model" if s.name == MAIN_TEACHER else "used twice")
                + "; give every student its own name"
            )
        seen.add(s.name)
    check_teachers(specs)
    return specs


def _parse_one(i: int, entry: Any) -> StudentSpec:
    where = f"{KEY}[{i}]"
    if isinstance(entry, str) and entry.strip():
        entry = {"model": entry.strip()}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}={entry!r} is invalid: give a preset name, a checkpoint directory or a mapping")
    name = str(entry.get("name", f"student{i + 1}"))
    if not _NAME.match(name):
        raise ConfigError(f"{where}: name {name!r} must be letters, digits, '_', '.' or '-' (a directory name)")
    teacher = str(entry.get("teacher", MAIN_TEACHER))
    model = entry.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise ConfigError(f"{where}: model={model!r} must be a preset name or a checkpoint directory")
    aux = entry.get("auxiliary_layer", False)
    if not isinstance(aux, bool):
        raise ConfigError(f"{where}: auxiliary_layer={aux!r} must be true or false")
    weight = _positive_number(entry, "auxiliary_weight", where)
    lr_ratio = _positive_number(entry, "lr_ratio", where, " (its learning rate over the run's)")
    hidden_weight, hidden_map = _hidden(entry, where)
    overrides = {str(k): v for k, v in entry.items() if k not in SPEC_KEYS}  # checked by student_config
    if model is not None and os.path.isdir(model) and overrides:
        raise ConfigError(
            f"{where}: model={model} is a checkpoint directory and keeps its own shape; drop "
            f"{next(iter(overrides))} (or start from a preset)"
        )
    return StudentSpec(name, teacher, model, overrides, aux, weight, lr_ratio, hidden_weight, hidden_map)


def _hidden(entry: dict, where: str) -> tuple[float, tuple[int, ...] | None]:
    """hidden_weight (a number >= 0, default 0) and hidden_layer_map (null or non-negative layer
    indices, with a weight only); the map's length and range are checked once the models exist."""
    weight = entry.get("hidden_weight", 0.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ConfigError(f"{where}: hidden_weight={weight!r} must be a number >= 0 (0: no hidden-state loss)")
    layer_map = entry.get("hidden_layer_map")
    if layer_map is None:
        return float(weight), None
    if not weight:
        raise ConfigError(f"{where}: hidden_layer_map applies with hidden_weight > 0; set a weight or drop it")
    ok = isinstance(layer_map, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_map
    )
    if not ok or not layer_map:
        raise ConfigError(f"{where}: hidden_layer_map={layer_map!r} must be a list of teacher layer indices (>= 0)")
    return float(weight), tuple(layer_map)


def _positive_number(entry: dict, key: str, where: str, meaning: str = "") -> float:
    """entry[key] (default 1.0) as a float > 0; booleans and strings are refused in one line."""
    value = entry.get(key, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}: {key}={value!r} must be a number > 0{meaning}")
    return float(value)


def check_teachers(specs: list[StudentSpec]) -> None:
    """Every `teacher` is the main model or a student, and the chain from each student reaches the
    main model (no cycle): each student has one teacher, so the students form a tree under it."""
    by_name = {s.name: s for s in specs}
    for i, s in enumerate(specs):
        if s.teacher != MAIN_TEACHER and s.teacher not in by_name:
            raise ConfigError(
                f"{KEY}[{i}] ({s.name}): teacher {s.teacher!r} is neither {MAIN_TEACHER!r} (the main model) "
                f"nor a student's name ({', '.join(by_name)})"
            )
        chain = [s.name]
        while by_name.get(chain[-1]) is not None and by_name[chain[-1]].teacher != MAIN_TEACHER:
            nxt = by_name[chain[-1]].teacher
            if nxt in chain:
                raise ConfigError(
                    f"{KEY}: the teacher chain {' -> '.join(chain + [nxt])} is a cycle; let one of them "
                    f"learn from {MAIN_TEACHER!r}"
                )
            chain.append(nxt)


def teaching_order(specs: list[StudentSpec]) -> list[StudentSpec]:
    """Students ordered so that each comes after its teacher (a teacher assistant before the
    students it teaches); ties keep the written order."""
    done: set[str] = {MAIN_TEACHER}
    order: list[StudentSpec] = []
    left = list(specs)
    while left:
        ready = [s for s in left if s.teacher in done]
        if not ready:  # check_teachers refuses this before a run starts
            raise ConfigError(f"{KEY}: the teacher chain of {left[0].name} never reaches {MAIN_TEACHER!r}")
        for s in ready:
            order.append(s)
            done.add(s.name)
            left.remove(s)
    return order


def student_base(spec: StudentSpec, model_name_or_path: str, model_overrides: dict) -> tuple[str, dict, bool]:
    """(checkpoint directory or preset, config overrides, whether its weights are loaded) of a
    student: its own `model` as it is, or else the main model's config (with model_overrides)
    under the student's overrides, from fresh weights."""
    if spec.model is not None:
        return spec.model, dict(spec.overrides), os.path.isdir(spec.model)
    return model_name_or_path, {**(model_overrides or {}), **spec.overrides}, False


def student_config(spec: StudentSpec, model_name_or_path: str, model_overrides: dict, where: str) -> Any:
    """The student's model config; one-line ConfigError for an unknown field or an impossible shape."""
    from erniekit.errors import CheckpointError
    from erniekit.models import registry

    base, overrides, _ = student_base(spec, model_name_or_path, model_overrides)
    try:
        config = registry.model_config(base)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None
    known = {f.name for f in dataclasses.fields(config)} - {"extra"}
    unknown = [k for k in spec.overrides if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; use {', '.join(SPEC_KEYS)} or a model config field "
            "such as num_hidden_layers, hidden_size, intermediate_size, moe_num_experts"
        )
    try:
        return config.replace(**overrides) if overrides else config
    except (CheckpointError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def hidden_layer_map(spec: StudentSpec, student_config: Any, teacher_config: Any) -> list[int]:
    """The teacher layer each of the student's layers learns: its hidden_layer_map, or the same
    fraction of depth."""
    from erniekit.models.layer_init import depth_fraction_layer_map

    m, n = student_config.num_hidden_layers, teacher_config.num_hidden_layers
    return list(spec.hidden_layer_map) if spec.hidden_layer_map else depth_fraction_layer_map(m, n)


def hidden_layer_map_error(spec: StudentSpec, student_config: Any, teacher_config: Any, where: str) -> None:
    """A ConfigError when the student's hidden_layer_map does not give one teacher layer per layer."""
    if not spec.hidden_weight:
        return
    layer_map = hidden_layer_map(spec, student_config, teacher_config)
    m, n = student_config.num_hidden_layers, teacher_config.num_hidden_layers
    if len(layer_map) != m or not all(0 <= i < n for i in layer_map):
        raise ConfigError(
            f"{where}: hidden_layer_map={layer_map} must give one layer of its teacher {spec.teacher!r} (0 to {n - 1}) "
            f"for each of its {m} layers"
        )
