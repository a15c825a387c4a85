"""stage: DPO — preference optimisation (sigmoid/DPO, hinge, ipo, simpo, orpo, kto_pair,
sppo_hard, nca_pair, dpop; see docs/dpo.md for each formula).

The reference model's log-probabilities are computed once, in `prepare`, while the model still
holds the starting weights (with LoRA the adapters start at zero, so that is the base): no
second copy of the model is kept in memory, and a resumed run reuses the same reference values.
"""

from __future__ import annotations

import numpy as np
import paddle

from erniekit.data.encode import pad_batch
from erniekit.data.formats import Conversation
from erniekit.data.preference import encode_preference_pairs, load_preference_pairs
from erniekit.train.evaluation import exact_match_eval
from erniekit.train.preference_losses import needs_reference, preference_loss, sequence_logps
from erniekit.train.stage import LossOutput, Stage, Supports, model_inputs
from erniekit.train.stages import register_stage


def _rows(pairs, cfg, tokenizer):
    enc = encode_preference_pairs(pairs, tokenizer, cfg.max_seq_len, cfg.truncation)
    return [{k: np.asarray(v, np.int64) for k, v in e.items() if k.startswith(("chosen", "rejected"))} for e in enc]


def collate_pairs(rows, pad_id: int) -> dict[str, np.ndarray]:
    """Chosen sequences first, then rejected: one forward pass scores both halves."""
    seqs = [(r["chosen_ids"], r["chosen_labels"]) for r in rows] + [
        (r["rejected_ids"], r["rejected_labels"]) for r in rows
    ]
    batch = pad_batch(seqs, pad_id=pad_id)
    for key in ("ref_chosen", "ref_rejected"):
        if key in rows[0]:
            batch[key] = np.array([r[key] for r in rows], np.float32)
    batch["n_pairs"] = np.array(len(rows))
    return batch


@paddle.no_grad()
def _score(model, rows, batch_size: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probs of chosen and rejected replies under `model` (eval mode)."""
    was_training = model.training
    model.eval()
    ch, rj = [], []
    for i in range(0, len(rows), batch_size):
        b = collate_pairs(rows[i : i + batch_size], pad_id)
        logps, _ = sequence_logps(model(**model_inputs(b)).logits, b["labels"])
        n = int(b["n_pairs"])
        ch.append(logps[:n].numpy())
        rj.append(logps[n:].numpy())
    if was_training:
        model.train()
    return np.concatenate(ch), np.concatenate(rj)


@register_stage
class DPOStage(Stage):
    name = "DPO"
    supports = Supports(elastic=True)

    def build_train_rows(self, cfg, tokenizer):
        return _rows(load_preference_pairs(cfg.train_dataset_path, cfg.train_dataset_type), cfg, tokenizer)

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        pairs = load_preference_pairs(cfg.eval_dataset_path, cfg.eval_dataset_type)
        return {"pairs": pairs, "rows": _rows(pairs, cfg, tokenizer)}

    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)  # the control record goes on (docs/control.md)
        self.cfg = cfg
        groups = [train_rows] + ([eval_data["rows"]] if eval_data else [])
        if not needs_reference(cfg.loss_type, cfg.reference_free) and not eval_data:
            return
        for rows in groups:  # eval rows always get reference values: rewards are reported against them
            if not rows:
                continue
            ch, rj = _score(model, rows, cfg.per_device_eval_batch_size, tokenizer.pad_token_id)
            for r, c, j in zip(rows, ch, rj):
                r["ref_chosen"], r["ref_rejected"] = float(c), float(j)

    def collate(self, rows, pad_id):
        return collate_pairs(rows, pad_id)

    def normalizer(self, batch) -> int:
        return int(batch["n_pairs"])

    def _pair_terms(self, model, batch):
        cfg = self.cfg
        out = model(**model_inputs(batch))
        logps, ntok = sequence_logps(out.logits, batch["labels"])
        n = int(batch["n_pairs"])
        pc, pr = logps[:n], logps[n:]
        lc, lr = ntok[:n], ntok[n:]
        use_ref = needs_reference(cfg.loss_type, cfg.reference_free)
        rc = paddle.to_tensor(batch["ref_chosen"]) if use_ref else None
        rr = paddle.to_tensor(batch["ref_rejected"]) if use_ref else None
        losses, rw_c, rw_r = preference_loss(
            cfg.loss_type,
            pc,
            pr,
            rc,
            rr,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            reference_free=cfg.reference_free,
            chosen_lengths=lc,
            rejected_lengths=lr,
            simpo_gamma=cfg.simpo_gamma,
            dpop_lambda=cfg.dpop_lambda,
        )
        return out, losses, rw_c, rw_r, pc, pr, lc

    def loss(self, model, batch) -> LossOutput:
        cfg = self.cfg
        out, losses, rw_c, rw_r, pc, _, lc = self._pair_terms(model, batch)
        total = losses.sum()
        sft_ratio = cfg.sft_loss_ratio + (1.0 if cfg.loss_type == "orpo" else 0.0)  # ORPO = NLL + odds-ratio term
        if sft_ratio > 0:
            total = total + sft_ratio * (-(pc / paddle.clip(lc.astype(pc.dtype), min=1))).sum()
        margin = (rw_c - rw_r).numpy()
        metrics = {
            "rewards/chosen": float(rw_c.sum()),
            "rewards/rejected": float(rw_r.sum()),
            "rewards/margins": float(margin.sum()),
            "rewards/accuracies": float((margin > 0).sum()),
        }
        return LossOutput(total, out.aux_loss, metrics)

    @paddle.no_grad()
    def evaluate(self, model, tokenizer, eval_data, cfg):
        model.eval()
        rows = eval_data["rows"]
        acc = pref = marg = loss = 0.0
        for i in range(0, len(rows), cfg.per_device_eval_batch_size):
            b = collate_pairs(rows[i : i + cfg.per_device_eval_batch_size], tokenizer.pad_token_id)
            if "ref_chosen" not in b:
                b["ref_chosen"] = b["ref_rejected"] = np.zeros(int(b["n_pairs"]), np.float32)
            _, losses, rw_c, rw_r, pc, pr, _ = self._pair_terms(model, b)
            m = (rw_c - rw_r).numpy()
            acc += float((m > 0).sum())
            pref += float((pc > pr).astype("float32").sum())
            marg += float(m.sum())
            loss += float(losses.sum())
        n = max(len(rows), 1)
        # preference_accuracy: the policy itself ranks chosen above rejected (summed log-probs), a
        # figure that also means something for the starting model; reward_accuracy: TRL's
        # rewards/accuracies (implicit reward margin > 0, always 0 for the reference itself)
        res = {"loss": loss / n, "preference_accuracy": pref / n, "reward_accuracy": acc / n, "reward_margin": marg / n}
        if cfg.eval_generation:
            convs = [
                Conversation(p.system, p.history + [(p.prompt, p.chosen)], [False] * len(p.history) + [True], p.source)
                for p in eval_data["pairs"][: cfg.eval_max_samples]
            ]
            res["exact_match"] = exact_match_eval(
                model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
            )
        return res
