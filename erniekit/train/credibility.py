"""The credibility loss of SFT (ERNIE 3.0 Titan's self-supervised adversarial loss; docs/control.md).

Every `credibility_every`-th step, `credibility_batch_size` training conversations (drawn from the
seed and the step, so a resumed run draws the same) get a reply sampled by the model being trained,
at `credibility_temperature`. The step's loss then adds

    credibility_loss_weight * mean_i BCE(head(h_i), y_i)

over the real replies (y = 1) and the sampled ones (y = 0; a sample equal to its real reply is left
out), h_i the final hidden state at the reply's end-of-turn token (erniekit/nn/credibility.py). The
gradient reaches the head and the model: the model learns features that tell its own text from the
data's. The head is saved in every checkpoint and next to the final model.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from erniekit.data.formats import Conversation
from erniekit.infer.credibility import credibility_report, prompt_sequence, reply_sequence, sample_replies
from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, CredibilityHead, sequence_logits
from erniekit.utils.dtensor import scalar

BATCH_KEY = "credibility"  # what step_batches adds to a step's first micro-batch


def bce_with_logits_mean(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """mean_i [ -y_i log sigmoid(z_i) - (1 - y_i) log sigmoid(-z_i) ], in the stable softplus form."""
    return (F.softplus(logits) - labels * logits).mean()


class CredibilityTraining:
    """The head, its training pool and its step: what the SFT stage delegates to."""

    def __init__(self, cfg, model, tokenizer, convs: list[Conversation]):
        self.cfg, self.tokenizer = cfg.control, tokenizer
        self.seed = cfg.seed
        self.eval_batch = cfg.per_device_eval_batch_size
        self.pool = [c for c in convs if c.dialog is None]
        if not self.pool:
            from erniekit.errors import DataError

            raise DataError(
                f"credibility_loss_weight > 0 needs plain conversations in {cfg.train_dataset_path}; "
                "tool dialogs are not scored: set credibility_loss_weight=0"
            )
        self.head = CredibilityHead(model.config.hidden_size)
        self._metrics: dict[str, float] = {}

    # ---- stage hooks ---------------------------------------------------------------------------
    def attach(self, model, micro: list[dict], step: int, units: int) -> None:
        """On a credibility step: sample replies for a drawn set of conversations and put their
        sequences on the first micro-batch; `units` is the step's loss normalizer (so the term adds
        exactly weight x mean BCE to the step's loss)."""
        self._metrics = {}
        if (step + 1) % self.cfg.credibility_every:  # steps every, 2 every, ...: logged steps (multiples) have it
            return
        rng = np.random.default_rng([self.seed, step, 0xC4ED])
        k = min(self.cfg.credibility_batch_size, len(self.pool))
        convs = [self.pool[i] for i in rng.choice(len(self.pool), size=k, replace=False)]
        prompts = [prompt_sequence(c, self.tokenizer) for c in convs]
        sampled = sample_replies(
            model,
            self.tokenizer,
            prompts,
            self.cfg.credibility_temperature,
            self.cfg.credibility_max_new_tokens,
            batch_size=k,
        )
        seqs, labels = [], []
        for c, s in zip(convs, sampled):
            real = c.turns[-1][1].strip()
            seqs.append(reply_sequence(c, real, self.tokenizer))
            labels.append(1.0)
            if s != real:  # the same text under both labels teaches nothing
                seqs.append(reply_sequence(c, s, self.tokenizer))
                labels.append(0.0)
        micro[0][BATCH_KEY] = {"sequences": seqs, "labels": np.asarray(labels, np.float32), "units": max(units, 1)}

    def loss_sum(self, model, batch: dict) -> paddle.Tensor | None:
        """weight x mean BCE x units (the loop divides the step's loss sum by its units), or None."""
        part = batch.get(BATCH_KEY)
        if part is None:
            return None
        logits = sequence_logits(model, self.head, part["sequences"], self.tokenizer.pad_token_id or 0)
        labels = paddle.to_tensor(part["labels"])
        bce = bce_with_logits_mean(logits, labels)
        with paddle.no_grad():
            right = ((logits > 0).astype("float32") == labels).astype("float32").mean()
        self._metrics = {
            "credibility_loss": scalar(bce),
            "credibility_accuracy": scalar(right),
            "credibility_sampled": float((part["labels"] == 0).sum()),
        }
        return bce * (self.cfg.credibility_loss_weight * part["units"])

    def metrics(self) -> dict[str, float]:
        return {f"train/{k}": v for k, v in self._metrics.items()}

    def named_parameters(self) -> list[tuple[str, paddle.Tensor]]:
        return [(f"credibility_head.{n}", p) for n, p in self.head.named_parameters()]

    def tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        return {CREDIBILITY_HEAD_NAME: dict(self.head.state_dict())}

    def load(self, path: str) -> None:
        import os

        file = os.path.join(path, CREDIBILITY_HEAD_NAME)
        if os.path.isfile(file):
            from erniekit.utils.io import load_safetensors

            self.head.set_state_dict(load_safetensors(file))

    def evaluate(self, model, convs: list[Conversation], max_samples: int) -> dict[str, float]:
        """Held-out AUC of real vs sampled replies (sampled at the training temperature, fixed seed);
        nothing when the held-out data has no plain conversation (tool dialogs are not scored)."""
        plain = [c for c in convs if c.dialog is None][:max_samples]
        if not plain:
            return {}
        rep = credibility_report(
            model,
            self.head,
            self.tokenizer,
            plain,
            self.eval_batch,
            self.cfg.credibility_max_new_tokens,
            self.cfg.credibility_temperature,
            seed=self.seed,
        )
        return {
            "credibility_auc": rep["auc"],
            "credibility_real_mean": rep["real"].get("mean", float("nan")),
            "credibility_generated_mean": rep["generated"].get("mean", float("nan")),
            "credibility_identical": float(rep["identical"]),
        }
