"""Whether a Python str is Unicode text: JSON's \\ud800 escapes and bytes read with surrogate
escapes (PEP 383: argv, stdin) make strs that no UTF-8 encoder, sentencepiece included, takes."""

from __future__ import annotations


def non_text_span(s: str) -> tuple[int, int] | None:
    """(start, end) of the first characters of `s` that are no Unicode text (unpaired surrogates);
    None when `s` encodes to UTF-8."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start, e.end
    return None


def is_text(s: str) -> bool:
    return non_text_span(s) is None
