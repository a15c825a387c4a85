"""stage: SFT (fine_tuning: Full) — loss on assistant replies only, multi-turn, optional packing.

Evaluation: held-out loss, and exact match of greedy generations against the reference reply
(the training format is the chat template, so what is measured is what `erniekit chat` does);
for tool conversations, tool-call exact match and final-answer accuracy of agent round trips
(erniekit/train/tool_eval.py).

Control attributes the run trains on (with those its starting model recorded) are saved beside the
weights, in every checkpoint and the final model, as control_attributes.json (docs/control.md).
"""

from __future__ import annotations

from erniekit.data.control import (
    count_controls,
    drop_controls,
    merge_records,
)
from erniekit.data.encode import encode_kept_conversations, pack
from erniekit.data.formats import Conversation, load_sft_examples
from erniekit.train.evaluation import baseline_exact_match, exact_match_eval, majority_reply
from erniekit.train.stage import LM, Stage
from erniekit.train.stages import register_stage


def _rows(convs: list[Conversation], cfg, tokenizer, packing: bool, path: str):
    return _kept_rows(convs, cfg, tokenizer, packing, path)[0]


def _kept_rows(convs: list[Conversation], cfg, tokenizer, packing: bool, path: str) -> tuple[list[dict], list[int]]:
    """The rows of `convs`, and the indices of the conversations they hold (too long or with nothing
    to train on: dropped)."""
    pairs, kept = encode_kept_conversations(
        convs, tokenizer, cfg.max_seq_len, cfg.truncation, cfg.train_on_reasoning, path
    )
    if packing:
        return pack(pairs, cfg.max_seq_len, pad_id=tokenizer.pad_token_id), kept
    import numpy as np

    return [{"input_ids": np.asarray(i, np.int64), "labels": np.asarray(l, np.int64)} for i, l in pairs], kept


@register_stage
class SFTStage(Stage):
    name = "SFT"
    supports = LM

    credibility = None  # erniekit/train/credibility.py, with credibility_loss_weight > 0

    def build_train_rows(self, cfg, tokenizer):
        loaded = load_sft_examples(cfg.train_dataset_path, cfg.train_dataset_type)
        convs = drop_controls(loaded, cfg.control_drop_prob, cfg.seed)  # docs/control.md
        self.majority_reply = majority_reply(convs)
        self.train_convs = convs
        rows, kept = _kept_rows(convs, cfg, tokenizer, cfg.packing, cfg.train_dataset_path)
        # the conversations trained on, their attributes as the data has them (one dropped from a record
        # by control_drop_prob is trained on others); a conversation left with nothing to train is not
        trained = count_controls(loaded[i].control for i in kept)
        self.control_record = merge_records(self.starting_control_record(cfg), trained)
        return rows

    # ---- the credibility loss (docs/control.md): a scoring head beside the model ----------------------
    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)  # do_train=false: the given model's record
        if cfg.credibility_loss_weight > 0 and cfg.do_train:
            from erniekit.train.credibility import CredibilityTraining

            self.credibility = CredibilityTraining(cfg, model, tokenizer, self.train_convs)

    def step_batches(self, model, micro, step):
        if self.credibility is not None:
            self.credibility.attach(model, micro, step, sum(self.normalizer(b) for b in micro))
        return micro

    def loss(self, model, batch):
        extra = None if self.credibility is None else self.credibility.loss_sum(model, batch)  # before the LM pass
        out = super().loss(model, batch)
        if extra is not None:
            out.loss_sum = out.loss_sum + extra
        return out

    def step_metrics(self):
        return {} if self.credibility is None else self.credibility.metrics()

    def extra_named_parameters(self):
        return [] if self.credibility is None else self.credibility.named_parameters()

    def checkpoint_tensors(self):
        return self._credibility_tensors()

    def load_checkpoint_tensors(self, path: str) -> None:
        if self.credibility is not None:
            self.credibility.load(path)

    def model_tensors(self):
        return self._credibility_tensors()

    def _credibility_tensors(self):
        return {} if self.credibility is None else self.credibility.tensors()

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        convs = load_sft_examples(cfg.eval_dataset_path, cfg.eval_dataset_type)
        if cfg.eval_generation:  # the examples evaluate() generates for (a loss is a loss)
            dialogs = [c for c in convs if c.dialog is not None]
            self.check_held_out_controls((dialogs or convs)[: cfg.eval_max_samples], cfg)
        return {"convs": convs, "rows": _rows(convs, cfg, tokenizer, False, cfg.eval_dataset_path)}

    def evaluate(self, model, tokenizer, eval_data, cfg):
        res = self.eval_lm_loss(model, eval_data["rows"], cfg, tokenizer)
        if cfg.eval_generation and any(c.dialog is not None for c in eval_data["convs"]):
            from erniekit.train.tool_eval import tool_eval

            convs = [c for c in eval_data["convs"] if c.dialog is not None][: cfg.eval_max_samples]
            res.update(tool_eval(model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens))
        elif cfg.eval_generation:
            convs = eval_data["convs"][: cfg.eval_max_samples]
            if any(c.control for c in convs):  # exact match and the control-following rates
                from erniekit.train.control_eval import control_generation_eval

                res.update(
                    control_generation_eval(
                        model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
                    )
                )
            else:
                res["exact_match"] = exact_match_eval(
                    model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
                )
            majority = getattr(self, "majority_reply", None)
            if majority is not None:
                res["baseline_exact_match"] = baseline_exact_match(convs, majority)
        if self.credibility is not None:
            res.update(self.credibility.evaluate(model, eval_data["convs"], cfg.eval_max_samples))
        return res
