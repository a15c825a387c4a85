"""stage: PPO — proximal policy optimisation with a value head and GAE (docs/rl.md).

Rollouts and rewards are GRPO's (one sample per prompt by default). The sequence reward is
given at the last completion token; with beta > 0 every token also gets -beta * (log pi - log ref)
(the KL penalty of InstructGPT). A linear value head on the policy's final hidden states
estimates V; advantages come from GAE (gamma, lam), whitened over the batch, and the loss is the
clipped policy objective plus vf_coef times the clipped value loss. The value head is saved in
every checkpoint (value_head.safetensors) and restored on resume.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.nn as nn

from erniekit.rl.advantages import gae
from erniekit.rl.losses import aggregate, clipped_surrogate, clipped_value_loss
from erniekit.train.rl_stage import RLStage
from erniekit.train.stage import LossOutput, Supports
from erniekit.train.stages import register_stage

VALUE_HEAD_NAME = "value_head.safetensors"


class ValueHead(nn.Layer):
    """V(s_t) = w . h_t + b on the final hidden state; zero-initialised, so the first advantages are
    the discounted rewards themselves."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = self.create_parameter(
            [hidden_size, 1], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )
        self.bias = self.create_parameter([1], dtype="float32", default_initializer=nn.initializer.Constant(0.0))

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        return (paddle.matmul(h.astype("float32"), self.weight) + self.bias).squeeze(-1)


@register_stage
class PPOStage(RLStage):
    name = "PPO"
    supports = Supports(rollouts=True)

    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)
        self.value_head = ValueHead(model.config.hidden_size)

    def extra_named_parameters(self):
        return [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]

    def checkpoint_tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        return {VALUE_HEAD_NAME: dict(self.value_head.state_dict())}

    def load_checkpoint_tensors(self, path: str) -> None:
        file = os.path.join(path, VALUE_HEAD_NAME)
        if os.path.isfile(file):
            from erniekit.utils.io import load_safetensors

            self.value_head.set_state_dict(load_safetensors(file))

    def build_advantages(self, model, batch, ro, rewards) -> None:
        cfg = self.cfg
        sc = self.score(model, batch, with_hidden=True)
        with paddle.no_grad():
            values = self.value_head(sc.hidden).numpy()
        mask = batch["completion_mask"]
        tok_rewards = np.zeros_like(mask, dtype=np.float64)
        if self.reference is not None:
            kl = (sc.logp - self.reference_logps(model, batch)) * mask  # k1 per token, as InstructGPT
            tok_rewards -= cfg.beta * kl
            self._rollout_metrics.setdefault("kl", []).append(float(kl.sum() / max(mask.sum(), 1)))
        last = np.maximum(mask.sum(1).astype(np.int64) - 1, 0)
        tok_rewards[np.arange(len(rewards)), last] += rewards * (mask.sum(1) > 0)
        adv, returns = gae(tok_rewards, values, mask, cfg.gamma, cfg.lam)
        valid = mask > 0
        if valid.sum() > 1:  # whiten over the batch's tokens
            a = adv[valid]
            adv = np.where(valid, (adv - a.mean()) / (a.std() + 1e-8), 0.0)
        batch.update(
            advantages=adv.astype(np.float32),
            returns=returns.astype(np.float32),
            old_values=(values * mask).astype(np.float32),
            old_logp=sc.logp,
        )
        self._rollout_metrics.setdefault("value", []).append(float((values * mask).sum() / max(mask.sum(), 1)))

    def loss(self, model, batch) -> LossOutput:
        cfg = self.cfg
        out, logp = self.policy_forward(model, batch)
        mask = paddle.to_tensor(batch["loss_mask"])
        eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        pg, ratio, clipped = clipped_surrogate(
            logp, paddle.to_tensor(batch["old_logp"]), paddle.to_tensor(batch["advantages"]), cfg.epsilon, eps_high
        )
        values = self.value_head(out.hidden_states)
        vloss = clipped_value_loss(
            values, paddle.to_tensor(batch["old_values"]), paddle.to_tensor(batch["returns"]), cfg.cliprange_value
        )
        n = float(batch["loss_mask"].sum())
        self._stat("clip_fraction", float((clipped * mask).sum()), n)
        self._stat("value_loss", float((vloss.detach() * mask).sum()), n)
        return LossOutput(aggregate(pg + cfg.vf_coef * vloss, mask, cfg.loss_aggregation), out.aux_loss)
