"""What GRPO and PPO share as stages of the training core: prompts, rollouts, rewards, the
reference model, scoring passes, evaluation and logging. The two stages differ only in how a
rollout becomes advantages and in the loss (erniekit/train/stages/grpo.py, ppo.py).

Per optimizer step the loop asks `step_batches` for its micro-batches. Every `num_iterations`
steps the stage samples a new rollout batch from the current policy (one per micro-batch of
prompts); the steps in between optimise again on the same rollouts, with the importance ratio
against the log-probs they were sampled with (`old_logp`, scored right after sampling).
A run resumed between two rollouts samples a new one from the resumed weights.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import paddle

from erniekit.errors import DataError
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.stops import decodable_vocab
from erniekit.rl.data import PromptExample, load_prompts
from erniekit.rl.losses import token_entropy
from erniekit.rl.rewards import accuracy, check_fields, compute_rewards, load_reward_functions
from erniekit.rl.rollout import Rollout, greedy_completions, repeat_prompts, rollout
from erniekit.routing.replay import changed_counts, routing_reference
from erniekit.train.evaluation import prompt_ids
from erniekit.train.losses import IGNORE_INDEX, token_logps
from erniekit.train.stage import Stage


@dataclass
class Scores:
    """No-grad forward results on a rollout batch, width K = N + 1 (see `_targets`)."""

    logp: np.ndarray  # [B, K]
    hidden: paddle.Tensor | None = None  # [B, K, H] final hidden states (value heads)


def _encode_prompts(examples: list[PromptExample], tokenizer, cfg, what: str) -> list[list[int]]:
    """Prompt token ids; a prompt that leaves no room for max_new_tokens within max_seq_len is an
    error (truncation: error) or dropped with one warning (truncation: truncate)."""
    out, dropped = [], 0
    limit = cfg.max_seq_len - cfg.max_new_tokens
    for ex in examples:
        ids = prompt_ids(ex.conv, tokenizer)
        if len(ids) > limit:
            if cfg.truncation == "error":
                raise DataError(
                    f"{ex.source}: prompt has {len(ids)} tokens, more than max_seq_len - max_new_tokens = "
                    f"{limit}; raise max_seq_len, lower max_new_tokens or set truncation=truncate to drop it"
                )
            dropped += 1
            ids = None
        out.append(ids)
    if dropped:
        warnings.warn(
            f"{dropped} of {len(examples)} {what} prompts dropped: longer than max_seq_len - max_new_tokens",
            stacklevel=2,
        )
    return out


class RLStage(Stage):
    name = "RL"
    progress_keys = {"reward": "train/reward"}

    # ---- data ------------------------------------------------------------------------------
    def build_train_rows(self, cfg, tokenizer):
        examples = load_prompts(cfg.train_dataset_path, cfg.train_dataset_type)
        ids = _encode_prompts(examples, tokenizer, cfg, "training")
        self.examples = [e for e, i in zip(examples, ids) if i is not None]
        self.prompt_ids = [i for i in ids if i is not None]
        if not self.prompt_ids:
            raise DataError(f"{cfg.train_dataset_path}: no prompt fits max_seq_len - max_new_tokens; raise max_seq_len")
        self.control_record = self._trained_controls(cfg)
        return [{"prompt_index": np.array(i)} for i in range(len(self.prompt_ids))]

    def _trained_controls(self, cfg) -> dict | None:
        """The starting model's control record plus the attributes of the prompts the policy is shown
        (all of each prompt's: control_drop_prob is SFT's; a prompt too long to sample is not counted).
        Read here, with the data, a damaged starting record stops the run before the model loads."""
        from erniekit.data.control import count_controls, merge_records

        trained = count_controls(e.conv.control for e in self.examples)
        return merge_records(self.starting_control_record(cfg), trained)

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        examples = load_prompts(cfg.eval_dataset_path, cfg.eval_dataset_type)
        ids = _encode_prompts(examples, tokenizer, cfg, "eval")
        kept = [e for e, i in zip(examples, ids) if i is not None]
        self.check_held_out_controls([e.conv for e in kept[: cfg.eval_max_samples]], cfg)  # evaluate()'s prompts
        return {"examples": kept, "prompt_ids": [i for i in ids if i is not None]}

    def collate(self, rows, pad_id):
        return {"prompt_index": np.array([int(r["prompt_index"]) for r in rows], np.int64)}

    # ---- setup -----------------------------------------------------------------------------
    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = sorted({tokenizer.sep_token_id, tokenizer.eos_token_id, *cfg.stop_token_ids})
        self.reward_funcs = load_reward_functions(cfg.reward_funcs, cfg.reward_weights)
        for examples in [getattr(self, "examples", [])] + ([eval_data["examples"]] if eval_data else []):
            check_fields(self.reward_funcs, [e.fields for e in examples], [e.source for e in examples])
        self.is_moe = bool(model.moe_layers()) if hasattr(model, "moe_layers") else False
        self.reference = self._build_reference(model, cfg) if self.uses_reference(cfg) else None
        self.buffer: list[dict] | None = None
        self.buffer_round = -1
        self._rollout_metrics: dict[str, float] = {}
        self._loss_stats: dict[str, float] = {}

    def uses_reference(self, cfg) -> bool:
        return cfg.beta > 0

    @staticmethod
    def _build_reference(model, cfg):
        """A frozen copy of the starting weights, or, with LoRA, the same model with its adapters
        disabled (returned as the string "adapters-disabled": no second copy in memory)."""
        if cfg.fine_tuning == "LoRA":
            return "adapters-disabled"
        from erniekit.utils.dtensor import to_dense

        ref = type(model)(model.config)
        ref.set_state_dict({k: to_dense(v) for k, v in model.state_dict().items()})  # a full copy per process
        if cfg.fp8:
            ref.set_fp8(cfg.fp8_block_size, cfg.fp8_grad_format)
        for p in ref.parameters():
            p.stop_gradient = True
        ref.eval()
        return ref

    # ---- one step's batches ----------------------------------------------------------------
    def step_batches(self, model, micro: list[dict], step: int) -> list[dict]:
        """New rollouts every num_iterations steps; the same ones in between."""
        rnd = step // self.cfg.num_iterations
        if self.buffer is None or rnd != self.buffer_round:
            self._rollout_metrics = {}
            self.buffer = [self._make_batch(model, b) for b in micro]
            self.buffer_round = rnd
            self._rollout_metrics = {k: float(np.mean(v)) for k, v in self._rollout_metrics.items()}
        return self.buffer

    def _make_batch(self, model, prompt_batch: dict) -> dict:
        cfg = self.cfg
        G = cfg.num_generations
        idx = prompt_batch["prompt_index"]
        examples = [self.examples[i] for i in idx]
        params = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=self.stop_ids,
        )
        ro = rollout(
            model,
            repeat_prompts([self.prompt_ids[i] for i in idx], G),
            params,
            self.pad_id,
            record_routing=self.is_moe,
            vocab=decodable_vocab(model, self.tokenizer),
        )
        rewards = self._rewards(examples, ro.completions(), G)  # [F, B]
        total = np.asarray([f.weight for f in self.reward_funcs]) @ rewards
        batch = self._layout(ro)
        batch["rewards"] = total.astype(np.float32)
        self._add_rollout_metrics(ro, rewards, total)
        self.build_advantages(model, batch, ro, total)
        return batch

    def _rewards(self, examples: list[PromptExample], comp_ids: list[list[int]], repeat: int = 1) -> np.ndarray:
        """[n_funcs, B] rewards of completions; the `repeat` samples of each example are adjacent."""
        completions = [self.tokenizer.decode(c) for c in comp_ids]
        prompts = [e.prompt_text for e in examples for _ in range(repeat)]
        common = set.intersection(*(set(e.fields) for e in examples)) if examples else set()
        fields = {k: [e.fields[k] for e in examples for _ in range(repeat)] for k in sorted(common)}
        return compute_rewards(self.reward_funcs, prompts, completions, comp_ids, fields)

    @staticmethod
    def _layout(ro: Rollout) -> dict:
        """Training-forward arrays. Logits are kept for the last K = N + 1 columns (L - 1 .. L + N - 1):
        column j predicts completion token j; the extra last column is never trained (keeping it
        avoids slicing a gradient tensor, slow in Paddle's CPU kernels)."""
        B, N = ro.completion_ids.shape
        K = N + 1
        targets = np.full((B, K), IGNORE_INDEX, np.int64)
        targets[:, :N] = np.where(ro.completion_mask > 0, ro.completion_ids, IGNORE_INDEX)
        mask = np.zeros((B, K), np.float32)
        mask[:, :N] = ro.completion_mask
        batch = {
            "input_ids": ro.input_ids,
            "attention_mask": ro.attention_mask,
            "segment_ids": ro.attention_mask,
            "targets": targets,
            "completion_mask": mask,
            "loss_mask": mask.copy(),
        }
        if ro.routing is not None:
            batch["routing"] = ro.routing
            batch["routing_mask"] = ro.routing_mask
        return batch

    def build_advantages(self, model, batch: dict, ro: Rollout, rewards: np.ndarray) -> None:
        raise NotImplementedError

    # ---- forwards --------------------------------------------------------------------------
    def forward(self, model, batch: dict, force_routing: bool):
        K = batch["targets"].shape[1]
        with routing_reference(model, batch.get("routing"), batch.get("routing_mask"), force_routing):
            return model(
                paddle.to_tensor(batch["input_ids"]),
                attention_mask=paddle.to_tensor(batch["attention_mask"]),
                logits_to_keep=K,
            )

    @paddle.no_grad()
    def score(self, model, batch: dict, with_hidden: bool = False) -> Scores:
        """Log-probs (and hidden states) of the sampled completions under `model`, no gradient."""
        was_training = model.training
        model.eval()
        try:
            out = self.forward(model, batch, self.cfg.routing_replay)
            logp = token_logps(out.logits, batch["targets"], self.cfg.temperature).numpy()
        finally:
            if was_training:
                model.train()
        return Scores(logp, out.hidden_states if with_hidden else None)

    @paddle.no_grad()
    def reference_logps(self, model, batch: dict) -> np.ndarray:
        if self.reference == "adapters-disabled":
            from erniekit.nn.lora import adapters_disabled

            with adapters_disabled(model):
                return self.score(model, batch).logp
        return self.score(self.reference, batch).logp

    def policy_forward(self, model, batch: dict):
        """The training forward: (output, per-token log-probs [B, K] with gradient)."""
        out = self.forward(model, batch, self.cfg.routing_replay)
        changed, total = changed_counts(model)
        if total:
            self._stat("routing_changed_fraction", changed, total)
        logp = token_logps(out.logits, batch["targets"], self.cfg.temperature)
        mask = batch["completion_mask"]
        ent = token_entropy(out.logits.detach(), self.cfg.temperature).numpy()
        self._stat("entropy", float((ent * mask).sum()), float(mask.sum()))
        return out, logp

    def normalizer(self, batch) -> int:
        from erniekit.rl.losses import units

        return units(batch["loss_mask"], self.cfg.loss_aggregation)

    # ---- metrics ---------------------------------------------------------------------------
    def _stat(self, key: str, value: float, count: float) -> None:
        s, n = self._loss_stats.get(key, (0.0, 0.0))
        self._loss_stats[key] = (s + value, n + count)

    def _add_rollout_metrics(self, ro: Rollout, rewards: np.ndarray, total: np.ndarray) -> None:
        m = self._rollout_metrics
        add = lambda k, v: m.setdefault(k, []).append(float(v))  # noqa: E731
        add("reward", total.mean())
        add("reward_std", total.std())
        for f, r in zip(self.reward_funcs, rewards):
            add(f"rewards/{f.name}/mean", r.mean())
            add(f"rewards/{f.name}/std", r.std())
        add("completion_length", ro.completion_mask.sum(1).mean())
        add("stopped_fraction", ro.stopped.mean())

    def step_metrics(self) -> dict[str, float]:
        """Rollout figures of the batch trained on this step, and per-token averages of the loss terms."""
        out = {f"train/{k}": v for k, v in self._rollout_metrics.items()}
        out.update({f"train/{k}": s / n for k, (s, n) in self._loss_stats.items() if n > 0})
        self._loss_stats = {}
        return out

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, model, tokenizer, eval_data, cfg) -> dict[str, float]:
        """Greedy completions on held-out prompts: mean of each reward and, where records carry an
        answer, exact match (the same figure the SFT stage reports)."""
        n = min(len(eval_data["examples"]), cfg.eval_max_samples)
        examples, prompts = eval_data["examples"][:n], eval_data["prompt_ids"][:n]
        comp_ids = greedy_completions(
            model,
            prompts,
            cfg.eval_max_new_tokens,
            self.stop_ids,
            self.pad_id,
            cfg.per_device_eval_batch_size,
            vocab=decodable_vocab(model, tokenizer),
        )
        rewards = self._rewards(examples, comp_ids)
        res = {"reward": float((np.asarray([f.weight for f in self.reward_funcs]) @ rewards).mean())}
        for f, r in zip(self.reward_funcs, rewards):
            res[f"reward/{f.name}"] = float(r.mean())
        if examples and all("answer" in e.fields for e in examples):
            res["exact_match"] = float(
                np.mean(
                    [accuracy([], [tokenizer.decode(c)], [e.fields["answer"]])[0] for c, e in zip(comp_ids, examples)]
                )
            )
        return res
