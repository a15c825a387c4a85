"""stage: Distill — a student learns a teacher checkpoint's next-token distributions (docs/distillation.md).

The student is the run's model (model_name_or_path, a preset, model_overrides: fewer layers,
narrower, dense from MoE, fewer experts; Full or LoRA); the teacher is `teacher_name_or_path`, a
checkpoint with the same tokenizer and vocabulary, frozen in eval mode in the same process. On
each trained position of an SFT batch (the assistant replies), the loss is

    distill_alpha * T^2 * D(teacher || student) + (1 - distill_alpha) * cross-entropy(labels)

with D one of forward KL, reverse KL or GKD's generalised JSD (erniekit/train/distill_losses.py),
summed over the trained tokens and averaged by the loop like the SFT loss. MoE students add their
router losses as in SFT.

On-policy steps (GKD, Agarwal et al. 2024): a fraction `on_policy_ratio` of the optimizer steps,
drawn per step from (seed, step), train on replies the student samples itself to the batch's
prompts (the tokens before each row's first trained token), scored by the teacher. A resumed run
draws the same steps and, seeded by the loop per step, samples the same replies.

With `distill_hidden_weight` > 0 each student layer's output also learns a teacher layer's
(erniekit/train/hidden_distill.py, TinyBERT's hidden-state loss): that term, a sum over the batch's
real tokens, is added with its weight.

The teacher's logits come from a forward pass per batch, or from `teacher_topk_cache` (its top-k
log-probabilities on the training rows, computed once: erniekit/train/distill_cache.py); the
cache serves the dataset's rows, so on-policy steps still need the teacher in memory.

Parallel layouts (docs/distillation.md): one process and plain data parallelism (whole-model
replicas) may keep the teacher in memory. Every other layout SFT runs (tensor / expert parallelism
and sharding on DistTensors, pipeline stages, the parameter-server mode) reads the teacher from
its cache only (config validation asks for `teacher_topk_cache` and refuses on-policy steps there),
and the loss reaches the student's logits in that layout's own form: per-position teacher arrays
placed like the labels (`aligned_distill_loss_sum`), the pipeline's last stage (`logits_loss`), or
the servers' blocks of the LM head (`token_logp_terms`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import paddle

from erniekit.data.encode import encode_conversations
from erniekit.data.formats import Conversation, load_sft_examples
from erniekit.errors import ConfigError, DataError
from erniekit.train.distill_losses import (
    TopK,
    aligned_distill_loss_sum,
    aligned_topk,
    distill_loss_sum,
    gather_positions,
    top_k,
    topk_loss_sum,
    trained_positions,
)
from erniekit.train.evaluation import baseline_exact_match, exact_match_eval, majority_reply
from erniekit.train.losses import IGNORE_INDEX, causal_lm_loss_sum, count_target_tokens
from erniekit.train.stage import LossOutput, Stage, Supports, lm_loss, model_inputs
from erniekit.train.stages import register_stage
from erniekit.utils.dtensor import is_dist, is_main_process, scalar

_ON_POLICY_STREAM = 0x6B64  # keeps the per-step on-policy draw apart from other uses of the seed
HIDDEN_PROJ_NAME = "hidden_projection"  # the hidden-state loss's W_h, beside the student (never saved in it)
HIDDEN_PROJ_FILE = f"{HIDDEN_PROJ_NAME}.safetensors"


def _rows(convs: list[Conversation], cfg, tokenizer, path: str) -> list[dict[str, np.ndarray]]:
    pairs = encode_conversations(convs, tokenizer, cfg.max_seq_len, cfg.truncation, cfg.train_on_reasoning, path)
    return [
        {"input_ids": np.asarray(i, np.int64), "labels": np.asarray(l, np.int64), "row_index": np.array(n)}
        for n, (i, l) in enumerate(pairs)
    ]


def vocabulary_mismatch(student_tok, teacher_tok) -> str | None:
    """How two tokenizers differ (None: the same id -> token table)."""
    if student_tok.vocab_size != teacher_tok.vocab_size:
        return f"{student_tok.vocab_size} tokens against the teacher's {teacher_tok.vocab_size}"
    ids = list(range(student_tok.vocab_size))
    a, b = student_tok.convert_ids_to_tokens(ids), teacher_tok.convert_ids_to_tokens(ids)
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if diff:
        i = diff[0]
        return f"{len(diff)} ids name other tokens (id {i}: {a[i]!r} against the teacher's {b[i]!r})"
    return None


def on_policy_step(seed: int, step: int, ratio: float) -> bool:
    """Whether optimizer step `step` trains on the student's own samples: a pure function of
    (seed, step), so a resumed run draws the same steps."""
    if ratio <= 0.0:
        return False
    if ratio >= 1.0:
        return True
    return bool(np.random.default_rng([seed, step, _ON_POLICY_STREAM]).random() < ratio)


def prompts_of(batch: dict[str, np.ndarray]) -> list[list[int]]:
    """Each row's tokens before its first trained target (the prompt of its first reply)."""
    labels, ids = batch["labels"], batch["input_ids"]
    real = batch["segment_ids"] > 0
    trained = labels != IGNORE_INDEX
    first = np.where(trained.any(1), trained.argmax(1), real.sum(1))
    return [ids[i, : first[i]].tolist() for i in range(len(ids))]


