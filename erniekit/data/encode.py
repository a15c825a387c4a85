"""Turn conversations and documents into token ids, loss labels and packed rows.

Labels are NOT pre-shifted: ``labels[t]`` is the token at position t (or -100 when that
token is not trained). The loss compares ``logits[:, t]`` with ``labels[:, t + 1]`` (the
causal shift happens inside the loss).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Sequence, overload

import numpy as np

from erniekit.data.formats import Conversation
from erniekit.errors import DataError

if TYPE_CHECKING:  # importing the model package would pull in paddle
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

IGNORE_INDEX = -100


def _render_pieces(conv: Conversation, tokenizer: ErnieTokenizer) -> list[tuple[str, bool]]:
    """Split the chat-template rendering of ``conv`` into (text, trained) chunks.

    Uses the tokenizer's own template: the chunk before assistant message k is what
    ``apply_chat_template(messages[:k], add_generation_prompt=True)`` adds, and the trained chunk
    is what assistant message k adds after it (reply + sep for ERNIE; reasoning, answer or tool
    calls + <|im_end|> for the thinking format).
    """
    msgs = conv.messages()
    tools = conv.tools or None
    replies = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    flags = [True] * len(replies) if conv.dialog is not None else conv.train_on
    pieces, done = [], ""
    for k, train in zip(replies, flags):
        prompt = tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True, tools=tools)
        full = tokenizer.apply_chat_template(msgs[: k + 1], add_generation_prompt=False, tools=tools)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError(
                f"{conv.source or 'conversation'}: the chat template does not render turns as a growing prefix; "
                "use the ERNIE template or one without history-dependent output"
            )
        written = full[len(prompt) :]
        for call in msgs[k].get("tool_calls") or []:
            if call["function"]["name"] not in written:
                raise DataError(
                    f"{conv.source or 'conversation'}: the chat template drops tool calls; train tool data with "
                    "chat_template: ernie_thinking or a checkpoint whose template renders tools"
                )
        pieces += [(prompt[len(done) :], False), (written, train)]
        done = full
    return [(text, train) for text, train in pieces if text]


def _encode_full(
    conv: Conversation, tokenizer: ErnieTokenizer, train_on_reasoning: bool = True
) -> tuple[list[int], list[int]]:
    think_end = None if train_on_reasoning else _think_end_id(tokenizer, conv)
    ids: list[int] = []
    labels: list[int] = []
    for text, train in _render_pieces(conv, tokenizer):
        piece = tokenizer.encode(text)
        ids += piece
        if not train:
            labels += [IGNORE_INDEX] * len(piece)
        elif think_end is not None and think_end in piece:  # reasoning before </think> is context, not target
            cut = piece.index(think_end)
            labels += [IGNORE_INDEX] * cut + piece[cut:]
        else:
            labels += piece
    return ids, labels


def _think_end_id(tokenizer: ErnieTokenizer, conv: Conversation) -> int:
    tid = tokenizer.convert_tokens_to_ids("</think>")
    if "</think>" not in tokenizer.convert_ids_to_tokens([tid]) or not getattr(tokenizer, "thinking", False):
        raise DataError(
            f"{conv.source or 'conversation'}: train_on_reasoning: false needs a thinking chat template "
            "(</think> as a token); set chat_template: ernie_thinking"
        )
    return tid


def _too_long(conv: Conversation, n: int, max_seq_len: int, index: int | None) -> DataError:
    num = "" if index is None else f" {index}"
    return DataError(
        f"example{num} ({conv.source or 'conversation'}) has {n} tokens > max_seq_len={max_seq_len}; "
        "raise max_seq_len or set truncation='truncate'"
    )


def encode_conversation(
    conv: Conversation,
    tokenizer: ErnieTokenizer,
    max_seq_len: int,
    truncation: str = "error",
    index: int | None = None,
    train_on_reasoning: bool = True,
) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) for one conversation; labels are -100 where not trained.

    The ids are the chat-template rendering (the same text the model sees at inference)
    and the loss covers each trained reply plus its end-of-reply sep token. Each rendered
    chunk is tokenized separately, so the prompt tokens are exactly
    ``encode(apply_chat_template(history, add_generation_prompt=True))`` as at inference;
    the price is that sentencepiece cannot merge across a prompt/reply boundary, where
    encoding the whole string at once might (the decoded text is identical either way).

    truncation="error" raises DataError when too long; "truncate" cuts from the end (use
    :func:`encode_conversations` for dropping and one warning with counts).
    """
    if truncation not in ("error", "truncate"):
        raise DataError(f"truncation='{truncation}'; use 'error' or 'truncate'")
    ids, labels = _encode_full(conv, tokenizer, train_on_reasoning)
    if len(ids) > max_seq_len:
        if truncation == "error":
            raise _too_long(conv, len(ids), max_seq_len, index)
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    return ids, labels


