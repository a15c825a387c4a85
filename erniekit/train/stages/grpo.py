"""stage: GRPO — group-relative policy optimisation with verifiable rewards (docs/rl.md).

Each prompt gets `num_generations` samples; a sample's advantage is its reward relative to its
group (mean, and std unless scale_rewards=false). The loss is the clipped importance-ratio
objective (epsilon, epsilon_high) plus beta * k3 KL to the frozen reference, aggregated per
token or per sequence (loss_aggregation). Groups whose rewards are all equal carry no signal;
filter_zero_std_groups=true also removes them from the normaliser.
"""

from __future__ import annotations

import numpy as np
import paddle

from erniekit.rl.advantages import group_advantages
from erniekit.rl.losses import aggregate, clipped_surrogate, k3_kl
from erniekit.train.rl_stage import RLStage
from erniekit.train.stage import LossOutput, Supports
from erniekit.train.stages import register_stage


@register_stage
class GRPOStage(RLStage):
    name = "GRPO"
    supports = Supports(rollouts=True, min_generations=2)

    def build_advantages(self, model, batch, ro, rewards) -> None:
        cfg = self.cfg
        adv, std = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        batch["advantages"] = adv.astype(np.float32)[:, None]
        zero = std == 0
        self._rollout_metrics.setdefault("zero_std_group_fraction", []).append(float(zero.mean()))
        if cfg.filter_zero_std_groups:
            batch["loss_mask"][zero] = 0.0
        if cfg.num_iterations > 1:  # later iterations need the sampling policy's log-probs
            batch["old_logp"] = self.score(model, batch).logp
        if self.reference is not None:
            batch["ref_logp"] = self.reference_logps(model, batch)

    def loss(self, model, batch) -> LossOutput:
        cfg = self.cfg
        out, logp = self.policy_forward(model, batch)
        mask = paddle.to_tensor(batch["loss_mask"])
        old = paddle.to_tensor(batch["old_logp"]) if "old_logp" in batch else logp.detach()
        eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        per_token, ratio, clipped = clipped_surrogate(
            logp, old, paddle.to_tensor(batch["advantages"]), cfg.epsilon, eps_high
        )
        n = float(batch["loss_mask"].sum())
        if "ref_logp" in batch:
            kl = k3_kl(logp, paddle.to_tensor(batch["ref_logp"]))
            per_token = per_token + cfg.beta * kl
            self._stat("kl", float((kl.detach() * mask).sum()), n)
        self._stat("clip_fraction", float((clipped * mask).sum()), n)
        self._stat("ratio", float((ratio.detach() * mask).sum()), n)
        return LossOutput(aggregate(per_token, mask, cfg.loss_aggregation), out.aux_loss)
