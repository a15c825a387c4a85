"""Training checkpoints: model in HF layout + optimizer state + trainer state, written atomically.

A checkpoint is built in `checkpoint-N.tmp/`, fsynced and renamed to `checkpoint-N/` only when
complete (an existing `checkpoint-N/` is swapped out atomically, never deleted first), so a crash
mid-save never leaves a checkpoint that `resume_from_checkpoint: auto` would pick. A full disk
removes the partial one and says how much was to be written; earlier checkpoints stay as they were.
The final model in output_dir is published file by file (publish_model_files): old or new, never none.
Optimizer tensors are keyed by structured parameter names, stored in safetensors: no pickle.
"""

from __future__ import annotations

import math
import os
import re
import shutil

from erniekit.errors import CheckpointError
from erniekit.models.hf_files import STAGING_NAME, publish_model_files, start_staging
from erniekit.models.registry import load_weights, save_model
from erniekit.train.runners.base import StepRunner
from erniekit.utils.dtensor import is_main_process, to_dense
from erniekit.utils.io import atomic_write_json, open_safetensors, read_json_object, replace_dir, write_errors

OPTIMIZER_NAME = "optimizer.safetensors"
EMA_NAME = "ema.safetensors"
STATE_NAME = "trainer_state.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def save_model_or_adapter(
    model, path: str, tokenizer, base_model_name_or_path: str | None = None, runner: StepRunner | None = None
) -> None:
    """Full model in HF layout, or, for a LoRA run, only the adapter (PEFT layout) + tokenizer.
    runner: the run's step runner when this process holds part of the model (it gathers the rest)."""
    from erniekit.nn.lora import lora_layers, save_adapter

    if lora_layers(model):
        if is_main_process():  # staged and published like a full model: old adapter or new, never none
            needed = sum(int(p.numel()) * p.element_size() for p in model.parameters() if not p.stop_gradient)
            with write_errors("the LoRA adapter", path, needed, partial=os.path.join(path, STAGING_NAME)):
                staging = start_staging(path)
                save_adapter(model, staging, base_model_name_or_path=base_model_name_or_path)
                model.config.save_pretrained(staging)  # shapes of the base, so the directory is self-describing
                tokenizer.save_pretrained(staging)
                publish_model_files(staging, path)
        return
    state = runner.model_state(model) if runner is not None else None  # a pipeline's stages, a PS job's tables
    if state is None:
        save_model(model, path, tokenizer=tokenizer)
    else:
        save_model(model, path, tokenizer=tokenizer, state=state)


def save_checkpoint(
    path: str,
    model,
    tokenizer,
    optimizer,
    state: dict,
    base_model_name_or_path: str | None = None,
    extra_tensors: dict[str, dict] | None = None,
    runner: StepRunner | None = None,
) -> None:
    """In a multi-process run every rank calls this (the full values are gathered collectively);
    rank 0 alone writes, so the checkpoint is the unsharded layout any process count can load."""
    from safetensors.paddle import save_file

    runner = runner if runner is not None else StepRunner()
    tmp = path + ".tmp"
    main = is_main_process()
    if main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    opt = runner.optimizer_state(optimizer.state_dict())
    extra = {
        name: runner.full_tensors({k: to_dense(v) for k, v in tensors.items()})
        for name, tensors in (extra_tensors or {}).items()
    }
    needed = _model_bytes(model) + _tensor_bytes(opt) + sum(_tensor_bytes(t) for t in extra.values())
    last = list_checkpoints(os.path.dirname(path) or ".")
    hint = (
        f"; {last[-1][1]} (the last complete checkpoint) is intact: resume_from_checkpoint=auto continues from it"
        if last
        else "; no earlier checkpoint exists"
    )
    with write_errors(
        f"checkpoint {os.path.basename(path)}",
        os.path.dirname(os.path.abspath(path)),
        needed if main else 0,
        partial=tmp if main else None,
        hint=hint,
    ):
        save_model_or_adapter(model, tmp, tokenizer, base_model_name_or_path, runner)
        if main:
            save_file({k: v.contiguous() for k, v in opt.items()}, os.path.join(tmp, OPTIMIZER_NAME))
            for name, tensors in extra.items():  # e.g. ema.safetensors
                save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, name))
            atomic_write_json(os.path.join(tmp, STATE_NAME), state)
            replace_dir(tmp, path)
    runner.sync()  # no rank runs ahead of a checkpoint that is not on disk yet (PS servers too)


def _tensor_bytes(tensors: dict) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors.values())


def _model_bytes(model) -> int:
    """Bytes the model part of a checkpoint takes: the adapter of a LoRA run, else every parameter."""
    from erniekit.nn.lora import lora_layers

    params = [p for p in model.parameters() if not p.stop_gradient] if lora_layers(model) else model.parameters()
    return sum(int(math.prod(p.shape)) * p.element_size() for p in params)


def load_checkpoint(path: str, model, optimizer, partial: bool = False) -> dict:
    """Restore model weights and optimizer state; return the trainer state. partial: this process
    holds part of the model (a pipeline stage, a PS worker) and takes its parameters' state only."""
    state_file = os.path.join(path, STATE_NAME)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"resume_from_checkpoint={path}: no {STATE_NAME}; is this a training checkpoint?")
    state = read_json_object(state_file, "the checkpoint is damaged: resume from an earlier one")
    from erniekit.nn.lora import ADAPTER_CONFIG_NAME, load_adapter_weights

    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME)):
        load_adapter_weights(model, path)
    else:
        load_weights(model, path)
    opt_file = os.path.join(path, OPTIMIZER_NAME)
    if optimizer is not None and os.path.isfile(opt_file):
        known = {n for n, _ in optimizer.params} if partial else None  # this stage's / worker's only
        with open_safetensors(opt_file) as f:
            sd = {
                key: f.get_tensor(key)
                for key in f.keys()
                if known is None or key == "__step__" or key.rsplit("::", 1)[0] in known
            }
        try:
            optimizer.set_state_dict(sd)
        except KeyError as e:
            raise CheckpointError(f"{opt_file}: optimizer state for unknown parameter {e.args[0]}") from None
    return state


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        if m and os.path.isfile(os.path.join(output_dir, name, STATE_NAME)):
            found.append((int(m[1]), os.path.join(output_dir, name)))
    return sorted(found)


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`auto` -> newest complete checkpoint in output_dir (or None); a path must exist."""
    if not value:
        return None
    if value == "auto":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1][1] if ckpts else None
    if not os.path.isdir(value):
        raise CheckpointError(f"resume_from_checkpoint={value}: directory not found")
    return value


def rotate_checkpoints(output_dir: str, keep: int) -> None:
    if keep <= 0 or not is_main_process():
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
