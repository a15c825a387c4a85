"""Token ids to text as they are generated, at a cost per token that does not grow with the reply.

Decoding the whole completion after every token (what a plain streamer does) costs O(n) per token,
O(n^2) per reply: 15 s of a 16k-token reply on this project's tokenizer, spent in the engine thread
every request shares. `TextStream` decodes a short window instead, as text-generation-inference's
incremental detokenizer does: the tokens of the last emitted piece plus the new ones, and emits the
window's text past what its first part decodes to. A window starts at a token boundary that was
decoded before, so the tokenizer's start-of-text handling (sentencepiece drops the leading space of
the first piece) falls on text already emitted, and the emitted pieces joined are the whole decode
(tests/unit/infer/test_detokenize.py holds it to `tokenizer.decode` over random ids). Text ending
in U+FFFD (a multi-byte character whose byte tokens are still coming) stays pending until complete.
"""

from __future__ import annotations

from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class TextStream:
    """Feed token ids with `push`; `certain` text grows by the returned pieces, `pending` is the
    decoded rest (possibly an incomplete character); `text()` is both, the whole decode."""

    def __init__(self, tokenizer: _Decoder) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []
        self.certain_len = 0
        self.pending = ""
        self._start = self._read = 0  # window start; end of the tokens whose text is certain
        self._head = ""  # the window's text up to _read (not emitted again)

    def push(self, tok: int) -> str:
        """Add one token; the text it made certain ("" while a character is incomplete)."""
        self.ids.append(tok)
        text = self.tokenizer.decode(self.ids[self._start :])
        if not text.startswith(self._head):  # a tokenizer whose windows do not decode as prefixes: from the start
            self._start, self._head = 0, "".join(self._pieces)
            text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            self.pending = text[len(self._head) :]
            return ""
        piece = text[len(self._head) :]
        self._start, self._read = self._read, len(self.ids)
        self._head = self.tokenizer.decode(self.ids[self._start : self._read]) if self._start < self._read else ""
        self._pieces.append(piece)
        self.certain_len += len(piece)
        self.pending = ""
        return piece

    def last(self, n: int) -> str:
        """The last `n` characters of the certain text (the part a stop string can still end in)."""
        if n <= 0:
            return ""
        out, got = [], 0
        for piece in reversed(self._pieces):
            out.append(piece)
            got += len(piece)
            if got >= n:
                break
        return "".join(reversed(out))[-n:]

    def text(self) -> str:
        return "".join(self._pieces) + self.pending
