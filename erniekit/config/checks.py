"""Semantic checks run before the first step, so a bad run fails in a second, not an hour in."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile

from erniekit.config.cross_cluster_checks import MAX_TIMEOUT_S, check_cross_cluster, normalise_cross_cluster
from erniekit.config.loader import default, typed_list
from erniekit.config.schema import SECTION_KEYS, TrainConfig, fields
from erniekit.data.dataset_info import load_entry, parse_ref
from erniekit.errors import ConfigError, DataError

# Limits on the learning rate (docs/training.md, "Limits"). AdamW moves every weight by about
# learning_rate per step whatever the gradient's size, and weights start near 0.02: above 1 every
# step rewrites the model (1e6 "trains" to a collapsed model); above 1e-2 is beyond published
# recipes for transformers (the tiny configs use 3e-3), legal but worth a loud warning.
MAX_LEARNING_RATE = 1.0
WARN_LEARNING_RATE = 1e-2
_warned: set[str] = set()
_pending: list[str] = []


def _warn(message: str) -> None:
    """A legal but suspicious setting; printed once validation has passed (an error stays one line)."""
    _pending.append(message)


def _flush_warnings() -> None:
    """One loud line on stderr per suspicious setting, once per process, before the first step."""
    for message in _pending:
        if message not in _warned:
            _warned.add(message)
            print(f"WARNING: {message}", file=sys.stderr, flush=True)
    _pending.clear()


def stage_supports(cfg: TrainConfig):
    """What cfg's stage declares it can run with (erniekit/train/stage.py: Supports)."""
    from erniekit.train.stages import stage_class

    return stage_class(cfg.stage).supports


def fused_head_wanted(cfg) -> bool:
    """fused_head_loss is on and nothing reads the batch's logits: the elastic sandwich's teacher,
    online distillation's students, the token-balanced loss (a stage whose Supports.fused_head is
    set then takes the head chunk by chunk; the planner counts its memory so)."""
    return bool(
        getattr(cfg, "fused_head_loss", False)
        and not getattr(cfg, "elastic_sandwich", False)
        and not getattr(cfg, "online_distill_students", None)
        and not getattr(cfg, "loss_token_balance", False)
    )


def _stages_that(capability: str, sep: str = " and ") -> str:
    """The registered stages declaring `capability`, for an error message: "pretrain and SFT"."""
    from erniekit.train.stages import stage_classes

    names = [c.name for c in stage_classes() if getattr(c.supports, capability)]
    if sep == " and " and len(names) > 2:  # "DPO, pretrain and SFT"
        return ", ".join(names[:-1]) + " and " + names[-1]
    return sep.join(names)


def normalise(cfg: TrainConfig) -> TrainConfig:
    """Canonical spellings, derived defaults and typed lists; raises ConfigError on values that
    cannot be read at all."""
    _pending.clear()
    changes = _normalise_choices(cfg)
    if cfg.logging_dir is None:
        changes["logging_dir"] = os.path.join(cfg.output_dir, "vdl_log")
    compute = changes.get("compute_type", cfg.compute_type)
    if compute in ("bf16", "fp16", "fp8"):
        changes[compute] = True
    changes.update(_normalise_elastic(cfg))
    changes.update(_normalise_rl_lists(cfg))
    changes.update(_normalise_dataset_names(cfg))
    changes.update(normalise_cross_cluster(cfg))
    return dataclasses.replace(cfg, **changes)


def _normalise_dataset_names(cfg: TrainConfig) -> dict:
    """With dataset_dir (LLaMA-Factory's), the dataset paths name datasets of its dataset_info.json:
    each name becomes the entry DIR/dataset_info.json:NAME the data readers take."""
    from erniekit.data.dataset_info import dataset_ref

    if cfg.dataset_dir is None:
        return {}
    if not os.path.isdir(cfg.dataset_dir):
        raise ConfigError(
            f"dataset_dir={cfg.dataset_dir}: not a directory; give the directory holding dataset_info.json "
            f"(relative paths start at {os.getcwd()})"
        )
    changes = {}
    for key in ("train_dataset_path", "eval_dataset_path"):
        value = getattr(cfg, key)
        if value is None:
            continue
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        changes[key] = ",".join(n if parse_ref(n) else dataset_ref(cfg.dataset_dir, n) for n in names)
    return changes


def check(cfg: TrainConfig) -> None:
    """Raise ConfigError naming the first bad key of a normalised config; print its warnings."""
    _check_finite(cfg)
    _check_ranges(cfg)
    _check_elastic_sandwich(cfg)
    _check_length(cfg)
    _check_paths(cfg)
    _check_precision(cfg)
    _check_parallel(cfg)
    _check_online_distill(cfg)
    _check_distill(cfg)
    _check_stage_keys(cfg)
    _check_init_layers(cfg)  # after the teacher's check: a demo naming both reports the teacher first
    _check_control(cfg)
    check_cross_cluster(cfg, stage_supports(cfg))
    _flush_warnings()


def _normalise_choices(cfg: TrainConfig) -> dict[str, str]:
    """Map case-insensitive spellings (sft, PT, LORA...) to canonical names."""
    changes = {}
    for f in fields():
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        value = getattr(cfg, f.name)
        if value is None and f.default is None:  # an optional choice left unset
            continue
        canonical = choices.get(str(value).lower())
        if canonical is None:
            allowed = ", ".join(dict.fromkeys(choices.values()))
            raise ConfigError(f"{f.name}={value!r} is not supported; set {f.name} to one of: {allowed}")
        changes[f.name] = canonical
    return changes


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: it must be {rule}; change {key}")


