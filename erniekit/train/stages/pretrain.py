"""stage: pretrain — causal LM on raw text, packed into max_seq_len rows with per-document
attention isolation (position ids restart and attention stops at document boundaries)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from erniekit.data.encode import PackedDocuments, encode_pretrain_array
from erniekit.data.formats import iter_pretrain_texts
from erniekit.data.token_store import corpus_fingerprint, open_or_build
from erniekit.errors import DataError, ErniekitError
from erniekit.train.stage import LM, Stage
from erniekit.train.stages import register_stage
from erniekit.utils import run_control  # read at call time: a test may replace stop_signal

STOP_POLL_DOCS = 256


def _documents(path: str, tokenizer) -> Iterator[np.ndarray]:
    """Each document's int32 ids (eos included), read and tokenized one at a time: the corpus' text
    is never held whole, and a long document is tokenized in pieces. A stop request (SIGTERM) ends
    the tokenizing of a large corpus within STOP_POLL_DOCS documents instead of after it."""
    for i, text in enumerate(iter_pretrain_texts(path)):
        if i % STOP_POLL_DOCS == 0 and run_control.stop_signal():
            raise ErniekitError(f"{path}: stopped while tokenizing document {i + 1}")
        yield encode_pretrain_array(text, tokenizer)


@register_stage
class PretrainStage(Stage):
    name = "pretrain"
    aliases = ("PT",)
    supports = LM

    def _rows(self, path: str, cfg, tokenizer, split: str):
        """Packed rows of the corpus at `path`, built on demand (PackedDocuments) over its ids: 4 bytes a
        token in memory, or memory-mapped from the token store in tokenized_path/<split> (built there on
        the first run by one process, erniekit/data/token_store.py)."""
        pad = tokenizer.pad_token_id
        if cfg.tokenized_path:
            want = corpus_fingerprint(path, tokenizer)
            store = open_or_build(os.path.join(cfg.tokenized_path, split), want, lambda: _documents(path, tokenizer))
            rows = PackedDocuments.from_arrays(store.tokens, store.doc_offsets, cfg.max_seq_len, pad_id=pad)
        else:
            rows = PackedDocuments(_documents(path, tokenizer), cfg.max_seq_len, pad_id=pad)
        if rows.longest_doc < 2:  # every document empty: only its end token, nothing to predict
            raise DataError(
                f"{path}: all {rows.num_docs} documents are empty (no token to train on); check the text field"
            )
        return rows

    def build_train_rows(self, cfg, tokenizer):
        return self._rows(cfg.train_dataset_path, cfg, tokenizer, "train")

    def build_eval_data(self, cfg, tokenizer):
        return self._rows(cfg.eval_dataset_path, cfg, tokenizer, "eval") if cfg.eval_dataset_path else None

    def evaluate(self, model, tokenizer, eval_data, cfg):
        return self.eval_lm_loss(model, eval_data, cfg, tokenizer)
