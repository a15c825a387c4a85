"""The model-family registry: which code builds, loads, saves and tokenizes a checkpoint.

A checkpoint directory names its family by config.json's `model_type`; a name that is not a
directory is a preset of one family (`tiny-moe`, ...). Training, export, chat, the server and the
reports ask this module and never a family's package directly, so a new family (ERNIE 4.5 VL, a
student architecture) is its own package under `erniekit/models/<family>/` whose `family.py` calls
`register_model_family`; nothing else changes. The built-in families are found the first time a
name is looked up. A family's `family.py` imports paddle only inside its functions, so validation
and `erniekit help` can ask for preset names before paddle loads.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from erniekit.errors import CheckpointError
from erniekit.models.generation_config import GENERATION_CONFIG_NAME, remember_source
from erniekit.utils.io import read_json_object
from erniekit.utils.registry import import_modules

# config.json without model_type: what our own early checkpoints wrote; read as this family
UNTYPED_FAMILY = "ernie4_5"


@dataclass(frozen=True)
class ModelFamily:
    """What one family provides. The model it builds is a paddle Layer with `.config` (carrying
    `model_type`, `vocab_size`, `eos_token_ids` and `save_pretrained(dir)`) whose forward takes
    `input_ids`, `labels`, ... as ERNIE 4.5's does: the loop, generation and the engine call it."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family reads
    presets: Callable[[], Mapping[str, Any]]  # preset name -> model config (built from scratch)
    read_config: Callable[[str], Any]  # checkpoint directory -> model config (one-line CheckpointError)
    build: Callable[[Any], Any]  # model config -> model with fresh weights (seeded by paddle.seed)
    load_weights: Callable[[Any, str], None]  # (model, checkpoint directory)
    state_dict: Callable[..., dict]  # (model, dtype=None) -> checkpoint-named full tensors
    save: Callable[..., None]  # (model, path, tokenizer=None, max_shard_size=, dtype=, state=)
    load_tokenizer: Callable[[str], Any]  # checkpoint or tokenizer directory -> tokenizer
    default_tokenizer: Callable[[], Any]  # the bundled tokenizer presets train with
    # model -> {parameter name: (kind, checkpoint tensor names)} without reading a weight (how a
    # writer plans a file: GGUF); None: the family does not say
    checkpoint_names: Callable[[Any], dict] | None = None
    # load_weights assigns every parameter or raises: a checkpoint's model is then built without
    # random weights first (erniekit/nn/deferred_init.py; any parameter left alone would be zero)
    loads_every_parameter: bool = False
    # (config, checkpoint directory, whether model_overrides changed the config): refuse a config that
    # disagrees with its weights (or claims absurd sizes) before the model is built, i.e. before
    # anything is allocated; None: not checked
    check_weights: Callable[[Any, str, bool], None] | None = None


_families: dict[str, ModelFamily] = {}


def register_model_family(family: ModelFamily) -> ModelFamily:
    _families[family.name] = family
    return family


def unregister_model_family(name: str) -> None:
    _families.pop(name, None)


def _load_builtins() -> None:
    """Import `family.py` of every package under erniekit/models/."""
    import_modules(__package__, [os.path.dirname(__file__)], submodule="family")


def families() -> list[ModelFamily]:
    _load_builtins()
    return list(_families.values())


def get_family(name: str) -> ModelFamily:
    _load_builtins()
    if name not in _families:
        raise CheckpointError(f"unknown model family {name!r}; known: {', '.join(_families)}")
    return _families[name]


def preset_names() -> list[str]:
    return [p for f in families() for p in f.presets()]


def _config_file_type(path: str) -> str | None:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{file}: config.json not found; not a checkpoint directory: give the one holding config.json and the weights"
        )
    model_type = read_json_object(file, "fix config.json").get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{file}: model_type={model_type!r} is not a string; fix config.json")
    return model_type


def family_of(name_or_path: str) -> ModelFamily:
    """The family of a checkpoint directory (its config.json model_type) or of a preset name."""
    if os.path.isdir(name_or_path):
        base = None if os.path.isfile(os.path.join(name_or_path, "config.json")) else adapter_base(name_or_path)
        if base:
            return family_of(base)  # an adapter saved without its base's config
        model_type = _config_file_type(name_or_path)
        if model_type is None:
            return get_family(UNTYPED_FAMILY)
        for f in families():
            if model_type in f.model_types:
                return f
        known = ", ".join(t for f in families() for t in f.model_types)
        raise CheckpointError(
            f"{os.path.join(name_or_path, 'config.json')}: model_type={model_type!r} is not a model family "
            f"erniekit knows ({known}); convert the checkpoint or register a family (CONTRIBUTING.md)"
        )
    for f in families():
        if name_or_path in f.presets():
            return f
    raise CheckpointError(
        f"{name_or_path!r} is neither a checkpoint directory nor a model preset; "
        f"use a checkpoint directory or one of: {', '.join(preset_names())}"
    )


def family_of_model(model: Any) -> ModelFamily:
    """The family that built `model` (by its config's model_type)."""
    model_type = model.config.model_type
    for f in families():
        if model_type in f.model_types:
            return f
    raise CheckpointError(f"model_type={model_type!r}: no registered model family builds this model")


def model_config(
    name_or_path: str, overrides: Mapping[str, Any] | None = None, family: ModelFamily | None = None
) -> Any:
    """The model config a checkpoint directory or preset describes, with `overrides` applied
    (`family`: already known to the caller, so config.json is not looked up again)."""
    f = family or family_of(name_or_path)
    if os.path.isdir(name_or_path):
        config = f.read_config(name_or_path)
    else:
        config = copy.deepcopy(f.presets()[name_or_path])  # never the shared preset object
    return config.replace(**overrides) if overrides else config


