"""OpenAI's two shapes of log-probabilities, from the engine's TokenLogprob records.

/v1/completions (the legacy shape lm-evaluation-harness reads): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (a {token: logprob} dict per position) and `text_offset`; with
`echo` the prompt's tokens come first, the very first with null entries (nothing predicts it).
/v1/chat/completions: `content`, a list of {token, logprob, bytes, top_logprobs: [...]}.
A token's text is its vocabulary piece as it reads in text (sentencepiece's "▁" is a space); a
byte-fallback piece that is not a whole character reads "bytes:\\xNN", as OpenAI writes one.
"""

from __future__ import annotations

import re

from erniekit.infer.engine import TokenLogprob

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenTexts:
    """Every id's text and raw bytes, built once per server (a list lookup per token afterwards)."""

    def __init__(self, pieces: list[str]) -> None:
        self.texts, self.raw = [], []
        for p in pieces:
            m = _BYTE_PIECE.match(p)
            if m:  # a byte of a character split over several tokens
                b = int(m[1], 16)
                self.texts.append(chr(b) if b < 0x80 else f"bytes:\\x{b:02x}")
                self.raw.append(bytes([b]))
            else:
                self.texts.append(p.replace("\u2581", " "))
                self.raw.append(self.texts[-1].encode("utf-8"))

    def __call__(self, token_id: int) -> str:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else ""

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self.raw[token_id]) if 0 <= token_id < len(self.raw) else []


def completion_logprobs(
    texts: TokenTexts, entries: list[TokenLogprob], prompt_first: int | None = None, offset: int = 0
) -> dict:
    """The legacy object over `entries`; `prompt_first`: the echoed prompt's first token id, which
    leads with null log-probabilities. `offset`: the character offset of the first token's text."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
    if prompt_first is not None:
        tokens.append(texts(prompt_first))
        lps.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(tokens[-1])
    for e in entries:
        t = texts(e.id)
        tokens.append(t)
        lps.append(e.logprob)
        top: dict[str, float] = {}
        for i, v in e.top:
            top.setdefault(texts(i), v)  # two ids with one text: the likelier one (listed first)
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    def one(token_id: int, lp: float) -> dict:
        return {"token": texts(token_id), "logprob": lp, "bytes": texts.bytes_of(token_id)}

    return {"content": [{**one(e.id, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]} for e in entries]}