@register_stage
class DistillStage(Stage):
    name = "Distill"
    aliases = ("KD", "GKD")
    supports = Supports(row_losses=True, pipeline=True, parameter_server=True)
    progress_keys = {"kd": "train/distill_loss"}

    # ---- data (the SFT stage's: chat-template rows, loss on the replies) --------------------
    def build_train_rows(self, cfg, tokenizer):
        convs = load_sft_examples(cfg.train_dataset_path, cfg.train_dataset_type)
        self.majority_reply = majority_reply(convs)
        return _rows(convs, cfg, tokenizer, cfg.train_dataset_path)

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        convs = load_sft_examples(cfg.eval_dataset_path, cfg.eval_dataset_type)
        return {"convs": convs, "rows": _rows(convs, cfg, tokenizer, cfg.eval_dataset_path)}

    def collate(self, rows, pad_id):
        from erniekit.train.batching import collate

        batch = collate(rows, pad_id)
        batch["row_index"] = np.array([int(r.get("row_index", -1)) for r in rows], np.int64)
        return batch

    # ---- the teacher --------------------------------------------------------------------------
    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)
        from erniekit.models import registry

        self.cfg, self.tokenizer = cfg, tokenizer
        self.vocab = model.config.vocab_size
        self.on_policy = False  # the current step's kind (step_batches sets it)
        self._stats: dict[str, float] = {}
        path = cfg.teacher_name_or_path
        why = vocabulary_mismatch(tokenizer, registry.load_tokenizer(path))
        if why:
            raise ConfigError(
                f"teacher_name_or_path: {path} has another tokenizer than the student ({why}); distillation "
                "compares distributions over the same vocabulary: use a teacher trained with the student's tokenizer"
            )
        t_vocab = registry.model_config(path).vocab_size
        if t_vocab != model.config.vocab_size:
            raise ConfigError(
                f"teacher_name_or_path: {path} has vocab_size={t_vocab}, the student {model.config.vocab_size}; "
                f"set model_overrides.vocab_size: {t_vocab}"
            )
        self.teacher = None
        self.cache = None
        if cfg.teacher_topk_cache:
            self.cache = self._open_or_build_cache(train_rows, cfg)
        if self.cache is None or cfg.on_policy_ratio > 0:
            self.teacher = self._load_teacher()
        self.teacher_eval: dict[str, float] | None = None  # the teacher's own held-out figures, once
        self._prepare_hidden(model, cfg)

    def _prepare_hidden(self, model, cfg) -> None:
        """The hidden-state loss's layer map and, for a student narrower than the teacher, its W_h."""
        from erniekit.models.layer_init import depth_fraction_layer_map
        from erniekit.train.hidden_distill import HiddenProjection

        self.hidden_map: list[int] = []
        self.hidden_proj = None
        if cfg.distill_hidden_weight == 0:
            return
        n_s, n_t = model.config.num_hidden_layers, self.teacher.config.num_hidden_layers
        given = cfg.distill_hidden_layer_map
        self.hidden_map = list(given) if given is not None else depth_fraction_layer_map(n_s, n_t)
        if len(self.hidden_map) != n_s or not all(0 <= i < n_t for i in self.hidden_map):
            raise ConfigError(
                f"distill_hidden_layer_map={self.hidden_map}: needs {n_s} teacher layers, one per student layer "
                f"(the teacher has {n_t}); give {n_s} indices in [0, {n_t}) or null"
            )
        w_s, w_t = model.config.hidden_size, self.teacher.config.hidden_size
        if w_s != w_t:
            self.hidden_proj = HiddenProjection(w_s, w_t, model.config.initializer_range)

    def extra_named_parameters(self):
        proj = getattr(self, "hidden_proj", None)
        return [] if proj is None else [(f"{HIDDEN_PROJ_NAME}.{n}", p) for n, p in proj.named_parameters()]

    def checkpoint_tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        proj = getattr(self, "hidden_proj", None)
        return {} if proj is None else {HIDDEN_PROJ_FILE: dict(proj.state_dict())}

    def load_checkpoint_tensors(self, path: str) -> None:
        if getattr(self, "hidden_proj", None) is None:
            return
        file = os.path.join(path, HIDDEN_PROJ_FILE)
        if not os.path.isfile(file):
            raise ConfigError(
                f"resume_from_checkpoint={path}: no {HIDDEN_PROJ_FILE}, the hidden-state loss's map to the teacher's "
                "width (distill_hidden_weight with a narrower student); resume from a checkpoint of this run's "
                "config or start a fresh output_dir"
            )
        from erniekit.utils.io import load_safetensors

        self.hidden_proj.set_state_dict(load_safetensors(file))

    def _load_teacher(self):
        from erniekit.models import registry

        teacher = registry.load_model(self.cfg.teacher_name_or_path)
        for p in teacher.parameters():
            p.stop_gradient = True
        teacher.eval()
        return teacher

    @paddle.no_grad()
    def teacher_logits(self, batch: dict[str, np.ndarray]) -> paddle.Tensor:
        return self.teacher(**model_inputs(batch)).logits

    def _with_hidden(self, model, batch, forward):
        """forward() run with the student's and the teacher's mapped layer outputs captured: its
        result, the teacher's logits and the hidden-state loss (a sum over real tokens)."""
        from erniekit.train.hidden_distill import layer_loss_sum, layer_outputs

        students = list(range(len(self.hidden_map)))
        with layer_outputs(model, students) as s_out:
            res = forward()
        with layer_outputs(self.teacher, self.hidden_map) as t_out:
            t_logits = self.teacher_logits(batch)
        missing = [i for i in students if i not in s_out]
        if missing:
            raise ConfigError(
                f"distill_hidden_weight: student layer {missing[0]} did not run in this forward (elastic depth or "
                "a pipeline stage); the hidden-state loss needs every student layer: set distill_hidden_weight=0"
            )
        hidden = layer_loss_sum(
            [s_out[i] for i in students], [t_out[j] for j in self.hidden_map], batch["segment_ids"], self.hidden_proj
        )
        return res, t_logits, hidden

    def _open_or_build_cache(self, train_rows, cfg):
        """Rank 0 opens or builds the cache (the teacher loaded for the build only); the other ranks
        wait for it to be in place (distill_cache.wait_for_cache: no collective)."""
        from erniekit.distributed.collective.runtime import placing_batches
        from erniekit.models import registry
        from erniekit.train.distill_cache import build_cache, fingerprint, open_cache, wait_for_cache

        k = min(cfg.teacher_topk, registry.model_config(cfg.teacher_name_or_path).vocab_size)
        want = fingerprint(cfg.teacher_name_or_path, train_rows, k, cfg.distill_temperature)
        directory = cfg.teacher_topk_cache
        if not is_main_process():
            return wait_for_cache(directory, want)
        cache = open_cache(directory, want)
        if cache is not None:
            return cache
        self.teacher = self._load_teacher()
        pad = self.tokenizer.pad_token_id

        def batch_topk(rows):
            b = self.collate(rows, pad)
            logits = self.teacher_logits(b)
            flat = trained_positions(b["labels"], b["segment_ids"])
            return top_k(gather_positions(logits, flat), k, cfg.distill_temperature)

        with placing_batches(None):  # plain tensors on rank 0 alone: the other ranks are not in this
            cache = build_cache(directory, want, train_rows, batch_topk, cfg.per_device_eval_batch_size)
        self.teacher = None  # loaded again by `prepare` only if on-policy steps need it
        return cache

    # ---- one step's batches ---------------------------------------------------------------------
    def step_batches(self, model, micro, step):
        """The data's batches, or on an on-policy step the student's own replies to their prompts."""
        self.on_policy = on_policy_step(self.cfg.seed, step, self.cfg.on_policy_ratio)
        if not self.on_policy:
            return micro
        return [self.sampled_batch(model, b) for b in micro]

    @paddle.no_grad()
    def sampled_batch(self, model, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Prompt + the student's sampled reply (up to and with its stop token) per row, the reply
        trained; right-padded like a data batch (row_index -1: no cache entry)."""
        from erniekit.infer.sampling import SamplingParams
        from erniekit.infer.stops import decodable_vocab, turn_end_ids
        from erniekit.rl.rollout import rollout

        cfg = self.cfg
        prompts = prompts_of(batch)
        room = cfg.max_seq_len - max(len(p) for p in prompts)
        if room < 1:
            raise DataError(
                f"on-policy distillation: a prompt of {cfg.max_seq_len - room} tokens leaves no room to sample "
                f"within max_seq_len={cfg.max_seq_len}; raise max_seq_len"
            )
        params = SamplingParams(
            max_new_tokens=min(cfg.max_new_tokens, room),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=sorted({*turn_end_ids(self.tokenizer), *cfg.stop_token_ids}),
        )
        ro = rollout(model, prompts, params, self.tokenizer.pad_token_id, vocab=decodable_vocab(model, self.tokenizer))
        rows = []
        for p, comp, m in zip(prompts, ro.completion_ids, ro.completion_mask):
            reply = comp[: int(m.sum())]
            rows.append(
                {
                    "input_ids": np.concatenate([np.asarray(p, np.int64), reply]),
                    "labels": np.concatenate([np.full(len(p), IGNORE_INDEX, np.int64), reply]),
                }
            )
        self._stat("sampled_reply_length", float(ro.completion_mask.sum()), len(rows))
        return self.collate(rows, self.tokenizer.pad_token_id)

    # ---- the loss -------------------------------------------------------------------------------
    def teacher_for(self, batch: dict[str, np.ndarray]) -> paddle.Tensor | TopK:
        """The teacher's side of the loss for this batch: cached top-k for dataset rows when a cache
        is in use, else its logits."""
        if self.cache is not None and (batch["row_index"] >= 0).all():
            return self.cache.batch(batch["row_index"])
        return self.teacher_logits(batch)

    def loss(self, model, batch) -> LossOutput:
        forward = lambda: lm_loss(model, batch)  # noqa: E731 (the student's forward, hard-label and router losses)
        res, teacher, hidden = self._with_hidden(model, batch, forward) if self.hidden_map else (forward(), None, None)
        kd = self._kd_sum(res.logits, batch, teacher)
        res.metrics.update(distill_loss=scalar(kd), hard_loss=scalar(res.loss_sum))
        res.loss_sum = self._mix(kd, res.loss_sum)
        if hidden is not None:
            res.metrics["hidden_loss"] = scalar(hidden)  # a sum: the runner logs it per trained token, as the loss
            res.loss_sum = res.loss_sum + self.cfg.distill_hidden_weight * hidden
        return res

    def _mix(self, kd, hard):
        a = self.cfg.distill_alpha
        return kd if a == 1.0 else hard if a == 0.0 else a * kd + (1.0 - a) * hard

    def _kd_sum(self, logits: paddle.Tensor, batch: dict[str, np.ndarray], teacher=None) -> paddle.Tensor:
        """T^2 x the divergence over the batch's trained positions (teacher: its logits, when already
        computed). DistTensor logits (tensor / expert parallelism, sharding) meet the cached teacher
        as per-position arrays placed like the labels; plain logits the gathered positions."""
        cfg = self.cfg
        if not is_dist(logits):
            teacher = self.teacher_for(batch) if teacher is None else teacher
            return distill_loss_sum(
                logits,
                batch["labels"],
                teacher,
                cfg.distill_loss,
                cfg.distill_beta,
                cfg.distill_temperature,
                batch["segment_ids"],
            )
        from erniekit.train.losses import batch_tensor

        top = aligned_topk(self._cached(batch), batch["labels"], batch["segment_ids"])
        weight = np.zeros(batch["labels"].shape, np.float32)
        weight.reshape(-1)[trained_positions(batch["labels"], batch["segment_ids"])] = 1.0
        return aligned_distill_loss_sum(
            logits,
            batch_tensor(top.ids),
            batch_tensor(top.logp),
            batch_tensor(weight),
            cfg.distill_loss,
            cfg.distill_beta,
            cfg.distill_temperature,
        )

    def _cached(self, batch: dict[str, np.ndarray]) -> TopK:
        """The cached teacher of a batch of dataset rows (the layouts without a teacher in memory)."""
        if self.cache is None or not (batch["row_index"] >= 0).all():
            raise ConfigError(
                "stage Distill in this parallel layout reads the teacher from teacher_topk_cache only; set "
                "teacher_topk_cache: DIR and on_policy_ratio: 0"
            )
        return self.cache.batch(batch["row_index"])

    # ---- the loss where another runner owns the forward ----------------------------------------
    def logits_loss(self, logits: paddle.Tensor, batch: dict[str, np.ndarray]) -> paddle.Tensor:
        """The loss sum from the student's logits [B, S, V] of `batch` (a pipeline's last stage,
        erniekit/train/runners/pipeline.py): the cached teacher, mixed with the labels' loss."""
        hard = causal_lm_loss_sum(logits, batch["labels"], batch["segment_ids"])
        return self._mix(self._kd_sum(logits, batch), hard)

    def token_logp_terms(self, batch: dict[str, np.ndarray]) -> list[tuple[float, np.ndarray, Callable]]:
        """The loss as terms of the student's log-probabilities of given tokens, for a runner that
        never holds the whole LM head (the parameter-server workers, erniekit/train/runners/ps.py).
        Each term: (temperature T, ids [N, m] at the N trained positions in order, f) with f mapping
        log softmax(z / T) at those ids [N, m] to the term's loss sum; the loss is the terms' sum."""
        cfg = self.cfg
        a, T = cfg.distill_alpha, cfg.distill_temperature
        flat = trained_positions(batch["labels"], batch["segment_ids"])
        target = batch["labels"].reshape(-1)[flat + 1][:, None]  # position t's next token
        top = self._cached(batch) if a > 0 else None
        if top is not None and top.ids.shape[0] != len(flat):
            raise ValueError(
                f"the teacher's top-k cache has {top.ids.shape[0]} positions for a batch with {len(flat)} "
                "trained positions; rebuild the cache for this data and max_seq_len"
            )

        def kd(s: paddle.Tensor) -> paddle.Tensor:
            t = paddle.to_tensor(top.logp)
            return a * topk_loss_sum(s, t, self.vocab, cfg.distill_loss, cfg.distill_beta, T)

        def hard(s: paddle.Tensor) -> paddle.Tensor:
            return -(1.0 - a) * s.sum()

        if a == 0.0:
            return [(1.0, target, hard)]
        if a == 1.0:
            return [(T, top.ids, kd)]
        if T == 1.0:  # one request: the teacher's k tokens and the label side by side
            k = top.ids.shape[1]
            return [(1.0, np.concatenate([top.ids, target], 1), lambda s: kd(s[:, :k]) + hard(s[:, k:]))]
        return [(T, top.ids, kd), (1.0, target, hard)]

    def step_metrics(self) -> dict[str, float]:
        out = {"train/on_policy": float(self.on_policy)}
        out.update({f"train/{k}": s / n for k, (s, n) in self._stats.items() if n > 0})
        self._stats = {}
        return out

    def _stat(self, key: str, value: float, count: float) -> None:
        s, n = self._stats.get(key, (0.0, 0.0))
        self._stats[key] = (s + value, n + count)

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, model, tokenizer, eval_data, cfg) -> dict[str, float]:
        """SFT's figures (held-out loss, exact match) and, with the teacher in memory, the held-out
        divergence to it, the student's top-1 agreement with it and the teacher's own exact match."""
        res = self._eval_passes(model, eval_data["rows"], cfg, tokenizer.pad_token_id)
        if cfg.eval_generation:
            convs = eval_data["convs"][: cfg.eval_max_samples]
            res["exact_match"] = exact_match_eval(
                model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
            )
            majority = getattr(self, "majority_reply", None)
            if majority is not None:
                res["baseline_exact_match"] = baseline_exact_match(convs, majority)
            if self.teacher is not None:
                if self.teacher_eval is None:
                    self.teacher_eval = {
                        "teacher_exact_match": exact_match_eval(
                            self.teacher, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
                        )
                    }
                res.update(self.teacher_eval)
        return res

    @paddle.no_grad()
    def _eval_passes(self, model, rows, cfg, pad_id: int) -> dict[str, float]:
        model.eval()
        total = kd = agree = hidden = 0.0
        n = 0
        for i in range(0, len(rows), cfg.per_device_eval_batch_size):
            b = self.collate(rows[i : i + cfg.per_device_eval_batch_size], pad_id)
            if self.hidden_map:
                logits, t, h = self._with_hidden(model, b, lambda b=b: model(**model_inputs(b)).logits)
                hidden += scalar(h)
            else:
                logits = model(**model_inputs(b)).logits
                t = self.teacher_logits(b) if self.teacher is not None else None
            total += scalar(causal_lm_loss_sum(logits, b["labels"], b["segment_ids"]))
            n += count_target_tokens(b)
            if t is None:
                continue
            kd += scalar(
                distill_loss_sum(
                    logits,
                    b["labels"],
                    t,
                    cfg.distill_loss,
                    cfg.distill_beta,
                    cfg.distill_temperature,
                    b["segment_ids"],
                )
            )
            flat = trained_positions(b["labels"], b["segment_ids"])
            s_top = gather_positions(logits, flat).argmax(-1).numpy()
            t_top = gather_positions(t, flat).argmax(-1).numpy()
            agree += float((s_top == t_top).sum())
        loss = total / max(n, 1)
        res = {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
        if self.teacher is not None:
            res["distill_loss"] = kd / max(n, 1)
            res["teacher_agreement"] = agree / max(n, 1)
        if self.hidden_map:
            res["hidden_loss"] = hidden / max(n, 1)  # per trained token, as in training
        return res