def _check_finite(cfg: TrainConfig) -> None:
    """nan and inf pass every `>=` / `<=` test that is written the wrong way round; refuse them once, here."""
    for f in fields():
        value = getattr(cfg, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{f.name}={value!r} is invalid: it must be a finite number; change {f.name}")


def _check_ranges(cfg: TrainConfig) -> None:
    _require(
        cfg.max_steps >= 1 or cfg.max_steps == -1,
        "max_steps",
        cfg.max_steps,
        "a positive number of optimizer steps, or -1 to train for num_train_epochs",
    )
    _require(cfg.num_train_epochs >= 0, "num_train_epochs", cfg.num_train_epochs, ">= 0")
    _require(
        0 < cfg.learning_rate <= MAX_LEARNING_RATE,
        "learning_rate",
        cfg.learning_rate,
        f"in (0, {MAX_LEARNING_RATE:g}] (AdamW moves every weight by about learning_rate per step; "
        "typical values are 1e-5 to 3e-3)",
    )
    if cfg.learning_rate > WARN_LEARNING_RATE:
        _warn(
            f"learning_rate={cfg.learning_rate:g} is above {WARN_LEARNING_RATE:g}, larger than published "
            "recipes for transformers (1e-5 to 3e-3); expect divergence, or lower learning_rate"
        )
    if cfg.max_steps > 0 and cfg.warmup_steps > cfg.max_steps:
        _warn(
            f"warmup_steps={cfg.warmup_steps} > max_steps={cfg.max_steps}: the learning rate only reaches "
            f"{cfg.max_steps / cfg.warmup_steps:.0%} of learning_rate={cfg.learning_rate:g}; for a real run "
            "set warmup_steps <= max_steps"
        )
    _require(
        cfg.learning_rate * cfg.weight_decay < 1,
        "weight_decay",
        cfg.weight_decay,
        f"< 1 / learning_rate = {1 / cfg.learning_rate:g} (AdamW shrinks every weight by "
        "learning_rate x weight_decay per step)",
    )
    _require(0 <= cfg.seed < 2**32, "seed", cfg.seed, "in [0, 2**32)")
    for key in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "save_steps",
        "eval_steps",
        "eval_max_new_tokens",
        "eval_max_samples",
    ):
        _require(getattr(cfg, key) >= 1, key, getattr(cfg, key), ">= 1")
    for key in (
        "warmup_steps",
        "save_total_limit",
        "routing_plot_steps",
        "dataloader_num_workers",
        "seed",
        "weight_decay",
        "max_grad_norm",
        "min_lr",
    ):
        _require(getattr(cfg, key) >= 0, key, getattr(cfg, key), ">= 0")
    _require(cfg.max_seq_len >= 8, "max_seq_len", cfg.max_seq_len, ">= 8")
    _require(cfg.min_lr <= cfg.learning_rate, "min_lr", cfg.min_lr, f"<= learning_rate ({cfg.learning_rate})")
    _require(cfg.adam_epsilon > 0, "adam_epsilon", cfg.adam_epsilon, "> 0")
    for key in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(cfg, key) < 1, key, getattr(cfg, key), "in [0, 1)")
    for key in ("warmup_ratio", "decay_ratio"):
        _require(0 <= getattr(cfg, key) <= 1, key, getattr(cfg, key), "in [0, 1]")
    if stage_supports(cfg).rollouts:
        _check_rl(cfg)
    else:
        _require(cfg.beta > 0, "beta", cfg.beta, "> 0")
    _check_lora_keys(cfg)
    if cfg.lora_target_modules:  # before the planner (parallel: auto) or the model reads it
        from erniekit.nn.lora_targets import compile_target

        compile_target(cfg.lora_target_modules, "lora_target_modules")
    _require(cfg.lora_rank >= 1, "lora_rank", cfg.lora_rank, ">= 1")
    _require(cfg.lora_alpha > 0, "lora_alpha", cfg.lora_alpha, "> 0")
    for key in ("simpo_gamma", "dpop_lambda"):
        _require(getattr(cfg, key) >= 0, key, getattr(cfg, key), ">= 0")
    _require(0 <= cfg.lora_dropout < 1, "lora_dropout", cfg.lora_dropout, "in [0, 1)")
    _require(cfg.lora_plus_scale > 0, "lora_plus_scale", cfg.lora_plus_scale, "> 0")
    _require(
        cfg.vit_lr_ratio > 0,
        "vit_lr_ratio",
        cfg.vit_lr_ratio,
        "> 0 (freeze_vision_encoder / freeze_resampler keep parts fixed)",
    )
    _require(
        cfg.lora_base_dtype in (None, "bfloat16", "float16", "float32"),
        "lora_base_dtype",
        cfg.lora_base_dtype,
        "null, bfloat16, float16 or float32",
    )
    _require(
        cfg.lora_peft_layout in ("auto", "fused", "per_expert"),
        "lora_peft_layout",
        cfg.lora_peft_layout,
        "auto, fused or per_expert",
    )
    _require(0 <= cfg.label_smoothing < 0.5, "label_smoothing", cfg.label_smoothing, "in [0, 0.5)")
    _require(cfg.sft_loss_ratio >= 0, "sft_loss_ratio", cfg.sft_loss_ratio, ">= 0")
    if (cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k) and not stage_supports(cfg).elastic:
        raise ConfigError(
            f"elastic_* sub-model training applies to the {_stages_that('elastic')} stages, not "
            f"{cfg.stage}; clear elastic_depth, elastic_experts and elastic_top_k"
        )
    if cfg.packing and not stage_supports(cfg).packing:
        raise ConfigError(
            f"packing applies to the {_stages_that('packing')} stages, not {cfg.stage}; set packing=false"
        )
    if cfg.loss_token_balance and not stage_supports(cfg).token_balance:
        raise ConfigError(
            f"loss_token_balance applies to the {_stages_that('token_balance')} stages, not {cfg.stage}; "
            "set loss_token_balance=false"
        )
    _require(0 <= cfg.ema_decay < 1, "ema_decay", cfg.ema_decay, "in [0, 1) (0 turns the EMA off)")
    _require(cfg.fp8_block_size >= 1, "fp8_block_size", cfg.fp8_block_size, ">= 1")
    if cfg.label_smoothing > 0 and cfg.loss_type not in ("sigmoid", "simpo"):
        raise ConfigError(
            f"label_smoothing={cfg.label_smoothing} applies to loss_type sigmoid or simpo only, "
            f"not {cfg.loss_type}; set label_smoothing=0"
        )


def _check_rl(cfg: TrainConfig) -> None:
    _require(cfg.beta >= 0, "beta", cfg.beta, ">= 0 (0 drops the reference model)")
    low = stage_supports(cfg).min_generations
    _require(
        cfg.num_generations >= low,
        "num_generations",
        cfg.num_generations,
        f">= {low}" + (" (group-relative advantages compare samples of one prompt)" if low == 2 else ""),
    )
    for key in ("max_new_tokens", "num_iterations"):
        _require(getattr(cfg, key) >= 1, key, getattr(cfg, key), ">= 1")
    _require(cfg.temperature > 0, "temperature", cfg.temperature, "> 0 (RL samples; greedy rollouts give no variance)")
    _require(0 < cfg.top_p <= 1, "top_p", cfg.top_p, "in (0, 1]")
    _require(0 < cfg.epsilon < 1, "epsilon", cfg.epsilon, "in (0, 1)")
    if cfg.epsilon_high is not None:
        _require(cfg.epsilon_high > 0, "epsilon_high", cfg.epsilon_high, "> 0 or null")
    _require(0 <= cfg.gamma <= 1, "gamma", cfg.gamma, "in [0, 1]")
    _require(0 <= cfg.lam <= 1, "lam", cfg.lam, "in [0, 1]")
    _require(cfg.vf_coef >= 0, "vf_coef", cfg.vf_coef, ">= 0")
    _require(cfg.cliprange_value > 0, "cliprange_value", cfg.cliprange_value, "> 0")
    _require(
        cfg.max_new_tokens < cfg.max_seq_len,
        "max_new_tokens",
        cfg.max_new_tokens,
        f"< max_seq_len ({cfg.max_seq_len}), leaving room for the prompt",
    )
    _require(bool(cfg.reward_funcs), "reward_funcs", cfg.reward_funcs, "a non-empty list, e.g. [accuracy]")
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward_funcs):
        raise ConfigError(
            f"reward_weights has {len(cfg.reward_weights)} values for {len(cfg.reward_funcs)} reward_funcs; "
            "give one weight per function or [] for all 1"
        )


