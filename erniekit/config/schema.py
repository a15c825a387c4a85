"""The training config: one flat dataclass whose keys follow ERNIEKit/PaddleFormers names.

Kept free of yaml and paddle imports so `erniekit help train` can list keys on any install.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from erniekit.data.formats import DATASET_TYPE_SPELLINGS
from erniekit.train.stages import STAGE_SPELLINGS


def _spellings(*names: str, **aliases: str) -> dict[str, str]:
    """Map each accepted lower-case spelling to its canonical name."""
    table = {name.lower(): name for name in names}
    table.update({alias.lower(): table[target.lower()] for alias, target in aliases.items()})
    return table


# Allowed values, the single place to extend when a method lands (stages: their registry).
# Keys are lower-case spellings the user may write; values are the canonical names.
STAGES = STAGE_SPELLINGS  # the stage registry's names (erniekit/train/stages), live: a registered stage counts
LOSS_AGGREGATIONS = _spellings("token", "sequence")
DPO_LOSS_TYPES = _spellings("sigmoid", "hinge", "ipo", "simpo", "orpo", "kto_pair", "sppo_hard", "nca_pair", "dpop")
FINE_TUNING = _spellings("Full", "LoRA")
DATASET_TYPES = DATASET_TYPE_SPELLINGS  # auto, text, prompt and the SFT format registry (erniekit/data/formats.py)
TRUNCATION = _spellings("error", "truncate")
CHAT_TEMPLATES = _spellings("ernie", "ernie_thinking")
LR_SCHEDULERS = _spellings("cosine", "constant", "linear", "wsd")
COMPUTE_TYPES = _spellings("fp32", "bf16", "fp16", "fp8")
FP8_GRAD_FORMATS = _spellings("e4m3", "e5m2")
RECOMPUTE_GRANULARITIES = _spellings("full", "full_attn", "core_attn", "mlp")
SHARDING = {"": "", "none": "", "stage1": "stage1", "stage2": "stage2", "stage3": "stage3"}
PARALLEL = {"": "", "none": "", "manual": "", "auto": "auto"}
DISTRIBUTED_MODES = _spellings("collective", "ps")
PS_SYNC_MODES = _spellings("sync", "async")
PS_COMPRESSION = _spellings("none", "int8", "topk")
PS_PLACEMENTS = _spellings("manual", "auto")
DISTILL_LOSSES = _spellings("forward_kl", "reverse_kl", "jsd")
CROSS_CLUSTER_SYNCS = _spellings("local", "gradients")
CROSS_CLUSTER_OUTERS = _spellings("average", "nesterov")
CROSS_CLUSTER_COMPRESSION = _spellings("none", "int8", "topk", "adaptive")


def _opt(default: Any, help: str, choices: dict[str, str] | None = None) -> Any:
    """A dataclass field carrying its help line (and allowed values) in metadata."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything one `erniekit train` run needs; the resolved copy is saved in output_dir."""

    # ### stage
    stage: str = _opt("SFT", "training stage: pretrain (alias PT), SFT, DPO, GRPO, PPO, VL-SFT or Distill", STAGES)
    fine_tuning: str = _opt("Full", "which weights train: Full or LoRA (adapters only, base frozen)", FINE_TUNING)

    # ### model
    model_name_or_path: str = _opt("tiny-moe", "checkpoint directory in Hugging Face layout, or a built-in preset name")
    tokenizer_name_or_path: str | None = _opt(None, "tokenizer directory; null uses the one next to the model")
    model_overrides: dict = _opt({}, "model config fields to override, e.g. model_overrides.num_hidden_layers=2")
    init_layers_from: str | None = _opt(
        None,
        "a checkpoint whose weights start the model, layer i from its layer init_layer_map[i] (a DistilBERT-style "
        "student from its teacher; embeddings, final norm and head as they are)",
    )
    init_layer_map: list[int] | None = _opt(
        None, "init_layers_from: its layer for each of the model's layers (null: evenly spaced, first and last kept)"
    )

    # ### data
    train_dataset_path: str = _opt("examples/data/arithmetic/train.jsonl", "training data file(s), comma-separated")
    train_dataset_type: str = _opt(
        "auto", "format of train data: auto, erniekit, alpaca, messages, sharegpt, erniekit_vl, text", DATASET_TYPES
    )
    eval_dataset_path: str | None = _opt(None, "held-out data file(s), comma-separated")
    dataset_dir: str | None = _opt(
        None,
        "LLaMA-Factory data: a directory with dataset_info.json; train_dataset_path / eval_dataset_path then "
        "name its datasets (comma-separated), as LLaMA-Factory's dataset + dataset_dir. Without it, a path "
        "entry DIR/dataset_info.json:NAME names one",
    )
    eval_dataset_type: str = _opt("auto", "format of eval data (as train_dataset_type)", DATASET_TYPES)
    tokenized_path: str | None = _opt(
        None,
        "pretraining: a directory where the train / eval corpus is tokenized once (int32 ids + document "
        "offsets) and memory-mapped by later runs, resumes and every process; rebuilt when the data files "
        "or the tokenizer change. null: tokenize into memory at every start (docs/training.md)",
    )
    max_seq_len: int = _opt(512, "longest token sequence fed to the model")
    packing: bool = _opt(False, "pack several short examples into one max_seq_len row")
    truncation: str = _opt("error", "what to do with examples over max_seq_len: error or truncate", TRUNCATION)
    chat_template: str | None = _opt(
        None,
        "null: the tokenizer's own template; ernie: the ERNIE-4.5 chat template; ernie_thinking: the ERNIE-4.5 "
        "Thinking format with reasoning and tool calls (docs/tools.md), its tags added as tokens where missing",
        CHAT_TEMPLATES,
    )
    train_on_reasoning: bool = _opt(True, "thinking format: also train on the reasoning before </think>")

    # ### batch and length
    per_device_train_batch_size: int = _opt(8, "examples per micro-batch on each device")
    per_device_eval_batch_size: int = _opt(32, "examples per eval batch on each device")
    gradient_accumulation_steps: int = _opt(1, "micro-batches summed per optimizer step")
    max_steps: int = _opt(-1, "optimizer steps to run (>= 1), or -1 to train for num_train_epochs")
    num_train_epochs: float = _opt(1.0, "passes over the training data when max_steps is -1")

    # ### optimizer (AdamW)
    learning_rate: float = _opt(3e-4, "peak learning rate, in (0, 1]; above 1e-2 is warned about")
    min_lr: float = _opt(0.0, "learning rate at the end of the decay")
    weight_decay: float = _opt(0.01, "AdamW decoupled weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.95, "AdamW beta2")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = _opt(1.0, "clip the global gradient norm to this; 0 disables clipping")

    # ### schedule
    lr_scheduler_type: str = _opt("cosine", "learning-rate schedule: cosine, constant, linear, wsd", LR_SCHEDULERS)
    warmup_steps: int = _opt(0, "linear warmup steps; > 0 overrides warmup_ratio (more than max_steps is warned about)")
    warmup_ratio: float = _opt(0.0, "fraction of total steps used for warmup")
    decay_ratio: float = _opt(0.1, "fraction of total steps used for the final decay (wsd)")

    # ### run, logging, checkpoints
    seed: int = _opt(42, "random seed for weights init, data order and sampling")
    output_dir: str = _opt("output", "where checkpoints, logs and the resolved config go")
    logging_dir: str | None = _opt(None, "VisualDL log directory; null means output_dir/vdl_log")
    logging_steps: int = _opt(10, "log metrics every N optimizer steps")
    save_steps: int = _opt(500, "save a checkpoint every N optimizer steps")
    routing_plot_steps: int = _opt(
        500,
        "MoE models: write routing heatmaps (output_dir/routing/*.png, VisualDL) every N steps; 0 = at the end only",
    )
    eval_steps: int = _opt(500, "evaluate every N optimizer steps")
    save_total_limit: int = _opt(2, "checkpoints kept in output_dir (oldest deleted first); 0 keeps all")
    resume_from_checkpoint: str | None = _opt(
        None, "checkpoint directory to resume from, or auto for the latest in output_dir"
    )

    # ### evaluation
    do_train: bool = _opt(True, "run training")
    do_eval: bool = _opt(True, "run evaluation")
    eval_generation: bool = _opt(True, "also score exact match of greedy generations")
    eval_max_new_tokens: int = _opt(16, "tokens generated per example in generation eval")
    eval_max_samples: int = _opt(500, "examples scored in generation eval")

    # ### LoRA (fine_tuning: LoRA)
    lora_rank: int = _opt(8, "LoRA rank r")
    lora_alpha: float = _opt(16.0, "LoRA alpha: the update is scaled by alpha / r (alpha / sqrt(r) with rslora)")
    lora_dropout: float = _opt(0.0, "dropout on the adapter input")
    lora_target_modules: str | None = _opt(
        None, "regex (re.fullmatch) of module names to adapt; null = attention, MLP and expert projections"
    )
    rslora: bool = _opt(False, "rank-stabilised scaling alpha / sqrt(r)")
    use_dora: bool = _opt(False, "weight-decomposed LoRA (DoRA)")
    lora_plus_scale: float = _opt(1.0, "LoRA+: learning-rate multiplier of the B matrices")
    lora_base_dtype: str | None = _opt(None, "hold the frozen base in this dtype (bfloat16) to save memory")
    lora_peft_layout: str = _opt(
        "auto",
        "how saved MoE adapters name routed experts for PEFT: fused (transformers >= 5), per_expert (older), "
        "auto = by the installed transformers",
    )

    # ### DPO (stage: DPO); names as PaddleFormers' DPO arguments
    beta: float = _opt(0.1, "DPO temperature; GRPO/PPO: KL coefficient to the reference (0 drops the reference model)")
    loss_type: str = _opt(
        "sigmoid",
        "preference loss: sigmoid, hinge, ipo, simpo, orpo, kto_pair, sppo_hard, nca_pair, dpop",
        DPO_LOSS_TYPES,
    )
    label_smoothing: float = _opt(0.0, "conservative DPO: assumed fraction of flipped preference labels")
    reference_free: bool = _opt(False, "drop the reference model (its log-probs count as 0)")
    sft_loss_ratio: float = _opt(0.0, "weight of the chosen reply's NLL added to the preference loss")
    simpo_gamma: float = _opt(0.5, "SimPO target reward margin")
    dpop_lambda: float = _opt(50.0, "DPO-Positive penalty weight")

    # ### RL (stage: GRPO or PPO; docs/rl.md); names as TRL's GRPO/PPO arguments
    num_generations: int = _opt(
        8,
        "completions sampled per prompt (GRPO group size, >= 2); prompts per micro-batch = per_device_train_batch_size",
    )
    max_new_tokens: int = _opt(128, "longest completion sampled in a rollout")
    temperature: float = _opt(1.0, "rollout sampling temperature (> 0); log-probs are taken at the same temperature")
    top_p: float = _opt(1.0, "rollout nucleus sampling: keep the smallest token set with this much probability")
    stop_token_ids: list[int] = _opt([], "extra token ids that end a completion, besides the tokenizer's sep and eos")
    reward_funcs: list[str] = _opt(
        ["accuracy"],
        "rewards: built-in accuracy (exact answer), format (one integer), or module.path:function / file.py:function",
    )
    reward_weights: list[float] = _opt([], "weight of each reward function in the total reward; [] = all 1")
    num_iterations: int = _opt(
        1, "optimizer steps per rollout batch (GRPO's mu); > 1 reuses rollouts with importance ratios"
    )
    epsilon: float = _opt(0.2, "lower clip bound of the importance ratio: 1 - epsilon")
    epsilon_high: float | None = _opt(None, "upper clip bound 1 + epsilon_high (DAPO clip-higher); null = epsilon")
    scale_rewards: bool = _opt(True, "GRPO: divide group-centred rewards by the group std (false: Dr. GRPO)")
    loss_aggregation: str = _opt(
        "token",
        "token: average over all completion tokens of the step; sequence: per-sequence mean, then over sequences",
        LOSS_AGGREGATIONS,
    )
    filter_zero_std_groups: bool = _opt(False, "GRPO: drop groups whose samples all got the same reward from the loss")
    routing_replay: bool = _opt(False, "MoE: train on the experts chosen during the rollout (routing replay)")
    gamma: float = _opt(1.0, "PPO: discount factor")
    lam: float = _opt(0.95, "PPO: GAE lambda")
    vf_coef: float = _opt(0.1, "PPO: weight of the value loss")
    cliprange_value: float = _opt(0.2, "PPO: clip range of the value update")

    # ### distillation (stage: Distill; docs/distillation.md); names as TRL's GKD / ERNIEKit's
    teacher_name_or_path: str | None = _opt(
        None, "Distill: the teacher checkpoint (HF layout, the student's tokenizer and vocabulary)"
    )
    distill_loss: str = _opt(
        "forward_kl",
        "Distill: divergence to the teacher: forward_kl (KL(teacher || student)), reverse_kl or jsd (GKD's, with "
        "distill_beta)",
        DISTILL_LOSSES,
    )
    distill_beta: float = _opt(
        0.5, "Distill: jsd's beta in [0, 1] (GKD / TRL: 0 = forward KL, 1 = reverse KL; the mixture's teacher weight)"
    )
    distill_temperature: float = _opt(
        1.0, "Distill: both distributions softened by this (> 0); the divergence is scaled by its square"
    )
    distill_alpha: float = _opt(
        1.0, "Distill: weight of the distillation loss in [0, 1]; 1 - distill_alpha on the hard-label cross-entropy"
    )
    on_policy_ratio: float = _opt(
        0.0,
        "Distill: fraction of steps (GKD's lambda) trained on replies the student samples to the data's prompts "
        "(max_new_tokens, temperature, top_p), scored by the teacher; drawn per step from the seed",
    )
    teacher_topk_cache: str | None = _opt(
        None,
        "Distill: a directory holding the teacher's top-k log-probs on the training data, computed once and "
        "read back (big teachers); null = teacher logits computed on the fly",
    )
    teacher_topk: int = _opt(64, "Distill: k of teacher_topk_cache (tokens kept per position; the rest is one bucket)")
    distill_hidden_weight: float = _opt(
        0.0,
        "Distill: weight of the hidden-state loss per real token (TinyBERT's, scale-free: the squared error of "
        "RMS-normalised layer outputs, student layer i against teacher layer distill_hidden_layer_map[i]); 0 = off. "
        "Needs the teacher in memory (no teacher_topk_cache)",
    )
    distill_hidden_layer_map: list[int] | None = _opt(
        None,
        "Distill: the teacher layer each student layer's output learns; null = (i + 1) * N / M - 1, equal fractions "
        "of depth ([1, 3] for 2 layers of 4)",
    )

    # ### weight EMA (ERNIE 4.5: a constant LR plus an EMA of the weights instead of LR decay)
    ema_decay: float = _opt(0.0, "keep an EMA of the trainable weights with this decay (0 = off), e.g. 0.999")
    save_ema: bool = _opt(True, "with ema_decay > 0: the final model saved in output_dir is the EMA")

    # ### MoE (model-side keys: model_overrides.router_*_coef, moe_capacity_factor, ... docs/moe.md)
    loss_token_balance: bool = _opt(
        False, "ERNIE 4.5 token-balanced loss: average each example's loss over its own tokens, then over examples"
    )

    # ### controllable LM and credibility (ERNIE 3.0 Titan; stage SFT; docs/control.md)
    control_drop_prob: float = _opt(
        0.0,
        "SFT: probability that each control attribute of a training record is left out of its prefix (fixed per "
        "seed, example and attribute), so the model also answers without it",
    )
    credibility_loss_weight: float = _opt(
        0.0,
        "SFT: weight of the credibility loss, a binary loss of a scoring head telling real replies from replies "
        "the model samples itself (0 = off); the head is saved as credibility_head.safetensors",
    )
    credibility_every: int = _opt(
        1, "SFT with credibility: sample fresh replies and take the credibility loss every N steps"
    )
    credibility_batch_size: int = _opt(16, "SFT with credibility: prompts whose real and sampled replies a step scores")
    credibility_max_new_tokens: int = _opt(16, "SFT with credibility: longest sampled reply")
    credibility_temperature: float = _opt(1.0, "SFT with credibility: sampling temperature of the replies (> 0)")

    # ### vision-language (stage VL-SFT, ERNIE-4.5-VL models; docs/multimodal.md)
    image_min_pixels: int = _opt(
        56 * 56, "VL: smallest resized image area (pixels); images are resized to 28-pixel multiples"
    )
    image_max_pixels: int = _opt(
        28 * 28 * 1280, "VL: largest resized image area (pixels): each 28x28 block is one token in the text"
    )
    freeze_vision_encoder: bool = _opt(False, "VL: keep the vision transformer's weights fixed")
    freeze_resampler: bool = _opt(False, "VL: keep the resampler (vision -> text projection) fixed")
    vit_lr_ratio: float = _opt(
        1.0, "VL: learning rate of the vision encoder and resampler, as a ratio of learning_rate (ERNIEKit's name)"
    )

    # ### elastic sub-models (ERNIE 5): each step trains a sampled sub-model (docs/elastic.md)
    elastic_depth: list[int] = _opt(
        [], "candidate depths (layers kept: first, last, the rest evenly spread); [] = always full depth"
    )
    elastic_experts: list[int] = _opt(
        [], "candidate routed-expert counts (the first n experts of every MoE layer); [] = all"
    )
    elastic_top_k: list[int] = _opt(
        [], "candidate routing top-k values (each <= min(elastic_experts)); [] = the model's moe_k"
    )
    elastic_full_prob: float = _opt(
        0.25, "with elastic_* set: probability that a step trains the full model (elastic_sandwich: unused)"
    )
    elastic_sandwich: bool = _opt(
        False, "pretrain/SFT: every step trains the full model and one sampled smaller sub-model on the same batch"
    )
    elastic_distill_weight: float = _opt(
        0.0, "with elastic_sandwich: the sub-model's loss is (1-w) * CE + w * KL(full model || sub-model)"
    )

    # ### online distillation (ERNIE 3.0 Titan): students learn beside the model (docs/online_distillation.md)
    online_distill_students: list = _opt(
        [],
        "pretrain/SFT: students trained in the same run from the model's current soft labels; each a preset, a "
        "checkpoint directory or {name, teacher (the main model or a student: teacher assistant), model, "
        "auxiliary_layer, auxiliary_weight, lr_ratio (its learning rate over the run's), model config fields such "
        "as num_hidden_layers}; saved in "
        "output_dir/students/<name>",
    )
    online_distill_every: int = _opt(1, "with online_distill_students: the students learn every N optimizer steps")
    online_distill_loss: str = _opt(
        "forward_kl",
        "with online_distill_students: divergence to each student's teacher: forward_kl, reverse_kl or jsd",
        _spellings("forward_kl", "reverse_kl", "jsd"),
    )
    online_distill_beta: float = _opt(0.5, "with online_distill_students: jsd's beta in [0, 1] (GKD's)")
    online_distill_temperature: float = _opt(
        1.0, "with online_distill_students: softening temperature (> 0); the divergence is scaled by its square"
    )
    online_distill_alpha: float = _opt(
        1.0,
        "with online_distill_students: weight in [0, 1] of each student's divergence; 1 - alpha on its own LM "
        "loss on the data's labels (1: soft labels only)",
    )
    online_distill_start: int = _opt(
        0,
        "with online_distill_students: the optimizer step from which students learn the soft labels; before "
        "it each student learns the data's labels only (a teacher that starts from scratch is no better yet)",
    )

    # ### precision and runtime
    bf16: bool = _opt(False, "train in bfloat16 (needs a GPU)")
    fp16: bool = _opt(False, "train in float16 with loss scaling (needs a GPU)")
    fp8: bool = _opt(False, "run the MoE expert GEMMs (forward and backward) in block-scaled FP8 e4m3")
    fp8_block_size: int = _opt(128, "FP8 scaling tile: activations 1 x N, weights N x N")
    fp8_grad_format: str = _opt(
        "e4m3",
        "FP8 format of the gradient tiles in the backward GEMMs: e4m3 (DeepSeek-V3) or e5m2 (hybrid)",
        FP8_GRAD_FORMATS,
    )
    compute_type: str = _opt(
        "fp32",
        "ERNIEKit spelling: bf16, fp16 or fp8 turn on that flag; fp32 leaves the flags as set",
        COMPUTE_TYPES,
    )
    recompute: bool = _opt(
        False,
        "recompute activations in the backward instead of keeping them (less memory, "
        "one more forward of the recomputed part)",
    )
    recompute_granularity: str = _opt(
        "full",
        "with recompute: full (whole decoder layer), full_attn (norm + attention), core_attn (softmax(qk)v "
        "only) or mlp (norm + MLP / MoE experts)",
        RECOMPUTE_GRANULARITIES,
    )
    fused_head_loss: bool = _opt(
        True,
        "pretrain / SFT / VL-SFT on the CPU: the LM head and its loss chunk by chunk (training and eval), never the whole batch's logits "
        "(less memory, the same losses; off where logits are needed: elastic_sandwich, online distillation, "
        "token-balanced loss, MTP)",
    )
    disable_tqdm: bool = _opt(False, "hide the terminal progress bar")

    # ### parallelism and launch (docs/distributed.md); the degrees' product = nproc_per_node x nnodes
    data_parallel_degree: int = _opt(-1, "data-parallel replicas; -1 = what the other degrees leave of the processes")
    tensor_parallel_degree: int = _opt(1, "tensor parallel: attention heads, MLP width and vocab split over N ranks")
    expert_parallel_degree: int = _opt(
        1, "MoE experts split over all the data ranks (1, or dp x sharding), tokens moved by all-to-all"
    )
    pipeline_parallel_degree: int = _opt(1, "pipeline stages (groups of layers)")
    pipeline_stage_layers: list[int] = _opt(
        [], "decoder layers of each pipeline stage, e.g. [3, 1]; [] = an even split (set by ps_placement: auto)"
    )
    sharding: str = _opt(
        "",
        "ZeRO sharding of the data ranks: stage1 (optimizer state), stage2 (+ gradients), "
        "stage3 (+ parameters); empty = none",
        SHARDING,
    )
    sharding_parallel_degree: int = _opt(
        1, "data ranks that shard (with sharding set); 1 with data_parallel_degree -1 = all of them"
    )
    parallel: str = _opt(
        "",
        "auto: the planner (erniekit plan) picks degrees, sharding, recompute and micro-batch "
        "for the cluster file; empty = the degrees as set",
        PARALLEL,
    )
    cluster: str | None = _opt(
        None, "cluster description YAML (examples/clusters/) for parallel: auto and erniekit plan"
    )
    nproc_per_node: int = _opt(1, "processes on this machine; > 1 relaunches through paddle.distributed.launch")
    nnodes: int = _opt(1, "machines in the job")
    master: str | None = _opt(None, "host:port of the first machine's rendezvous (nnodes > 1)")
    max_restart: int = _opt(
        0, "times paddle.distributed.launch restarts failed workers (they resume from the latest checkpoint)"
    )
    restart_rendezvous_s: float = _opt(
        300.0,
        "nnodes > 1: seconds a restart waits for the other nodes to join (their ranks started) before the job "
        "ends as failed; the first launch waits without a limit",
    )
    dataloader_num_workers: int = _opt(0, "data loading worker processes; 0 loads in the main process")

    # ### heterogeneous parameter-server mode (docs/ps.md)
    distributed_mode: str = _opt(
        "collective",
        "collective: one mesh over all processes (docs/distributed.md); "
        "ps: parameter servers hold the embedding / LM-head rows, workers the blocks",
        DISTRIBUTED_MODES,
    )
    ps_servers: int = _opt(1, "with distributed_mode ps: processes that are parameter servers (the rest are workers)")
    ps_sync_mode: str = _opt(
        "sync",
        "with distributed_mode ps: sync (every step waits for all workers; equals a "
        "single-process step) or async (servers apply each worker's gradients as they come; "
        "workers average their blocks every ps_k_steps)",
        PS_SYNC_MODES,
    )
    ps_k_steps: int = _opt(
        4, "with ps_sync_mode async: steps between the workers' block averaging (how far they may drift)"
    )
    ps_compress: str = _opt(
        "none",
        "with distributed_mode ps: compress the pushed row gradients (int8: per-row "
        "scale; topk: the ps_topk_ratio largest entries per row), with error feedback",
        PS_COMPRESSION,
    )
    ps_topk_ratio: float = _opt(0.1, "with ps_compress topk: fraction of each row's entries sent")
    ps_stage_devices: list[str] = _opt(
        [],
        "with distributed_mode ps and pipeline stages: the device of each stage's "
        "workers (cpu or gpu); [] = this machine's default",
    )
    ps_placement: str = _opt(
        "manual",
        "with distributed_mode ps: auto = the cost model and RL scheduler (erniekit "
        "plan --mode ps) choose the workers' pipeline stages, their layers and devices "
        "on the `cluster` file, and the process count follows",
        PS_PLACEMENTS,
    )
    ps_target: float = _opt(
        0.0,
        "with ps_placement auto: throughput target in tokens/s; 0 = half of the fastest single-device-type placement",
    )
    ps_stage_workers: int = _opt(
        1, "with ps_placement auto: workers per pipeline stage (data-parallel copies of the pipeline)"
    )

    # ### training across clusters over a slow link (docs/cross_cluster.md)
    cross_cluster_sizes: list[int] = _opt(
        [],
        "processes of each cluster, all on this machine (e.g. [2, 2]: two clusters of 2 over an emulated "
        "link); [] = one cluster, or clusters on other machines (cross_cluster_peers)",
    )
    cross_cluster_id: int = _opt(-1, "this site's cluster index in cross_cluster_peers (clusters on separate machines)")
    cross_cluster_peers: list[str] = _opt(
        [], "host:port of every cluster's link in cluster order (rank r of a cluster listens on port + r)"
    )
    cross_cluster_sync: str = _opt(
        "local",
        "local: each cluster trains alone and the clusters sync parameters every cross_cluster_sync_every "
        "steps (outer optimizer); gradients: plain data parallelism across clusters (every step)",
        CROSS_CLUSTER_SYNCS,
    )
    cross_cluster_sync_every: int = _opt(16, "with cross_cluster_sync local: optimizer steps between syncs")
    cross_cluster_outer: str = _opt(
        "average",
        "outer optimizer on the averaged change since the last sync: average (parameter averaging) or "
        "nesterov (DiLoCo's outer Nesterov SGD)",
        CROSS_CLUSTER_OUTERS,
    )
    cross_cluster_outer_lr: float = _opt(0.7, "with cross_cluster_outer nesterov: outer learning rate")
    cross_cluster_outer_momentum: float = _opt(0.9, "with cross_cluster_outer nesterov: outer momentum")
    cross_cluster_compress: str = _opt(
        "int8",
        "what a sync sends: none (float32), int8 (per-row scale), topk (cross_cluster_topk_ratio of each "
        "row), all with error feedback; adaptive: interval and compression chosen from the measured link",
        CROSS_CLUSTER_COMPRESSION,
    )
    cross_cluster_topk_ratio: float = _opt(0.1, "with cross_cluster_compress topk: fraction of each row sent")
    cross_cluster_overlap_steps: int = _opt(
        0, "local steps a sync's exchange runs behind (sent in the background); 0 = wait for it at the sync step"
    )
    cross_cluster_max_sync_fraction: float = _opt(
        0.1, "with cross_cluster_compress adaptive: most of a step's time the visible sync may take"
    )
    cross_cluster_key_file: str | None = _opt(
        None, "file with the shared key that authenticates cross-cluster messages (else env ERNIEKIT_CROSS_CLUSTER_KEY)"
    )
    cross_cluster_link_mbit: float = _opt(
        0.0, "emulate a slow link: bandwidth of the cross-cluster messages in Mbit/s (0 = not emulated)"
    )
    cross_cluster_link_latency_ms: float = _opt(0.0, "emulate a slow link: one-way latency of each message in ms")
    cross_cluster_link_shared: bool = _opt(
        True,
        "emulated link: the processes of a cluster on this machine share one link to each other cluster (a "
        "site's uplink); false: every rank pair gets the whole bandwidth",
    )
    cross_cluster_timeout_s: float = _opt(
        600.0, "longest wait for a message from the other cluster before the job stops"
    )

    @property
    def expert_fp8_block(self) -> int:
        """The FP8 tile the experts' GEMMs split their widths by (every layout must divide them by it);
        0 without FP8."""
        return self.fp8_block_size if self.fp8 else 0


def field_types() -> dict[str, Any]:
    """Resolved type of each TrainConfig field (annotations are strings under __future__)."""
    return typing.get_type_hints(TrainConfig)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """Split `X | None` into (X, True); any other type into (type, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def format_value(value: Any) -> str:
    """Write a value the way a user types it after `key=` (true, null, 3e-4, {})."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return value if isinstance(value, str) else str(value)


def fields() -> tuple[dataclasses.Field, ...]:
    """TrainConfig fields in declaration order (for help and dumping)."""
    return dataclasses.fields(TrainConfig)


# ---- sections ---------------------------------------------------------------------------------
# The same keys, grouped: a module that needs the optimizer's settings takes `cfg.optim`, not the
# whole run config, so it cannot come to depend on unrelated keys. Users still write flat keys.
SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "method": ("stage", "fine_tuning"),
    "model": ("model_name_or_path", "tokenizer_name_or_path", "model_overrides", "init_layers_from", "init_layer_map"),
    "data": (
        "train_dataset_path",
        "train_dataset_type",
        "eval_dataset_path",
        "eval_dataset_type",
        "dataset_dir",
        "tokenized_path",
        "max_seq_len",
        "packing",
        "truncation",
        "chat_template",
        "train_on_reasoning",
    ),
    "batch": (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "num_train_epochs",
    ),
    "optim": (
        "learning_rate",
        "min_lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "lr_scheduler_type",
        "warmup_steps",
        "warmup_ratio",
        "decay_ratio",
    ),
    "output": (
        "seed",
        "output_dir",
        "logging_dir",
        "logging_steps",
        "save_steps",
        "routing_plot_steps",
        "eval_steps",
        "save_total_limit",
        "resume_from_checkpoint",
        "disable_tqdm",
    ),
    "evaluation": ("do_train", "do_eval", "eval_generation", "eval_max_new_tokens", "eval_max_samples"),
    "lora": (
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "rslora",
        "use_dora",
        "lora_plus_scale",
        "lora_base_dtype",
        "lora_peft_layout",
    ),
    "vision": ("image_min_pixels", "image_max_pixels", "freeze_vision_encoder", "freeze_resampler", "vit_lr_ratio"),
    "dpo": ("beta", "loss_type", "label_smoothing", "reference_free", "sft_loss_ratio", "simpo_gamma", "dpop_lambda"),
    "rl": (
        "num_generations",
        "max_new_tokens",
        "temperature",
        "top_p",
        "stop_token_ids",
        "reward_funcs",
        "reward_weights",
        "num_iterations",
        "epsilon",
        "epsilon_high",
        "scale_rewards",
        "loss_aggregation",
        "filter_zero_std_groups",
        "routing_replay",
        "gamma",
        "lam",
        "vf_coef",
        "cliprange_value",
    ),
    "distill": (
        "teacher_name_or_path",
        "distill_loss",
        "distill_beta",
        "distill_temperature",
        "distill_alpha",
        "on_policy_ratio",
        "teacher_topk_cache",
        "teacher_topk",
        "distill_hidden_weight",
        "distill_hidden_layer_map",
    ),
    "ema": ("ema_decay", "save_ema"),
    "loss": ("loss_token_balance",),
    "control": (
        "control_drop_prob",
        "credibility_loss_weight",
        "credibility_every",
        "credibility_batch_size",
        "credibility_max_new_tokens",
        "credibility_temperature",
    ),
    "elastic": (
        "elastic_depth",
        "elastic_experts",
        "elastic_top_k",
        "elastic_full_prob",
        "elastic_sandwich",
        "elastic_distill_weight",
    ),
    "precision": (
        "bf16",
        "fp16",
        "fp8",
        "fp8_block_size",
        "fp8_grad_format",
        "compute_type",
        "recompute",
        "recompute_granularity",
        "fused_head_loss",
    ),
    "parallelism": (
        "data_parallel_degree",
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_degree",
        "pipeline_stage_layers",
        "sharding",
        "sharding_parallel_degree",
        "parallel",
        "cluster",
        "nproc_per_node",
        "nnodes",
        "master",
        "max_restart",
        "restart_rendezvous_s",
        "dataloader_num_workers",
    ),
    "ps": (
        "distributed_mode",
        "ps_servers",
        "ps_sync_mode",
        "ps_k_steps",
        "ps_compress",
        "ps_topk_ratio",
        "ps_stage_devices",
        "ps_placement",
        "ps_target",
        "ps_stage_workers",
    ),
    "online_distill": (
        "online_distill_students",
        "online_distill_every",
        "online_distill_loss",
        "online_distill_beta",
        "online_distill_temperature",
        "online_distill_alpha",
        "online_distill_start",
    ),
    "cross_cluster": (
        "cross_cluster_sizes",
        "cross_cluster_id",
        "cross_cluster_peers",
        "cross_cluster_sync",
        "cross_cluster_sync_every",
        "cross_cluster_outer",
        "cross_cluster_outer_lr",
        "cross_cluster_outer_momentum",
        "cross_cluster_compress",
        "cross_cluster_topk_ratio",
        "cross_cluster_overlap_steps",
        "cross_cluster_max_sync_fraction",
        "cross_cluster_key_file",
        "cross_cluster_link_mbit",
        "cross_cluster_link_latency_ms",
        "cross_cluster_link_shared",
        "cross_cluster_timeout_s",
    ),
}

SECTIONS: dict[str, type] = {
    name: dataclasses.make_dataclass(
        "".join(part.title() for part in name.split("_")) + "Section",
        [(key, TrainConfig.__annotations__[key]) for key in keys],
        frozen=True,
    )
    for name, keys in SECTION_KEYS.items()
}


def section(cfg: TrainConfig, name: str):
    """The keys of section `name` of cfg, as a frozen dataclass of the same field names."""
    return SECTIONS[name](**{key: getattr(cfg, key) for key in SECTION_KEYS[name]})


def _section_property(name: str) -> property:
    return property(lambda self: section(self, name), doc=f"the {name} keys: {', '.join(SECTION_KEYS[name])}")


for _name in SECTION_KEYS:
    setattr(TrainConfig, _name, _section_property(_name))
