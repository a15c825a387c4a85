"""stage: pretrain — causal LM on raw text, packed into max_seq_len rows with per-document
attention isolation (position ids restart and attention stops at document boundaries)."""

from __future__ import annotations

from erniekit.data.encode import PackedDocuments, encode_pretrain_array
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
        """Packed rows of the corpus at `path`, built on demand (PackedDocuments): the ids take 4 bytes
        a token, each text is dropped once tokenized, and a long document is tokenized in pieces."""
        texts = load_pretrain_texts(path)

        def docs():
            for i in range(len(texts)):
                text, texts[i] = texts[i], ""
                yield encode_pretrain_array(text, tokenizer)

        rows = PackedDocuments(docs(), cfg.max_seq_len, pad_id=tokenizer.pad_token_id)
        if rows.longest_doc < 2:  # every document empty: only its end token, nothing to predict
            raise DataError(
                f"{path}: all {rows.num_docs} documents are empty (no token to train on); check the text field"
            )
        return rows

    def build_train_rows(self, cfg, tokenizer):
        return self._rows(cfg.train_dataset_path, cfg, tokenizer)

    def build_eval_data(self, cfg, tokenizer):
        return self._rows(cfg.eval_dataset_path, cfg, tokenizer) if cfg.eval_dataset_path else None

    def evaluate(self, model, tokenizer, eval_data, cfg):
        return self.eval_lm_loss(model, eval_data, cfg, tokenizer)