def _normalise_rl_lists(cfg: TrainConfig) -> dict:
    out = {
        "reward_funcs": typed_list("reward_funcs", cfg.reward_funcs, str),
        "reward_weights": typed_list("reward_weights", cfg.reward_weights, float),
        "stop_token_ids": typed_list("stop_token_ids", cfg.stop_token_ids, int),
    }
    _require(
        all(v >= 0 for v in out["stop_token_ids"]), "stop_token_ids", out["stop_token_ids"], "a list of token ids >= 0"
    )
    return out


def _normalise_elastic(cfg: TrainConfig) -> dict:
    """Elastic sub-model choices as sorted unique int lists, range-checked against each other;
    ranges against the model (depth <= num_hidden_layers, experts <= moe_num_experts) are checked
    when the model is loaded (erniekit.elastic.submodels.ElasticTraining.from_config)."""
    out = {
        k: sorted(set(typed_list(k, getattr(cfg, k), int)))
        for k in ("elastic_depth", "elastic_experts", "elastic_top_k")
    }
    for key, values in out.items():
        _require(all(v >= 1 for v in values), key, values, "a list of integers >= 1")
    if out["elastic_top_k"] and out["elastic_experts"]:
        _require(
            max(out["elastic_top_k"]) <= min(out["elastic_experts"]),
            "elastic_top_k",
            out["elastic_top_k"],
            f"<= min(elastic_experts) = {min(out['elastic_experts'])}",
        )
    _require(0 <= cfg.elastic_full_prob <= 1, "elastic_full_prob", cfg.elastic_full_prob, "in [0, 1]")
    _require(0 <= cfg.elastic_distill_weight <= 1, "elastic_distill_weight", cfg.elastic_distill_weight, "in [0, 1]")
    return out


def _check_elastic_sandwich(cfg: TrainConfig) -> None:
    if cfg.elastic_distill_weight > 0 and not cfg.elastic_sandwich:
        raise ConfigError(
            f"elastic_distill_weight={cfg.elastic_distill_weight} needs elastic_sandwich: true (the "
            "full model of the same step is the teacher); set it or set elastic_distill_weight=0"
        )
    if not cfg.elastic_sandwich:
        return
    if not (cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k):
        raise ConfigError(
            "elastic_sandwich: true needs sub-models to train; set elastic_depth, elastic_experts or elastic_top_k"
        )
    if not stage_supports(cfg).elastic_sandwich:
        raise ConfigError(
            f"elastic_sandwich applies to the LM stages ({_stages_that('elastic_sandwich', ', ')}), "
            f"not {cfg.stage}; "
            "set elastic_sandwich=false"
        )


def _check_online_distill(cfg: TrainConfig) -> None:
    """online_distill_students (docs/online_distillation.md): the chain of teachers, each student's shape
    against the model's, and what this version trains beside students."""
    _require(cfg.online_distill_every >= 1, "online_distill_every", cfg.online_distill_every, ">= 1")
    _require(cfg.online_distill_start >= 0, "online_distill_start", cfg.online_distill_start, ">= 0")
    _require(0 <= cfg.online_distill_beta <= 1, "online_distill_beta", cfg.online_distill_beta, "in [0, 1]")
    _require(cfg.online_distill_temperature > 0, "online_distill_temperature", cfg.online_distill_temperature, "> 0")
    _require(0 <= cfg.online_distill_alpha <= 1, "online_distill_alpha", cfg.online_distill_alpha, "in [0, 1]")
    if not cfg.online_distill_students:
        return
    from erniekit.distributed.collective.layout import layout_from_config
    from erniekit.models.registry import model_config
    from erniekit.train.online_distill_spec import (
        KEY,
        MAIN_TEACHER,
        hidden_layer_map_error,
        parse_students,
        student_config,
    )

    if not stage_supports(cfg).online_distill:
        raise ConfigError(f"{KEY} applies to the {_stages_that('online_distill')} stages, not {cfg.stage}; clear {KEY}")
    why = None
    lay = layout_from_config(cfg.parallelism) if cfg.distributed_mode == "collective" else None
    if cfg.fine_tuning != "Full":
        why = f"trains full models, not fine_tuning={cfg.fine_tuning}; set fine_tuning=Full"
    elif cfg.loss_token_balance:
        why = "averages over trained tokens only; set loss_token_balance=false"
    elif cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k:
        why = "does not train elastic sub-models; clear elastic_depth, elastic_experts and elastic_top_k"
    elif cfg.fp16:
        why = "does not run fp16 loss scaling; use bf16 or float32"
    elif lay is None or cfg.parallel:
        why = "runs in one process or with plain data parallelism; set distributed_mode=collective, no parallel: auto"
    if why:
        raise ConfigError(f"{KEY} {why}")
    why = _online_distill_layout_refusal(cfg, lay)
    if why:
        raise ConfigError(why)
    specs = parse_students(cfg.online_distill_students)
    teacher = model_config(cfg.model_name_or_path, cfg.model_overrides or None)
    configs = {MAIN_TEACHER: teacher}
    for i, spec in enumerate(specs):
        where = f"{KEY}[{i}] ({spec.name})"
        c = configs[spec.name] = student_config(spec, cfg.model_name_or_path, cfg.model_overrides, where)
        if c.vocab_size != teacher.vocab_size:
            raise ConfigError(
                f"{where}: vocab_size={c.vocab_size} differs from the model's {teacher.vocab_size}; a student "
                "shares the teacher's tokenizer and vocabulary"
            )
        if cfg.fp8 and c.is_moe:
            sizes = [("hidden_size", c.hidden_size)] + [("moe_intermediate_size", n) for n in c.expert_sizes]
            bad = [(k, n) for k, n in sizes if n % cfg.fp8_block_size]
            if bad:
                raise ConfigError(
                    f"{where}: fp8_block_size={cfg.fp8_block_size} does not divide {bad[0][0]}={bad[0][1]} of this "
                    "MoE student; choose sizes that are multiples of it (or moe_num_experts: 0)"
                )
        if c.is_moe and not teacher.is_moe and lay.world > 1:
            raise ConfigError(
                f"{where}: a MoE student of a dense model runs in one process in this version (its router "
                "statistics are summed over the data ranks through the teacher's MoE layers); use moe_num_experts: 0"
            )
    for i, spec in enumerate(specs):
        hidden_layer_map_error(spec, configs[spec.name], configs[spec.teacher], f"{KEY}[{i}] ({spec.name})")


