"""stage: SFT (fine_tuning: Full) — loss on assistant replies only, multi-turn, optional packing.

Evaluation: held-out loss, and exact match of greedy generations against the reference reply
(the training format is the chat template, so what is measured is what `erniekit chat` does);
for tool conversations, tool-call exact match and final-answer accuracy of agent round trips
(erniekit/train/tool_eval.py).
"""

from __future__ import annotations

from erniekit.data.encode import encode_conversations, pack
from erniekit.data.formats import Conversation, load_sft_examples
from erniekit.train.evaluation import baseline_exact_match, exact_match_eval, majority_reply
from erniekit.train.stage import LM, Stage, eval_loss
from erniekit.train.stages import register_stage


def _rows(convs: list[Conversation], cfg, tokenizer, packing: bool):
    pairs = encode_conversations(convs, tokenizer, cfg.max_seq_len, cfg.truncation, cfg.train_on_reasoning)
    if packing:
        return pack(pairs, cfg.max_seq_len, pad_id=tokenizer.pad_token_id)
    import numpy as np

    return [{"input_ids": np.asarray(i, np.int64), "labels": np.asarray(l, np.int64)} for i, l in pairs]


@register_stage
class SFTStage(Stage):
    name = "SFT"
    supports = LM

    def build_train_rows(self, cfg, tokenizer):
        convs = load_sft_examples(cfg.train_dataset_path, cfg.train_dataset_type)
        self.majority_reply = majority_reply(convs)
        return _rows(convs, cfg, tokenizer, cfg.packing)

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        convs = load_sft_examples(cfg.eval_dataset_path, cfg.eval_dataset_type)
        return {"convs": convs, "rows": _rows(convs, cfg, tokenizer, packing=False)}

    def evaluate(self, model, tokenizer, eval_data, cfg):
        res = eval_loss(model, eval_data["rows"], cfg.per_device_eval_batch_size, tokenizer.pad_token_id)
        if cfg.eval_generation and any(c.dialog is not None for c in eval_data["convs"]):
            from erniekit.train.tool_eval import tool_eval

            convs = [c for c in eval_data["convs"] if c.dialog is not None][: cfg.eval_max_samples]
            res.update(tool_eval(model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens))
        elif cfg.eval_generation:
            convs = eval_data["convs"][: cfg.eval_max_samples]
            res["exact_match"] = exact_match_eval(
                model, tokenizer, convs, cfg.per_device_eval_batch_size, cfg.eval_max_new_tokens
            )
            majority = getattr(self, "majority_reply", None)
            if majority is not None:
                res["baseline_exact_match"] = baseline_exact_match(convs, majority)
        return res