def load_model(name_or_path: str, overrides: Mapping[str, Any] | None = None, dtype: str = "float32") -> Any:
    """A checkpoint's model with its weights, or a preset's with fresh ones (seeded by paddle.seed)."""
    import paddle

    from erniekit.nn.deferred_init import skip_random_init

    f = family_of(name_or_path)
    from_checkpoint = os.path.isdir(name_or_path)
    config = model_config(name_or_path, overrides, f)
    if from_checkpoint and f.check_weights is not None:  # against the weights, before anything is allocated
        f.check_weights(config, name_or_path, bool(overrides))
    prev = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        # a family whose load assigns every parameter or refuses: no random draws first
        with skip_random_init() if from_checkpoint and f.loads_every_parameter else nullcontext():
            model = f.build(config)
    finally:
        paddle.set_default_dtype(prev)
    if from_checkpoint:
        f.load_weights(model, name_or_path)
        remember_source(model, name_or_path)  # its generation_config.json goes into the model's next save
    return model


ADAPTER_CONFIG = (
    "adapter_config.json"  # PEFT's name (erniekit.nn.lora.ADAPTER_CONFIG_NAME), checked before paddle loads
)
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # a directory with one of these carries its own tokenizer
_base_override: list[str] = []  # the innermost adapter_base_override's directory


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


@contextmanager
def adapter_base_override(base: str | None) -> Iterator[None]:
    """`--base-model DIR` of chat / export / server: inside the block every LoRA adapter directory is
    put on `base` instead of its adapter_config.json's base_model_name_or_path. A flag of the command,
    so it reaches every loader the command calls (the server's, --verify's) without a parameter each."""
    if base is None:
        yield
        return
    if not os.path.isdir(base):
        raise CheckpointError(f"--base-model {base}: not a directory; give the checkpoint the adapter was trained on")
    _base_override.append(base)
    try:
        yield
    finally:
        _base_override.pop()


def adapter_base_overridden() -> bool:
    """True inside an `adapter_base_override` block (a --base-model flag is in force)."""
    return bool(_base_override)


def adapter_base(path: str) -> str | None:
    """The base checkpoint of a LoRA adapter directory (PEFT layout); None for a full checkpoint.
    base_model_name_or_path is tried as given, then (relative) against the adapter directory: PEFT
    writes whatever path the base was loaded from, often relative to where training ran."""
    cfg_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_file):
        return None
    if _base_override:
        return _base_override[-1]
    base = read_json_object(cfg_file, "fix adapter_config.json").get("base_model_name_or_path")
    tried: list[str] = []
    if isinstance(base, str) and base:
        tried = [base] if os.path.isabs(base) else [base, os.path.join(path, base)]
        for candidate in tried:
            if os.path.isdir(candidate):
                return candidate
    where = f" (tried {' and '.join(os.path.abspath(t) for t in tried)})" if tried else ""
    raise CheckpointError(
        f"{cfg_file}: base_model_name_or_path={base!r} is not a checkpoint directory{where}; pass --base-model DIR "
        "or edit it to point at the base model the adapter was trained on"
    )


def tokenizer_dir(path: str) -> str:
    """The directory whose tokenizer a checkpoint uses: its own, or, for an adapter saved without
    one (PEFT saves none), its base checkpoint's."""
    if any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return path
    return adapter_base(path) or path


def load_model_or_adapter(path: str) -> Any:
    """A full checkpoint, or a LoRA adapter directory on top of its base checkpoint, merged for
    inference speed."""
    from erniekit.nn.lora import load_adapter, merge_and_unload

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    base = adapter_base(path)
    if base is None:
        return load_model(path)
    model = load_model(base)
    load_adapter(model, path)
    if os.path.isfile(os.path.join(path, GENERATION_CONFIG_NAME)):  # the adapter's own decoding defaults win
        remember_source(model, path)
    return merge_and_unload(model)


def load_tokenizer(model_name_or_path: str, tokenizer_path: str | None = None) -> Any:
    """The tokenizer at `tokenizer_path`, else the one saved beside the checkpoint (an adapter's base's
    when the adapter has none), else the bundled tokenizer of a preset's family."""
    f = family_of(model_name_or_path)
    if tokenizer_path:
        return f.load_tokenizer(tokenizer_path)
    return (
        f.load_tokenizer(tokenizer_dir(model_name_or_path))
        if os.path.isdir(model_name_or_path)
        else f.default_tokenizer()
    )


def save_model(model: Any, path: str, tokenizer: Any = None, **options: Any) -> None:
    """Write `model` in its family's checkpoint layout (options: max_shard_size, dtype, state)."""
    family_of_model(model).save(model, path, tokenizer=tokenizer, **options)


def checkpoint_names(model: Any) -> dict[str, tuple[str, list[str]]]:
    """{parameter name: (kind, checkpoint tensor names)} of `model`, from shapes only: 'copy',
    'transpose', 'experts' (one tensor per expert) or 'rowN' (a row of a shared tensor)."""
    f = family_of_model(model)
    if f.checkpoint_names is None:
        raise CheckpointError(f"model family {f.name!r} does not name its checkpoint tensors per parameter")
    return f.checkpoint_names(model)


def model_state(model: Any, dtype: str | None = None) -> dict:
    """`model`'s full tensors under its checkpoint names (a collective in multi-process runs)."""
    return family_of_model(model).state_dict(model, dtype)


def load_weights(model: Any, path: str) -> None:
    family_of_model(model).load_weights(model, path)