def _online_distill_layout_refusal(cfg: TrainConfig, lay) -> str | None:
    """Students train beside the model in one process or with plain data parallelism only."""
    if not cfg.online_distill_students or not _splits_model(lay):
        return None
    from erniekit.train.online_distill_spec import KEY

    return (
        f"{KEY} runs in one process or with plain data parallelism (each rank holds every model), not "
        f"{lay.describe()}; set tensor/expert/pipeline degrees to 1 and no sharding"
    )


def _check_length(cfg: TrainConfig) -> None:
    if cfg.do_train and cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise ConfigError(
            f"max_steps={cfg.max_steps} and num_train_epochs={cfg.num_train_epochs} give no "
            f"training length; set max_steps > 0 or num_train_epochs > 0"
        )


def _check_stream(cfg: TrainConfig, key: str, path: str) -> None:
    """A dataset that is not a regular file: a pipe (process substitution) is read once, by one
    process; a device never ends."""
    from erniekit.data.formats import is_device

    if is_device(path):
        raise ConfigError(f"{key}: {path} is a device, not a dataset file; point it at a .jsonl/.json/.txt file")
    if cfg.nproc_per_node * cfg.nnodes > 1:
        raise ConfigError(
            f"{key}: {path} is a pipe, which one process can read once; each of the {cfg.nproc_per_node * cfg.nnodes} "
            "processes reads the data itself: write the stream to a file first"
        )


def _check_paths(cfg: TrainConfig) -> None:
    datasets = [("eval_dataset_path", cfg.eval_dataset_path)]
    if cfg.do_train:
        datasets.insert(0, ("train_dataset_path", cfg.train_dataset_path))
    for key, value in datasets:
        if value is None:
            continue
        paths = [p.strip() for p in value.split(",") if p.strip()]
        _require(bool(paths), key, value, "one or more comma-separated file paths")
        for p in paths:
            if p.startswith("synthetic:"):  # generated at run time (erniekit/data/synthetic_vl.py)
                if not stage_supports(cfg).images:
                    raise ConfigError(
                        f"{key}: {p} is a synthetic picture dataset; it trains with stage: {_stages_that('images', ' or ')}"
                    )
                continue
            if parse_ref(p) is not None:  # a LLaMA-Factory dataset: its entry and file are checked now
                try:
                    load_entry(*parse_ref(p))
                except DataError as e:
                    raise ConfigError(f"{key}: {e}") from None
                continue
            if not os.path.exists(p):
                raise ConfigError(f"{key}: file not found: {p}; fix the path (relative paths start at {os.getcwd()})")
            if not os.path.isfile(p) and not os.path.isdir(p):
                _check_stream(cfg, key, p)
    _check_model(cfg.model_name_or_path)
    check_writable_dir("output_dir", cfg.output_dir)
    if cfg.tokenized_path and not os.path.isfile(os.path.join(cfg.tokenized_path, "train", "store.json")):
        check_writable_dir("tokenized_path", cfg.tokenized_path)  # the first run builds the store there
    if cfg.logging_dir != os.path.join(cfg.output_dir, "vdl_log"):
        check_writable_dir("logging_dir", cfg.logging_dir)
    resume = cfg.resume_from_checkpoint
    if resume is not None and resume != "auto" and not os.path.isdir(resume):
        raise ConfigError(
            f"resume_from_checkpoint: directory not found: {resume}; "
            f"give a checkpoint directory, 'auto' for the latest in output_dir, or null"
        )


def check_writable_dir(key: str, path: str) -> None:
    """The run writes here, so find out now rather than after loading the model: the path (or its
    nearest existing parent, which the run would create it under) must be a directory we can write in."""
    if not str(path).strip():
        raise ConfigError(f"{key} is empty; set {key} to a directory to write the run into")
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}={path}: {probe} is a file, not a directory; choose another {key}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".erniekit-write-check-", dir=probe))
    except OSError as e:
        raise ConfigError(
            f"{key}={path}: cannot create files in {probe} ({e.strerror}); choose a writable {key}"
        ) from None


def _check_lora_keys(cfg: TrainConfig) -> None:
    """LoRA settings without fine_tuning: LoRA would be read by nothing: a full fine-tune runs
    where the user asked for adapters."""
    if cfg.fine_tuning == "LoRA":
        if not os.path.isdir(cfg.model_name_or_path):
            _warn(
                f"fine_tuning=LoRA on the preset {cfg.model_name_or_path}: the base weights are random and not saved, "
                "so the adapter works in this run only (export and chat need the base); to keep it, train Full "
                "first and point model_name_or_path at that checkpoint"
            )
        return
    changed = _changed(cfg, SECTION_KEYS["lora"])
    if changed:
        raise ConfigError(
            f"{changed[0]}={getattr(cfg, changed[0])} is a LoRA setting, but fine_tuning={cfg.fine_tuning}: "
            "set fine_tuning=LoRA to train adapters, or remove it"
        )


def _refuse_adapter(key: str, path: str) -> None:
    """A LoRA run's output has a config.json too, but no weights of the whole model: say so, not
    that model.safetensors is missing."""
    from erniekit.models.registry import is_adapter_dir

    if is_adapter_dir(path):
        raise ConfigError(
            f"{key}: {path} is a LoRA adapter (adapter_config.json), not a whole model; merge it first "
            f"(erniekit export {path} -o MERGED) and give MERGED"
        )


