"""stage: pretrain — causal LM on raw text, packed into max_seq_len rows with per-document
attention isolation (position ids restart and attention stops at document boundaries)."""

from __future__ import annotations

from erniekit.data.encode import IGNORE_INDEX, encode_pretrain, pack
from erniekit.data.formats import load_pretrain_texts
from erniekit.errors import DataError
from erniekit.train.stage import LM, Stage
from erniekit.train.stages import register_stage


@register_stage
class PretrainStage(Stage):
    name = "pretrain"
    aliases = ("PT",)
    supports = LM

    def _rows(self, path: str, cfg, tokenizer):
        docs = [encode_pretrain(t, tokenizer) for t in load_pretrain_texts(path)]
        rows = pack([(d, d) for d in docs], cfg.max_seq_len, pad_id=tokenizer.pad_token_id)
        if not rows:
            raise DataError(f"{path}: no tokens after encoding; check the text field")
        if not any((r["labels"] != IGNORE_INDEX).any() for r in rows):  # every document empty: only its end token
            raise DataError(f"{path}: all {len(docs)} documents are empty (no token to train on); check the text field")
        return rows

    def build_train_rows(self, cfg, tokenizer):
        return self._rows(cfg.train_dataset_path, cfg, tokenizer)

    def build_eval_data(self, cfg, tokenizer):
        return self._rows(cfg.eval_dataset_path, cfg, tokenizer) if cfg.eval_dataset_path else None

    def evaluate(self, model, tokenizer, eval_data, cfg):
        return self.eval_lm_loss(model, eval_data, cfg, tokenizer)
