"""What `erniekit eval --routing` feeds the model: the first N examples of a dataset, read a record
at a time (erniekit.data.formats.iter_records / iter_pretrain_texts), encoded as training encodes
them (chat template for SFT data, text + eos for pretraining data) and cut into pieces of at most
max_seq_len tokens. Memory holds one example and one window of pieces, never the dataset."""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np

from erniekit.errors import DataError

SFT_KEYS = ("src", "tgt", "messages", "instruction")


def _is_text_file(path: str) -> bool:
    """Pretraining text (plain lines, {"text": ...} records or a dataset_info.json entry) rather than
    conversations; only the first record is read."""
    if not path.endswith((".jsonl", ".json")):
        return True
    if os.path.exists(path) and not os.path.isfile(path):  # read twice below: a pipe gives its data once
        raise DataError(
            f"{path}: not a regular file (a pipe?); the routing report reads a JSON file twice (its kind, "
            "then its examples): write it to a file first"
        )
    from erniekit.data.formats import iter_records

    first = next(iter_records(path), (0, None))[1]
    return isinstance(first, dict) and "text" in first and not any(k in first for k in SFT_KEYS)


def iter_documents(data_path: str, tokenizer: Any) -> Iterator[tuple[np.ndarray, bool]]:
    """(token ids, is pretraining text) of each example of the comma-separated files, in order."""
    from erniekit.data.encode import encode_conversation, encode_pretrain_array
    from erniekit.data.formats import iter_pretrain_texts, iter_sft_examples, split_paths

    for path in split_paths(data_path):
        if _is_text_file(path):
            for text in iter_pretrain_texts(path):
                yield encode_pretrain_array(text, tokenizer), True
        else:
            for conv in iter_sft_examples(path):
                yield np.asarray(encode_conversation(conv, tokenizer, 10**9)[0], dtype=np.int64), False


class RoutingData:
    """The pieces of the first `max_samples` examples (all with None), iterated once; afterwards it
    says how many examples, pieces and tokens there were. Nothing past the last example used is read."""

    def __init__(self, data_path: str, tokenizer: Any, max_seq_len: int, max_samples: int | None = None):
        if max_seq_len < 1 or (max_samples is not None and max_samples < 1):
            raise DataError(f"max_seq_len={max_seq_len}, max_samples={max_samples}: both must be positive")
        self.data_path, self.tokenizer = data_path, tokenizer
        self.max_seq_len, self.max_samples = max_seq_len, max_samples
        self.examples = self.sequences = self.tokens = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        docs = iter_documents(self.data_path, self.tokenizer)
        texts = empty_texts = 0
        for ids, is_text in islice(docs, self.max_samples):
            self.examples += 1
            texts += is_text
            empty_texts += is_text and len(ids) < 2  # only the end token: the text was empty
            for s in range(0, len(ids), self.max_seq_len):
                piece = ids[s : s + self.max_seq_len].copy()  # not a view: a window never holds whole documents
                self.sequences += 1
                self.tokens += len(piece)
                yield piece
        docs.close()
        self._check(texts, empty_texts)

    @property
    def capped(self) -> bool:
        """Whether max_samples examples were read (the data may have more)."""
        return self.max_samples is not None and self.examples == self.max_samples

    def _check(self, texts: int, empty_texts: int) -> None:
        """As the pretrain stage: texts that are all empty leave only their end tokens, a report on nothing."""
        if self.examples and empty_texts == self.examples:
            raise DataError(
                f"{self.data_path}: all {texts} documents are empty (only their end tokens would be routed); "
                "check the text field"
            )