def _check_model(name: str) -> None:
    """A directory must hold config.json; anything else must be a built-in preset."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(
                f"model_name_or_path: {name} has no config.json; point it at a Hugging Face-layout checkpoint directory"
            )
        _refuse_adapter("model_name_or_path", name)
        return
    from erniekit.models.registry import preset_names

    if name not in preset_names():
        made_by = _config_writing(name)  # another shipped config's output (output/tiny-sft): say which
        if made_by:
            raise ConfigError(
                f"model_name_or_path: {name} does not exist (relative paths start at {os.getcwd()}); "
                f"run `erniekit train {made_by}` first (it writes the model there)"
            )
        raise ConfigError(
            f"model_name_or_path: {name!r} is neither a directory nor a preset; "
            f"use a checkpoint directory or one of: {', '.join(preset_names())}"
        )


def _check_precision(cfg: TrainConfig) -> None:
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("bf16=true and fp16=true are both set; pick one (set the other to false)")
    if not (cfg.bf16 or cfg.fp16):
        return
    key = "bf16" if cfg.bf16 else "fp16"
    from erniekit.utils.device import cuda_visible

    if not cuda_visible():
        raise ConfigError(
            f"{key}=true needs a CUDA GPU, but this paddlepaddle has none (the CPU build trains in "
            f"float32); set {key}=false"
        )


def check_values(cfg: TrainConfig) -> None:
    """The checks of a normalised config's values alone, no file, device or process looked at:
    `erniekit plan` describes runs on other machines with data it does not read."""
    _check_finite(cfg)
    _check_ranges(cfg)
    _check_degrees(cfg)


def _check_degrees(cfg: TrainConfig) -> None:
    for key in (
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_degree",
        "sharding_parallel_degree",
        "nproc_per_node",
        "nnodes",
    ):
        _require(getattr(cfg, key) >= 1, key, getattr(cfg, key), ">= 1")
    _require(
        cfg.data_parallel_degree >= 1 or cfg.data_parallel_degree == -1,
        "data_parallel_degree",
        cfg.data_parallel_degree,
        ">= 1, or -1 for what the other degrees leave",
    )


def _check_parallel(cfg: TrainConfig) -> None:
    """Degrees against the process count (before any process starts); the model-size checks run
    once the model config is known (erniekit.distributed.collective.layout.check_model_fits)."""
    _check_degrees(cfg)
    if cfg.nnodes > 1 and not cfg.master:
        raise ConfigError(f"nnodes={cfg.nnodes} needs master=HOST:PORT (the first machine's rendezvous address)")
    from erniekit.distributed.collective.layout import layout_from_config

    _require(cfg.max_restart >= 0, "max_restart", cfg.max_restart, ">= 0")
    _require(
        0 < cfg.restart_rendezvous_s <= MAX_TIMEOUT_S,
        "restart_rendezvous_s",
        cfg.restart_rendezvous_s,
        f"in (0, {MAX_TIMEOUT_S:g}] seconds",
    )
    if cfg.pipeline_stage_layers:
        n = len(cfg.pipeline_stage_layers)
        if n != cfg.pipeline_parallel_degree:
            raise ConfigError(
                f"pipeline_stage_layers={cfg.pipeline_stage_layers} lists {n} stages but "
                f"pipeline_parallel_degree={cfg.pipeline_parallel_degree}; give one layer count per stage"
            )
        if min(cfg.pipeline_stage_layers) < 1:
            raise ConfigError(f"pipeline_stage_layers={cfg.pipeline_stage_layers}: every stage needs >= 1 layer")
    if cfg.distributed_mode == "ps":
        _check_ps(cfg)
        return
    lay = layout_from_config(cfg.parallelism)
    why = _parallel_refusal(cfg, lay, cuda=lay.world > 1 and _has_cuda())
    if why:
        raise ConfigError(why)


def layout_refusal(cfg: TrainConfig, lay, cuda: bool) -> str | None:
    """Why `erniekit train` refuses this config's stage and options on the collective layout `lay`
    (a one-line error naming the keys and the fix; None: it runs them) where Paddle has (cuda) or
    lacks CUDA: the checks train runs, which `erniekit plan` and `parallel: auto` leave layouts out by."""
    return (
        _parallel_refusal(cfg, lay, cuda)
        or _online_distill_layout_refusal(cfg, lay)
        or (_distill_layout_refusal(cfg, lay.describe()) if cfg.stage == "Distill" and _splits_model(lay) else None)
        or _credibility_layout_refusal(cfg, lay.world)
    )


def _splits_model(lay) -> bool:
    """Several processes that do not each hold the whole model (tensor/expert/pipeline, sharding)."""
    return lay.world > 1 and not lay.data_only


def _parallel_refusal(cfg: TrainConfig, lay, cuda: bool) -> str | None:
    """What the collective runtime does not run in this version, for this stage on layout `lay`."""
    why = _picture_layout_refusal(cfg, lay) if stage_supports(cfg).images else None
    if why:
        return why
    if lay.world > 1 and lay.sharding_stage == 3 and not cuda:
        return (
            "sharding=stage3 needs reduce-scatter, which Paddle's CPU build does not have "
            "(Unimplemented cpu kernel for CReduceScatterOp); use sharding=stage1 on CPU"
        )
    if lay.tp > 1 and cfg.fine_tuning == "LoRA" and not cuda:
        return (
            f"fine_tuning=LoRA with tensor_parallel_degree={lay.tp}: the adapters' tensor-parallel backward needs "
            "reduce-scatter, which Paddle's CPU build does not have (Unimplemented cpu kernel for CReduceScatterOp); "
            "on CPU train LoRA with data parallelism (tensor_parallel_degree=1)"
        )
    if lay.tp > 1 and cfg.elastic_sandwich:
        return (
            f"elastic_sandwich with tensor_parallel_degree={lay.tp}: the sub-models' soft-label cross entropy over "
            "vocab-split logits is not in Paddle's auto-parallel rules (it stopped at the first step); use data or "
            "expert parallelism, or elastic_sandwich=false"
        )
    return _pipeline_layout_refusal(cfg, lay) if lay.pp > 1 else None


def _picture_layout_refusal(cfg: TrainConfig, lay) -> str | None:
    """What a picture stage (VL-SFT) does not run on layout `lay`: data, tensor and expert
    parallelism and sharding stage1/2 do (tests/e2e/test_vl_sft.py, against one process)."""
    if lay.pp > 1:
        return (
            f"stage {cfg.stage} does not run with pipeline parallelism in this version ({lay.describe()} asked): "
            "the pipeline schedule runs the decoder layers from token ids, with no step for the vision encoder "
            "and its features; set pipeline_parallel_degree=1 (data, tensor and expert parallelism run)"
        )
    if lay.world > 1 and lay.sharding_stage == 3:
        return (
            f"sharding=stage3: stage {cfg.stage} runs with sharding=stage1 or stage2 in this version "
            "(parameters split over the sharding ranks are not tested with the vision model); use stage1"
        )
    if _splits_model(lay) and float((cfg.model_overrides or {}).get("moe_capacity_factor") or 0) > 0:
        return (
            f"model_overrides.moe_capacity_factor: stage {cfg.stage} on {lay.describe()} has no capacity limit "
            "in this version (one process and plain data parallelism apply it); set it to 0"
        )
    return None


def _check_init_layers(cfg: TrainConfig) -> None:
    """init_layers_from / init_layer_map (erniekit/models/layer_init.py): a checkpoint directory, and
    a map with a valid layer of it for each layer of the model (shapes are checked when copying)."""
    src = cfg.init_layers_from
    if src is None:
        if cfg.init_layer_map is not None:
            raise ConfigError(
                "init_layer_map applies with init_layers_from; set init_layers_from or init_layer_map=null"
            )
        return
    if not os.path.isfile(os.path.join(src, "config.json")):
        made_by = _config_writing(src)
        how = f"run `erniekit train {made_by}` first (it writes it there)" if made_by else "train it first"
        raise ConfigError(
            f"init_layers_from: {src} is not a checkpoint directory with a config.json (relative paths start at "
            f"{os.getcwd()}); {how}, or point init_layers_from at a checkpoint in Hugging Face layout"
        )
    if cfg.init_layer_map is not None:
        _check_layer_indices("init_layer_map", cfg.init_layer_map, src)


def _check_layer_indices(key: str, layer_map: list, checkpoint: str, whose: str = "") -> None:
    """Every entry of `layer_map` (config key `key`) is a layer index of `checkpoint`'s config.json."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        n = json.load(f).get("num_hidden_layers")
    bad = [i for i in layer_map if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < (n or 0)]
    if bad:
        raise ConfigError(
            f"{key}={layer_map}: {bad[0]!r} is not a layer of {whose}{checkpoint} (it has {n}); "
            f"give indices in [0, {n})"
        )


