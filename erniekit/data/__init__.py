"""Datasets: format readers, encoding/packing, synthetic tasks."""

from erniekit.data.encode import (
    IGNORE_INDEX,
    encode_conversation,
    encode_conversations,
    encode_pretrain,
    pack,
    pad_batch,
)
from erniekit.data.formats import Conversation, detect_format, load_pretrain_texts, load_sft_examples
from erniekit.data.synthetic import exact_match, make_arithmetic, split_heldout, write_arithmetic_dataset

__all__ = [
    "IGNORE_INDEX",
    "Conversation",
    "detect_format",
    "encode_conversation",
    "encode_conversations",
    "encode_pretrain",
    "exact_match",
    "load_pretrain_texts",
    "load_sft_examples",
    "make_arithmetic",
    "pack",
    "pad_batch",
    "split_heldout",
    "write_arithmetic_dataset",
]