def _sources(convs: Sequence[Conversation]) -> str:
    """The files the conversations came from (their "file:line" sources), for a message."""
    files = dict.fromkeys(c.source.rsplit(":", 1)[0] for c in convs if c.source)
    return ",".join(files) or "conversations"


def encode_conversations(*args: Any, **kwargs: Any) -> list[tuple[list[int], list[int]]]:
    """encode_kept_conversations(same arguments)'s (ids, labels) pairs."""
    return encode_kept_conversations(*args, **kwargs)[0]


def encode_kept_conversations(
    convs: Sequence[Conversation],
    tokenizer: ErnieTokenizer,
    max_seq_len: int,
    truncation: str = "error",
    train_on_reasoning: bool = True,
    where: str = "",
) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Encode many conversations: (ids, labels) pairs, and the index in `convs` of each (what is
    trained on: SFT records those conversations' control attributes). Warn once for truncated ones,
    drop those with no trained token. All of them dropped is a DataError naming `where` (the dataset
    path; default: the conversations' files) and why, here: otherwise the run fails at its first
    batch, with no word about the data."""
    if truncation not in ("error", "truncate"):
        raise DataError(f"truncation='{truncation}'; use 'error' or 'truncate'")
    out, kept, truncated, dropped, dropped_cut = [], [], 0, 0, 0
    for i, conv in enumerate(convs):
        ids, labels = _encode_full(conv, tokenizer, train_on_reasoning)
        cut = len(ids) > max_seq_len
        if cut:
            if truncation == "error":
                raise _too_long(conv, len(ids), max_seq_len, i)
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
            truncated += 1
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            dropped_cut += cut
            continue
        out.append((ids, labels))
        kept.append(i)
    if convs and not out:
        why, fix = [], []
        if dropped_cut:
            why.append(f"{dropped_cut} with a prompt longer than max_seq_len={max_seq_len}")
            fix.append("raise max_seq_len")
        if dropped > dropped_cut:
            why.append(f"{dropped - dropped_cut} with no trained reply (every label 0)")
            fix.append("check the labels")
        raise DataError(
            f"{where or _sources(convs)}: all {len(convs)} examples were dropped ({', '.join(why)}); {' or '.join(fix)}"
        )
    if truncated:
        warnings.warn(f"{truncated} of {len(convs)} conversations truncated to max_seq_len={max_seq_len}", stacklevel=2)
    if dropped:
        warnings.warn(
            f"{dropped} of {len(convs)} conversations dropped: no trained tokens left (truncated, or every label 0)",
            stacklevel=2,
        )
    return out, kept


def encode_pretrain(text: str, tokenizer: ErnieTokenizer) -> list[int]:
    """Ids of one pretraining document: no BOS, then eos ``</s>``.

    ERNIE 4.5's tokenizer adds no BOS (add_bos_token=False; chat uses the cls token instead),
    and the EOS marks where the document ends, so a packed row never runs two documents together.
    """
    return tokenizer.encode(text) + [tokenizer.eos_token_id]


PRETRAIN_PIECE_CHARS = 1 << 20  # a document is tokenized this many characters at a time


def _pieces(text: str, size: int) -> Iterable[str]:
    """`text` in pieces of about `size` characters, each cut just before a space where there is one
    in the piece's second half: sentencepiece pieces never run into a following space, so the ids equal
    those of the whole text; without a space (e.g. CJK) the cut is hard."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + size // 2, start + size)
        cut = cut if cut > start else start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_pretrain_array(text: str, tokenizer: ErnieTokenizer) -> np.ndarray:
    """encode_pretrain as an int32 array, tokenizing PRETRAIN_PIECE_CHARS at a time: a 500 MB
    one-line document would otherwise be one Python list of ~36 bytes per token."""
    if len(text) <= PRETRAIN_PIECE_CHARS:
        return np.asarray(encode_pretrain(text, tokenizer), dtype=np.int32)
    parts = [np.asarray(tokenizer.encode(p), dtype=np.int32) for p in _pieces(text, PRETRAIN_PIECE_CHARS)]
    return np.concatenate([*parts, np.asarray([tokenizer.eos_token_id], dtype=np.int32)])


def concat_documents(docs: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(int32 tokens of every document back to back, int64 offsets [docs + 1]), grown in place: the
    documents are not held twice (a list of arrays and their concatenation) nor as one object each."""
    tokens, offsets = _Growing(np.int32), _Growing(np.int64)
    offsets.extend(np.zeros(1, np.int64))
    for doc in docs:
        tokens.extend(np.asarray(doc, dtype=np.int32))
        offsets.extend(np.asarray([tokens.size], np.int64))
    return tokens.array(), offsets.array()


class _Growing:
    """An array appended to in place: capacity grows by half (realloc, no second copy on Linux)."""

    def __init__(self, dtype: type) -> None:
        self._a, self.size = np.empty(1 << 12, dtype), 0

    def extend(self, values: np.ndarray) -> None:
        need = self.size + len(values)
        if need > len(self._a):
            self._a.resize(max(need, len(self._a) * 3 // 2), refcheck=False)
        self._a[self.size : need] = values
        self.size = need

    def array(self) -> np.ndarray:
        self._a.resize(self.size, refcheck=False)
        return self._a


def chunk_starts(doc_starts: np.ndarray, lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Start offset of every max_seq_len chunk of every document, in order (pack() cuts a longer
    document into such chunks; an empty one has none)."""
    per_doc = -(-np.asarray(lengths, np.int64) // max_seq_len)
    first = np.cumsum(per_doc) - per_doc
    within = np.arange(int(per_doc.sum()), dtype=np.int64) - np.repeat(first, per_doc)
    return np.repeat(np.asarray(doc_starts, np.int64), per_doc) + within * max_seq_len


def row_starts(bounds: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Index of each row's first chunk under pack()'s greedy in-order packing, for contiguous chunks
    with boundaries `bounds` (starts + end). A row starting at chunk s takes every chunk up to
    next[s], the last boundary within max_seq_len tokens of bounds[s]; the row starts are 0, next[0],
    next[next[0]], ..., found by pointer doubling (after round k the first 2**k are marked and `jump`
    goes 2**k rows ahead): log2(rows) numpy passes instead of a Python step per chunk."""
    n = len(bounds) - 1
    if n <= 0:
        return np.zeros(0, np.int64)
    jump = np.searchsorted(bounds, bounds + max_seq_len, side="right") - 1  # jump[n] = n: the end
    on = np.zeros(n + 1, bool)
    on[0] = True
    while jump[0] != n:
        on[jump[np.flatnonzero(on)]] = True
        jump = jump[jump]
    return np.flatnonzero(on[:n])


class PackedDocuments(Sequence):
    """`pack(docs, max_seq_len, pad_id)` of bare-id documents (pretraining), rows built on demand.

    The documents sit in one int32 array (4 bytes a token) plus int64 document offsets, in memory or
    memory-mapped from a token store (`from_arrays`, erniekit/data/token_store.py: never copied); the
    layout adds 8 bytes a chunk and a row. The rows pack() returns hold four int64 arrays (32 bytes a
    token), which for a large corpus is what exhausts memory. Row i equals pack()'s row i (tested)."""

    def __init__(self, docs: Iterable[np.ndarray], max_seq_len: int, pad_id: int = 0) -> None:
        self._setup(*concat_documents(docs), max_seq_len, pad_id)

    @classmethod
    def from_arrays(
        cls, tokens: np.ndarray, doc_offsets: np.ndarray, max_seq_len: int, pad_id: int = 0
    ) -> PackedDocuments:
        """Rows over documents already in one array: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]].
        The arrays are used as they are (a memmap stays a memmap)."""
        out = cls.__new__(cls)
        out._setup(tokens, doc_offsets, max_seq_len, pad_id)
        return out

    def _setup(self, tokens: np.ndarray, doc_offsets: np.ndarray, max_seq_len: int, pad_id: int) -> None:
        if max_seq_len < 1:
            raise DataError(f"pack: max_seq_len={max_seq_len}; use a positive value")
        lengths = np.diff(doc_offsets)
        bad = tokens.ndim != 1 or len(doc_offsets) == 0 or doc_offsets[0] != 0 or doc_offsets[-1] != len(tokens)
        if bad or (lengths < 0).any():
            raise DataError(
                f"pack: document offsets must rise from 0 to the {len(tokens)} tokens; the token store is damaged"
            )
        self.tokens, self.doc_offsets = tokens, doc_offsets
        self.num_docs, self.longest_doc = len(lengths), int(lengths.max(initial=0))
        self.max_seq_len, self.pad_id = max_seq_len, pad_id
        self._chunks = np.append(chunk_starts(doc_offsets[:-1], lengths, max_seq_len), len(tokens))
        self._rows = np.append(row_starts(self._chunks, max_seq_len), len(self._chunks) - 1)

    def __len__(self) -> int:
        return len(self._rows) - 1

    @overload
    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, np.ndarray]]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        c = self._chunks[self._rows[i] : self._rows[i + 1] + 1]
        docs = [(self.tokens[a:b].astype(np.int64),) * 2 for a, b in zip(c[:-1], c[1:])]
        return _row(docs, self.max_seq_len, self.pad_id)


def _as_pair(item) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(item, tuple):
        ids, labels = item
    else:  # bare ids (pretraining): every token is a target
        ids = labels = item
    ids, labels = np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    if ids.shape != labels.shape or ids.ndim != 1:
        raise DataError(f"pack: input_ids {ids.shape} and labels {labels.shape} must be equal-length 1-D sequences")
    return ids, labels


def _row(docs: list[tuple[np.ndarray, np.ndarray]], max_seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    lens = np.array([len(d[0]) for d in docs])
    n = int(lens.sum())
    starts = np.cumsum(lens) - lens
    row = {
        "input_ids": np.full(max_seq_len, pad_id, dtype=np.int64),
        "labels": np.full(max_seq_len, IGNORE_INDEX, dtype=np.int64),
        "position_ids": np.zeros(max_seq_len, dtype=np.int64),
        "segment_ids": np.zeros(max_seq_len, dtype=np.int64),
    }
    row["input_ids"][:n] = np.concatenate([d[0] for d in docs])
    row["labels"][:n] = np.concatenate([d[1] for d in docs])
    row["labels"][starts] = IGNORE_INDEX  # a document's first token is never predicted from the previous one
    row["position_ids"][:n] = np.arange(n) - np.repeat(starts, lens)
    row["segment_ids"][:n] = np.repeat(np.arange(1, len(docs) + 1), lens)
    return row


def pack(sequences: Sequence, max_seq_len: int, pad_id: int = 0) -> list[dict[str, np.ndarray]]:
    """Greedily pack sequences into rows of exactly ``max_seq_len`` tokens.

    ``sequences`` holds (input_ids, labels) tuples, or bare id lists for pretraining
    (labels = ids). In input order, each sequence goes into the current row if it fits,
    else starts a new one; sequences longer than max_seq_len are first cut into
    max_seq_len chunks. Each row has int64 arrays ``input_ids``, ``labels``,
    ``position_ids`` (restarting at 0 per document) and ``segment_ids`` (1, 2, 3... per
    document, 0 for padding) so attention can be kept inside each document. The first
    label of every document is set to -100: with the causal shift it would otherwise be
    predicted from the end of the previous document.
    """
    if max_seq_len < 1:
        raise DataError(f"pack: max_seq_len={max_seq_len}; use a positive value")
    rows, current, used = [], [], 0
    for item in sequences:
        ids, labels = _as_pair(item)
        for s in range(0, len(ids), max_seq_len):
            chunk = (ids[s : s + max_seq_len], labels[s : s + max_seq_len])
            if current and used + len(chunk[0]) > max_seq_len:
                rows.append(_row(current, max_seq_len, pad_id))
                current, used = [], 0
            current.append(chunk)
            used += len(chunk[0])
    if current:
        rows.append(_row(current, max_seq_len, pad_id))
    return rows


def pad_batch(examples: Sequence, pad_id: int = 0, max_len: int | None = None) -> dict[str, np.ndarray]:
    """Right-pad (input_ids, labels) examples into [batch, length] int64 arrays.

    Returns input_ids (pad_id on padding), labels (-100 on padding), position_ids 0..n-1 and
    segment_ids (1 on real tokens, 0 on padding). Labels are not shifted (see module doc).
    """
    pairs = [_as_pair(e) for e in examples]
    if not pairs:
        raise DataError("pad_batch: empty batch; check the data loader")
    lens = np.array([len(p[0]) for p in pairs])
    width = int(lens.max()) if max_len is None else max_len
    if lens.max() > width:
        raise DataError(f"pad_batch: example of {lens.max()} tokens exceeds max_len={width}; raise max_len or truncate")
    real = np.arange(width)[None, :] < lens[:, None]
    batch = {
        "input_ids": np.full((len(pairs), width), pad_id, dtype=np.int64),
        "labels": np.full((len(pairs), width), IGNORE_INDEX, dtype=np.int64),
    }
    batch["input_ids"][real] = np.concatenate([p[0] for p in pairs])
    batch["labels"][real] = np.concatenate([p[1] for p in pairs])
    batch["position_ids"] = np.where(real, np.arange(width)[None, :], 0).astype(np.int64)
    batch["segment_ids"] = real.astype(np.int64)
    return batch
