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
import shutil

from erniekit.errors import CheckpointError
from erniekit.models.hf_files import STAGING_NAME, publish_model_files, start_staging
from erniekit.models.registry import load_weights, save_model
from erniekit.train.runners.base import StepRunner
from erniekit.utils.checkpoint_dirs import STATE_NAME, list_checkpoints  # noqa: F401 - re-exported
from erniekit.utils.dtensor import is_main_process, to_dense
from erniekit.utils.io import atomic_write_json, open_safetensors, read_json_object, replace_dir, write_errors

OPTIMIZER_NAME = "optimizer.safetensors"
EMA_NAME = "ema.safetensors"


def save_model_or_adapter(
    model, path: str, tokenizer, base_model_name_or_path: str | None = None, runner: StepRunner | None = None
) -> None:
    """Full model in HF layout, or, for a LoRA run, only the adapter (PEFT layout) + tokenizer.
    runner: the run's step runner when this process holds part of the model (it gathers the rest)."""
    from erniekit.nn.lora import adapter_tensors, has_lora, save_adapter

    if has_lora(model):
        # a pipeline stage holds its layers' adapters: every stage sends its share, rank 0 gets them all
        tensors = runner.full_tensors(adapter_tensors(model)) if runner is not None and runner.partial else None
        if is_main_process():  # staged and published like a full model: old adapter or new, never none
            needed = _model_bytes(model) if tensors is None else _tensor_bytes(tensors)
            with write_errors("the LoRA adapter", path, needed, partial=os.path.join(path, STAGING_NAME)):
                staging = start_staging(path)
                save_adapter(model, staging, base_model_name_or_path=base_model_name_or_path, tensors=tensors)
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
    rank 0 alone writes, so the checkpoint is the unsharded layout any process count can load.
    extra_tensors: file name -> tensors (safetensors), or, for a name ending in `.json`, a JSON document."""
    from safetensors.paddle import save_file

    runner = runner if runner is not None else StepRunner()
    tmp = path + ".tmp"
    main = is_main_process()
    if main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    opt = runner.optimizer_state(optimizer.state_dict())
    documents = {n: doc for n, doc in (extra_tensors or {}).items() if n.endswith(".json")}  # JSON, as they are
    extra = {
        name: runner.full_tensors({k: to_dense(v) for k, v in tensors.items()})
        for name, tensors in (extra_tensors or {}).items()
        if name not in documents
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
            for name, doc in documents.items():  # e.g. control_attributes.json
                atomic_write_json(os.path.join(tmp, name), doc)
            atomic_write_json(os.path.join(tmp, STATE_NAME), state)
            replace_dir(tmp, path)
    runner.sync()  # no rank runs ahead of a checkpoint that is not on disk yet (PS servers too)


def _tensor_bytes(tensors: dict) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors.values())


def _model_bytes(model) -> int:
    """Bytes the model part of a checkpoint takes: the adapter of a LoRA run, else every parameter."""
    from erniekit.nn.lora import has_lora

    params = [p for p in model.parameters() if not p.stop_gradient] if has_lora(model) else model.parameters()
    return sum(int(math.prod(p.shape)) * p.element_size() for p in params)


# what a resumed run must share with the run that wrote the checkpoint: its model, its data and
# the order micro-batch i takes from them (MicroBatches: a function of seed, rows and batch size)
RUN_KEYS = (
    "stage",
    "fine_tuning",
    "model_name_or_path",
    "model_overrides",
    "train_dataset_path",
    "train_dataset_type",
    "max_seq_len",
    "packing",
    "truncation",
    "chat_template",
    "seed",
    "gradient_accumulation_steps",
    "lora_rank",
    "lora_alpha",
    "lora_target_modules",
    "rslora",
    "use_dora",
)
# what may change on a resume (a longer run, another rate, another EMA decay), said in one line each
SCHEDULE_KEYS = (
    "learning_rate",
    "min_lr",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "decay_ratio",
    "ema_decay",
)


def run_identity(cfg, micro_batch_rows: int, train_rows: int) -> dict:
    """The checkpoint's record of its run: RUN_KEYS and SCHEDULE_KEYS as the config had them, and
    the global micro-batch (per-device batch x data ranks: the process count may change) and rows."""
    out = {k: getattr(cfg, k) for k in RUN_KEYS + SCHEDULE_KEYS}
    return {**out, "micro_batch_rows": micro_batch_rows, "train_rows": train_rows}


def read_trainer_state(path: str) -> dict:
    """trainer_state.json of a checkpoint, with the keys a resume needs checked (a checkpoint of
    another trainer has none of them)."""
    state_file = os.path.join(path, STATE_NAME)
    if not os.path.isfile(state_file):
        raise CheckpointError(
            f"resume_from_checkpoint={path}: no {STATE_NAME}; give a checkpoint-N directory of an erniekit run, "
            "or resume_from_checkpoint=auto"
        )
    state = read_json_object(state_file, "the checkpoint is damaged: resume from an earlier one")
    for key in ("global_step", "consumed_micro_batches"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"{state_file}: {key} is {value!r}, not a step count; this is not an erniekit training checkpoint "
                "(fine-tune from its weights with model_name_or_path instead)"
            )
    return state


def check_same_run(path: str, state: dict, cfg, micro_batch_rows: int, train_rows: int, total_steps: int) -> list[str]:
    """Refuse a resume whose model, data or data order differ from the checkpoint's run (its
    micro-batch i would be other rows, its weights another model's); the schedule's changes come
    back as lines to log. Checkpoints written before this record carry none: nothing to compare."""
    was = state.get("run")
    if not isinstance(was, dict):
        return []
    now = run_identity(cfg, micro_batch_rows, train_rows)
    differ = [k for k in (*RUN_KEYS, "micro_batch_rows", "train_rows") if k in was and was[k] != now[k]]
    if differ:
        changes = ", ".join(f"{k} {was[k]!r} -> {now[k]!r}" for k in differ)
        raise CheckpointError(
            f"resume_from_checkpoint={path}: this run differs from the one that wrote the checkpoint ({changes}); "
            "a resume continues that run: restore those settings, or start a new run in another output_dir "
            "(model_name_or_path can start from the checkpoint's weights)"
        )
    notes = [f"{k} {was[k]!r} -> {now[k]!r}" for k in SCHEDULE_KEYS if k in was and was[k] != now[k]]
    if state.get("total_steps") not in (None, total_steps):
        notes.append(f"total steps {state['total_steps']} -> {total_steps}")
    return (
        [f"resuming with a changed schedule ({', '.join(notes)}): the learning rate follows the new one"]
        if notes
        else []
    )


def load_checkpoint(path: str, model, optimizer, partial: bool = False) -> dict:
    """Restore model weights and optimizer state; return the trainer state. partial: this process
    holds part of the model (a pipeline stage, a PS worker) and takes its parameters' state only."""
    state = read_trainer_state(path)
    from erniekit.nn.lora import ADAPTER_CONFIG_NAME, load_adapter_weights

    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME)):
        load_adapter_weights(model, path)
    else:
        load_weights(model, path)
    opt_file = os.path.join(path, OPTIMIZER_NAME)
    if optimizer is not None and not os.path.isfile(opt_file):  # fresh moments would change every later step
        raise CheckpointError(
            f"{path} has no {OPTIMIZER_NAME}, so the optimizer would restart from zero; resume from a complete "
            "checkpoint, or start a new run from its weights (model_name_or_path)"
        )
    if optimizer is not None:
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