def _changed(cfg: TrainConfig, keys) -> list[str]:
    """The keys among `keys` the config sets to other than their defaults."""
    return [k for k in keys if getattr(cfg, k) != default(k)]


def _refuse_other_stages_keys(cfg: TrainConfig, keys, applies_to: str, hint: str = "") -> None:
    """A stage's own setting given to a stage that reads none of it changes nothing: refused, as
    the LoRA keys are without LoRA, so a run does not silently differ from what was asked."""
    changed = _changed(cfg, keys)
    if changed:
        raise ConfigError(
            f"{changed[0]}={getattr(cfg, changed[0])!r} applies to {applies_to}, not stage {cfg.stage}{hint}; "
            "set the stage or remove it"
        )


def _check_stage_keys(cfg: TrainConfig) -> None:
    """DPO's and RL's settings on stages that do not read them (Distill's: `_check_distill`).
    beta is DPO's temperature and RL's KL coefficient; Distill's on-policy sampling reads
    max_new_tokens, temperature, top_p and stop_token_ids."""
    rl = stage_supports(cfg).rollouts
    if cfg.stage != "pretrain":  # the token store holds pretraining text's ids (erniekit/data/token_store.py)
        _refuse_other_stages_keys(cfg, ["tokenized_path"], "stage pretrain")
    if cfg.stage != "DPO":
        _refuse_other_stages_keys(cfg, [k for k in SECTION_KEYS["dpo"] if k != "beta" or not rl], "stage DPO")
    if not rl:
        sampling = ("max_new_tokens", "temperature", "top_p", "stop_token_ids") if cfg.stage == "Distill" else ()
        _refuse_other_stages_keys(
            cfg,
            [k for k in SECTION_KEYS["rl"] if k not in sampling],
            f"the RL stages ({_stages_that('rollouts', ' and ')})",
        )
    elif cfg.stage == "GRPO":  # the built-in RL stages' own keys (a registered RL stage may read any)
        _refuse_other_stages_keys(cfg, ("gamma", "lam", "vf_coef", "cliprange_value"), "stage PPO")
    elif cfg.stage == "PPO":
        _refuse_other_stages_keys(cfg, ("scale_rewards", "filter_zero_std_groups"), "stage GRPO")


def _check_distill(cfg: TrainConfig) -> None:
    """stage: Distill (erniekit/train/stages/distill.py): its teacher and options; the tokenizer and
    vocabulary match is checked once both are loaded."""
    if cfg.stage != "Distill":
        online = " (online_distill_students take the online_distill_* keys)" if cfg.online_distill_students else ""
        _refuse_other_stages_keys(cfg, SECTION_KEYS["distill"], "stage Distill", online)
        return
    _require(0 <= cfg.distill_beta <= 1, "distill_beta", cfg.distill_beta, "in [0, 1] (0: forward KL, 1: reverse KL)")
    _require(cfg.distill_temperature > 0, "distill_temperature", cfg.distill_temperature, "> 0")
    _require(0 <= cfg.distill_alpha <= 1, "distill_alpha", cfg.distill_alpha, "in [0, 1] (1: distillation only)")
    _require(0 <= cfg.on_policy_ratio <= 1, "on_policy_ratio", cfg.on_policy_ratio, "in [0, 1]")
    _require(cfg.teacher_topk >= 1, "teacher_topk", cfg.teacher_topk, ">= 1")
    if cfg.on_policy_ratio > 0:
        _require(cfg.max_new_tokens >= 1, "max_new_tokens", cfg.max_new_tokens, ">= 1")
        _require(
            cfg.max_new_tokens < cfg.max_seq_len,
            "max_new_tokens",
            cfg.max_new_tokens,
            f"< max_seq_len ({cfg.max_seq_len}), leaving room for the prompt",
        )
        _require(cfg.temperature > 0, "temperature", cfg.temperature, "> 0 (the student samples its replies)")
        _require(0 < cfg.top_p <= 1, "top_p", cfg.top_p, "in (0, 1]")
    teacher = cfg.teacher_name_or_path
    if not teacher:
        raise ConfigError(
            "stage Distill needs teacher_name_or_path: a trained checkpoint directory sharing the student's tokenizer"
        )
    _check_hidden_distill(cfg)
    _check_distill_layout(cfg)
    if not os.path.isdir(teacher):
        made_by = _config_writing(teacher)
        how = f"run `erniekit train {made_by}` first (it writes the teacher there)" if made_by else "train it first"
        raise ConfigError(
            f"teacher_name_or_path: {teacher} does not exist (relative paths start at {os.getcwd()}); {how}, "
            "or point teacher_name_or_path at a checkpoint directory"
        )
    if not os.path.isfile(os.path.join(teacher, "config.json")):
        raise ConfigError(
            f"teacher_name_or_path: {teacher} has no config.json; give a full checkpoint in Hugging Face layout "
            "(merge a LoRA adapter first: erniekit export)"
        )
    _refuse_adapter("teacher_name_or_path", teacher)


def _check_hidden_distill(cfg: TrainConfig) -> None:
    """distill_hidden_weight / distill_hidden_layer_map (erniekit/train/hidden_distill.py): the loss
    reads the teacher's layer outputs, so the teacher must run in the process (no top-k cache); the
    map's length is checked against the student once it is built."""
    _require(cfg.distill_hidden_weight >= 0, "distill_hidden_weight", cfg.distill_hidden_weight, ">= 0 (0: off)")
    if cfg.distill_hidden_weight == 0:
        if cfg.distill_hidden_layer_map is not None:
            raise ConfigError(
                "distill_hidden_layer_map applies with distill_hidden_weight > 0; set a weight or "
                "distill_hidden_layer_map=null"
            )
        return
    if cfg.teacher_topk_cache:
        raise ConfigError(
            f"distill_hidden_weight={cfg.distill_hidden_weight}: the hidden-state loss reads the teacher's layer "
            "outputs, which its top-k cache does not hold (it runs in one process or plain data parallelism, with "
            "the teacher in memory); set teacher_topk_cache=null or distill_hidden_weight=0"
        )
    layer_map = cfg.distill_hidden_layer_map
    if layer_map is not None and not layer_map:
        raise ConfigError(
            "distill_hidden_layer_map=[] gives no teacher layer; give one per student layer, or null for the default"
        )
    teacher = cfg.teacher_name_or_path
    if layer_map is not None and os.path.isfile(os.path.join(teacher, "config.json")):  # a missing one: next
        _check_layer_indices("distill_hidden_layer_map", layer_map, teacher, "the teacher ")


def _check_distill_layout(cfg: TrainConfig) -> None:
    """Layouts that split the student (tensor / expert / pipeline parallelism, sharding, parameter
    servers) keep no teacher in memory: the loss reads its top-k cache, and on-policy steps (the
    teacher scores the student's own samples) run in one process or plain data parallelism only."""
    from erniekit.distributed.collective.layout import layout_from_config

    if cfg.distributed_mode == "ps":
        split = "distributed_mode=ps"
    else:
        lay = layout_from_config(cfg.parallelism)
        split = lay.describe() if _splits_model(lay) else None
    why = _distill_layout_refusal(cfg, split) if split else None
    if why:
        raise ConfigError(why)


def _distill_layout_refusal(cfg: TrainConfig, split: str) -> str | None:
    """What stage Distill does not run when the layout `split` splits the student (no teacher in memory)."""
    if cfg.distill_hidden_weight > 0:
        return (
            f"distill_hidden_weight={cfg.distill_hidden_weight}: the hidden-state loss reads the teacher's layer "
            f"outputs in memory, which runs in one process or plain data parallelism, not {split}; set "
            "distill_hidden_weight=0"
        )
    if cfg.on_policy_ratio > 0:
        return (
            f"on_policy_ratio={cfg.on_policy_ratio}: on-policy steps score the student's samples with the teacher in "
            f"memory, which runs in one process or plain data parallelism, not {split}; set on_policy_ratio=0"
        )
    if not cfg.teacher_topk_cache:
        return (
            f"stage Distill with {split} reads the teacher from its top-k cache (no training process keeps it): set "
            "teacher_topk_cache=DIR (rank 0 builds it before the first step; teacher_topk = the vocabulary size "
            "gives the exact loss)"
        )
    return None


def _config_writing(path: str) -> str | None:
    """The shipped example config whose output_dir is `path` (a missing teacher's hint)."""
    import glob

    import yaml

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    for file in sorted(glob.glob(os.path.join(root, "configs", "**", "*.yaml"), recursive=True)):
        with open(file) as f:
            data = yaml.safe_load(f)
        if isinstance(data, dict) and os.path.normpath(str(data.get("output_dir", ""))) == os.path.normpath(path):
            return os.path.relpath(file, os.getcwd()) if file.startswith(os.getcwd()) else file
    return None


def _check_ps(cfg: TrainConfig) -> None:
    """What the parameter-server mode (erniekit/train/runners/ps.py) runs in this version."""
    from erniekit.distributed.collective.layout import world_size

    world = world_size(cfg.parallelism)
    _require(cfg.ps_servers >= 1, "ps_servers", cfg.ps_servers, ">= 1")
    _require(0 < cfg.ps_topk_ratio <= 1, "ps_topk_ratio", cfg.ps_topk_ratio, "in (0, 1]")
    _require(cfg.ps_k_steps >= 1, "ps_k_steps", cfg.ps_k_steps, ">= 1")
    if cfg.ps_sync_mode == "async" and cfg.save_steps > 0 and cfg.save_steps % cfg.ps_k_steps:
        raise ConfigError(
            f"ps_sync_mode=async saves at block-averaging steps: save_steps={cfg.save_steps} must be a "
            f"multiple of ps_k_steps={cfg.ps_k_steps}"
        )
    if world <= cfg.ps_servers and cfg.ps_placement != "auto":  # auto: the placement sets the count
        raise ConfigError(
            f"distributed_mode=ps with ps_servers={cfg.ps_servers} needs at least one worker too, but the "
            f"job has {world} processes (nproc_per_node {cfg.nproc_per_node} x nnodes {cfg.nnodes}); "
            f"set nproc_per_node to ps_servers + the workers"
        )
    degrees = {
        k: getattr(cfg, k) for k in ("tensor_parallel_degree", "expert_parallel_degree", "sharding_parallel_degree")
    }
    set_ = [f"{k}={v}" for k, v in degrees.items() if v != 1] + ([f"sharding={cfg.sharding}"] if cfg.sharding else [])
    if set_ or cfg.parallel:
        raise ConfigError(
            f"distributed_mode=ps splits the batch over its workers (and pipeline stages) only; drop "
            f"{(set_ or ['parallel=auto'])[0]}"
        )
    _check_ps_pipeline(cfg, world - cfg.ps_servers)
    why = None
    if not stage_supports(cfg).parameter_server:
        why = f"trains the {_stages_that('parameter_server')} stages, not stage={cfg.stage}"
    elif cfg.fine_tuning != "Full":
        why = f"trains full models, not fine_tuning={cfg.fine_tuning}"
    elif cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k:
        why = "does not train elastic sub-models; drop elastic_depth/elastic_experts/elastic_top_k"
    elif cfg.do_eval:
        why = "does not evaluate in this version (the head is split over the servers); set do_eval=false"
    elif cfg.ema_decay > 0:
        why = "does not keep a weight EMA in this version (the tables live on the servers); set ema_decay=0"
    if why:
        raise ConfigError(f"distributed_mode=ps {why}")


def _check_ps_pipeline(cfg: TrainConfig, workers: int) -> None:
    """The workers as a pipeline (docs/ps.md "Heterogeneous pipeline"), by hand or ps_placement: auto."""
    _require(cfg.ps_stage_workers >= 1, "ps_stage_workers", cfg.ps_stage_workers, ">= 1")
    _require(cfg.ps_target >= 0, "ps_target", cfg.ps_target, ">= 0 (0: half the fastest single-type placement)")
    if cfg.ps_placement == "auto":
        if not cfg.cluster:
            raise ConfigError(
                "ps_placement=auto needs cluster=PATH, a file with device_types "
                "(see examples/clusters/hetero-cpu-gpu.yaml)"
            )
        if not os.path.isfile(cfg.cluster):
            raise ConfigError(f"cluster={cfg.cluster}: no such file")
        return  # the stages come from the placement (erniekit/distributed/ps/plan.py: auto_placement)
    pp = cfg.pipeline_parallel_degree
    if pp > 1:
        if workers % pp:
            raise ConfigError(
                f"distributed_mode=ps: pipeline_parallel_degree={pp} does not divide the {workers} "
                f"workers (nproc_per_node {cfg.nproc_per_node} - ps_servers {cfg.ps_servers}); launch "
                f"ps_servers + a multiple of {pp} processes"
            )
        if cfg.ps_sync_mode == "async":
            raise ConfigError(
                "ps_sync_mode=async runs without pipeline stages in this version; set "
                "pipeline_parallel_degree=1 or ps_sync_mode=sync"
            )
    if cfg.ps_stage_devices:
        if len(cfg.ps_stage_devices) != pp:
            raise ConfigError(
                f"ps_stage_devices={cfg.ps_stage_devices} names {len(cfg.ps_stage_devices)} devices for "
                f"pipeline_parallel_degree={pp} stages; give one per stage"
            )
        bad = [d for d in cfg.ps_stage_devices if d not in ("cpu", "gpu")]
        if bad:
            raise ConfigError(f"ps_stage_devices: {bad[0]!r} is not a device; use cpu or gpu")
        if "gpu" in cfg.ps_stage_devices and not _has_cuda():
            raise ConfigError(
                "ps_stage_devices puts a stage on gpu, but this Paddle build has no CUDA; install "
                "paddlepaddle-gpu (README.md, GPU) or use cpu for that stage"
            )


def _pipeline_layout_refusal(cfg: TrainConfig, lay) -> str | None:
    """What the 1F1B pipeline (erniekit/train/pipeline_schedule.py) runs in this version: LM
    stages, full fine-tuning, with data parallelism beside it."""
    why = pipeline_refusal(cfg)
    if lay.tp > 1 or lay.sharding_stage or lay.ep > 1:
        why = (
            "combines with data parallelism only in this version; set tensor_parallel_degree=1, "
            "expert_parallel_degree=1 and no sharding"
        )
    return f"pipeline_parallel_degree={lay.pp} {why}" if why else None


# the stages whose LoRA/DoRA adapters train in a pipeline (docs/lora.md "Pipeline parallelism")
_PIPELINE_LORA_STAGES = ("pretrain", "SFT")


def pipeline_refusal(cfg: TrainConfig) -> str | None:
    """Why this config's stage or options cannot run in a pipeline (None: they can); the planner
    leaves pipeline layouts out of `parallel: auto` for such a config."""
    why = None
    if not stage_supports(cfg).pipeline:
        why = f"runs the {_stages_that('pipeline')} stages, not stage={cfg.stage}; set pipeline_parallel_degree=1"
    elif cfg.fine_tuning != "Full" and cfg.stage not in _PIPELINE_LORA_STAGES:
        why = (
            f"trains fine_tuning={cfg.fine_tuning} in the {' and '.join(_PIPELINE_LORA_STAGES)} stages only, not "
            f"stage={cfg.stage}; set fine_tuning=Full or pipeline_parallel_degree=1"
        )
    elif cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k:
        why = "does not train elastic sub-models; drop elastic_depth/elastic_experts/elastic_top_k"
    elif cfg.do_eval and cfg.eval_generation and cfg.eval_dataset_path:
        why = (
            "evaluates the held-out loss only (generation needs every layer in one process); set eval_generation=false"
        )
    return why


def _has_cuda() -> bool:
    import paddle

    return paddle.device.is_compiled_with_cuda()


def _credibility_layout_refusal(cfg: TrainConfig, world: int) -> str | None:
    """The credibility loss samples replies with the whole model: one process only."""
    if cfg.credibility_loss_weight > 0 and (world > 1 or cfg.distributed_mode != "collective"):
        return (
            "credibility_loss_weight > 0 runs in one process in this version (it samples replies with the whole "
            "model): set nproc_per_node=1, nnodes=1 and distributed_mode=collective, or credibility_loss_weight=0"
        )
    return None


def _check_control(cfg: TrainConfig) -> None:
    """Controllable LM and credibility keys (docs/control.md): SFT only; the credibility loss samples
    replies with the whole model, so it runs in one process."""
    _require(0 <= cfg.control_drop_prob <= 1, "control_drop_prob", cfg.control_drop_prob, "in [0, 1]")
    _require(cfg.credibility_loss_weight >= 0, "credibility_loss_weight", cfg.credibility_loss_weight, ">= 0 (0 = off)")
    for key in ("credibility_every", "credibility_batch_size", "credibility_max_new_tokens"):
        _require(getattr(cfg, key) >= 1, key, getattr(cfg, key), ">= 1")
    _require(cfg.credibility_temperature > 0, "credibility_temperature", cfg.credibility_temperature, "> 0")
    for key in ("control_drop_prob", "credibility_loss_weight"):
        if getattr(cfg, key) > 0 and cfg.stage != "SFT":
            raise ConfigError(f"{key}={getattr(cfg, key)} applies to stage SFT, not {cfg.stage}; set {key}=0")
    why = _credibility_layout_refusal(cfg, cfg.nproc_per_node * cfg.nnodes)
    if why:
        raise ConfigError(why)
    if cfg.credibility_loss_weight > 0 and (cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_top_k):
        raise ConfigError(
            "credibility_loss_weight > 0 trains the full model's head: clear elastic_depth, elastic_experts and "
            "elastic_top_k, or set credibility_loss_weight=0"
        )
