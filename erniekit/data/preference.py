"""Preference (DPO-family) datasets: read, validate up front, encode chosen/rejected pairs.

Formats (one record per line in .jsonl, or a JSON list in .json; auto-detected per file):
- erniekit (ERNIEKit / PaddleFormers DPO):
  {"system"?: str, "src": [user turns], "tgt": [assistant turns, one fewer than src],
   "response": [[reply A], [reply B]], "sort": [rank A, rank B]}
  src[:-1]/tgt are the history, src[-1] the final user turn; the response with the HIGHER
  sort value is chosen, so sort [0, 1] means the second response is chosen. As in
  PaddleFormers: a bare string src/tgt is a one-turn list, "tgt": [] is a single-turn
  prompt, a bare-string response ["A", "B"] is read as [["A"], ["B"]], and "is_system": 1
  takes src[0] as the system prompt (dropping src[0] and tgt[0]).
- prompt (TRL explicit prompt): {"prompt": str | [messages], "chosen": R, "rejected": R,
  "system"?: str}
- messages (TRL conversational): {"messages": [optional system, user/assistant alternating,
  ending with user], "chosen": R, "rejected": R}
- alpaca (LLaMA-Factory / ERNIEKit alpaca DPO): {"instruction" | "question": str, "input"?: str,
  "chosen": R, "rejected": R, "system"?: str, "history"?: [[query, reply], ...]}
where a reply R is a string, {"role": "assistant", "content": str} or a list holding one
such message. Every problem raises DataError naming file and line; a misspelled field too, and
other keys a format does not read get one warning per file (erniekit/data/formats.py: check_fields).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from erniekit.data.encode import IGNORE_INDEX, encode_conversation
from erniekit.data.formats import Conversation, _str, load_records, src_is_system
from erniekit.errors import DataError

if TYPE_CHECKING:  # importing the model package would pull in paddle
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

PREFERENCE_FORMATS = ("auto", "erniekit", "prompt", "messages", "alpaca")
TRUNCATION_MODES = ("error", "truncate")


@dataclass
class PreferencePair:
    """One preference example: a shared context and two candidate final replies."""

    system: str | None
    history: list[tuple[str, str]]  # earlier (user, assistant) turns, never trained
    prompt: str  # the final user turn
    chosen: str
    rejected: str
    source: str = field(default="", compare=False)  # "file:line", for error messages

    def conversation(self, reply: str) -> Conversation:
        """The pair's context followed by ``reply``, training on that final reply only."""
        turns = list(self.history) + [(self.prompt, reply)]
        return Conversation(self.system, turns, [False] * len(self.history) + [True], self.source)


# ------------------------------------------------------------------ field helpers
def _text_list(rec: dict, key: str, where: str, allow_empty: bool) -> list[str]:
    value = rec.get(key, [] if allow_empty else None)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not value and not allow_empty):
        what = "missing" if key not in rec else f"must be a {'' if allow_empty else 'non-empty '}list of strings"
        raise DataError(f"{where}: field '{key}' {what}")
    return value


def _reply(rec: dict, key: str, where: str) -> str:
    """A reply given as a string, an assistant message, or a one-message list (TRL)."""
    if key not in rec:
        raise DataError(f"{where}: field '{key}' missing; a preference record needs both 'chosen' and 'rejected'")
    value = rec[key]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        value = value["content"]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{key}' must be a string or one {{'role': 'assistant', 'content': str}} message, "
            f"got {str(value)[:60]}"
        )
    return value


def _system(value: object, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: field 'system' must be a string, got {type(value).__name__}")
    return value or None  # "" renders nothing, as in the SFT readers


def _chat_context(msgs: object, key: str, where: str) -> tuple[str | None, list[tuple[str, str]], str]:
    """(system, history, final user turn) from messages that end with a user turn."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(
            f"{where}: field '{key}' {'missing' if msgs is None else 'must be a non-empty list of messages'}"
        )
    for i, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: field '{key}[{i}]' must be {{'role': 'system'|'user'|'assistant', 'content': str}}"
            )
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    roles = [m["role"] for m in body]
    if not body or roles != (["user", "assistant"] * len(body))[: len(body)] or len(body) % 2 == 0:
        raise DataError(
            f"{where}: field '{key}' roles {roles} must alternate user/assistant after an optional system "
            "and end with the user turn the chosen/rejected replies answer"
        )
    history = [(body[i]["content"], body[i + 1]["content"]) for i in range(0, len(body) - 1, 2)]
    return system or None, history, body[-1]["content"]


def _pair(system, history, prompt, chosen, rejected, where) -> PreferencePair:
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply.strip():
            raise DataError(f"{where}: {name} reply is empty; give a non-empty reply or remove the record")
    if chosen == rejected:
        raise DataError(
            f"{where}: chosen and rejected replies are identical (an identical pair teaches nothing); fix or remove the record"
        )
    return PreferencePair(system, history, prompt, chosen, rejected, where)


# ------------------------------------------------------------------ readers
def _from_erniekit(rec: dict, where: str) -> PreferencePair:
    src = _text_list(rec, "src", where, allow_empty=False)
    tgt = _text_list(rec, "tgt", where, allow_empty=True)
    if len(src) != len(tgt) + 1:
        raise DataError(
            f"{where}: 'src' has {len(src)} turns and 'tgt' {len(tgt)}; a DPO record needs len(src) == len(tgt) + 1 "
            "(tgt holds the history replies, the final reply comes from 'response')"
        )
    response = rec.get("response")
    if not isinstance(response, list) or len(response) != 2:
        what = (
            "missing"
            if response is None
            else f"has {len(response)} entries"
            if isinstance(response, list)
            else "must be a list"
        )
        raise DataError(
            f"{where}: field 'response' {what}; it must hold exactly two candidate replies [[reply], [reply]]"
        )
    replies = []
    for i, r in enumerate(response):
        r = [r] if isinstance(r, str) else r
        if not isinstance(r, list) or not all(isinstance(x, str) for x in r) or len(r) != 1:
            raise DataError(
                f"{where}: field 'response[{i}]' must be a one-element list of strings (the final reply); "
                "multi-turn responses are not supported"
            )
        replies.append(r[0])
    sort = rec.get("sort")
    if (
        not isinstance(sort, list)
        or len(sort) != 2
        or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in sort)
        or sort[0] == sort[1]
    ):
        got = "missing" if sort is None else f"got {str(sort)[:40]}"
        raise DataError(
            f"{where}: field 'sort' must be two different numbers ranking the two responses (higher = chosen), {got}"
        )
    system = _system(rec.get("system"), where)
    if src_is_system(rec, src, system, where):
        system, src, tgt = src[0] or None, src[1:], tgt[1:]
    chosen, rejected = (replies[0], replies[1]) if sort[0] > sort[1] else (replies[1], replies[0])
    return _pair(system, list(zip(src[:-1], tgt)), src[-1], chosen, rejected, where)


def _from_prompt(rec: dict, where: str) -> PreferencePair:
    prompt = rec.get("prompt")
    system = _system(rec.get("system"), where)
    if isinstance(prompt, list):  # TRL conversational prompt
        msg_system, history, prompt = _chat_context(prompt, "prompt", where)
        if msg_system is not None and system is not None:
            raise DataError(f"{where}: system prompt given twice ('system' field and a system message); keep one")
        system = system or msg_system
    elif isinstance(prompt, str):
        history = []
    else:
        raise DataError(
            f"{where}: field 'prompt' {'missing' if prompt is None else 'must be a string or a list of messages'}"
        )
    return _pair(system, history, prompt, _reply(rec, "chosen", where), _reply(rec, "rejected", where), where)


def _from_messages(rec: dict, where: str) -> PreferencePair:
    system, history, prompt = _chat_context(rec.get("messages"), "messages", where)
    return _pair(system, history, prompt, _reply(rec, "chosen", where), _reply(rec, "rejected", where), where)


def _from_alpaca(rec: dict, where: str) -> PreferencePair:
    key = "instruction" if "instruction" in rec else "question"
    instruction = _str(rec, key, where)
    extra = _str(rec, "input", where, required=False)
    query = f"{instruction}\n{extra}" if extra else instruction  # same join as the SFT alpaca reader
    history = rec.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(h, (list, tuple)) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in history
    ):
        raise DataError(f"{where}: field 'history' must be a list of [query, reply] string pairs")
    system = _system(rec.get("system"), where)
    return _pair(
        system, [(q, a) for q, a in history], query, _reply(rec, "chosen", where), _reply(rec, "rejected", where), where
    )


_READERS = {"erniekit": _from_erniekit, "prompt": _from_prompt, "messages": _from_messages, "alpaca": _from_alpaca}
_FIELDS = {  # the record keys each reader reads (formats.check_fields: a misspelled one is an error)
    "erniekit": frozenset({"src", "tgt", "response", "sort", "system", "is_system"}),
    "prompt": frozenset({"prompt", "chosen", "rejected", "system"}),
    "messages": frozenset({"messages", "chosen", "rejected"}),
    "alpaca": frozenset({"instruction", "question", "input", "chosen", "rejected", "system", "history"}),
}


def detect_preference_format(rec: object, where: str) -> str:
    """Guess the preference format from a record's keys."""
    if isinstance(rec, dict):
        if "src" in rec or "response" in rec:
            return "erniekit"
        if "messages" in rec:
            return "messages"
        if "prompt" in rec:
            return "prompt"
        if "instruction" in rec or "question" in rec:
            return "alpaca"
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(
        f"{where}: cannot tell the preference format from keys {keys}; use erniekit (src/tgt/response/sort), "
        "prompt/chosen/rejected, messages/chosen/rejected or alpaca (instruction/chosen/rejected)"
    )


def load_preference_pairs(path: str, fmt: str = "auto") -> list[PreferencePair]:
    """Read and validate preference files (comma-separated list allowed); auto-detects per file."""
    return load_records(
        path,
        fmt,
        _READERS,
        detect_preference_format,
        "preference data",
        "preference examples",
        ranking=True,
        fields=_FIELDS,
    )


# ------------------------------------------------------------------ encoding
def _prompt_len(labels: list[int]) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


def _encode_full(
    pair: PreferencePair, tokenizer: ErnieTokenizer
) -> tuple[list[int], list[int], list[int], list[int], int]:
    c_ids, c_labels = encode_conversation(pair.conversation(pair.chosen), tokenizer, sys.maxsize)
    r_ids, r_labels = encode_conversation(pair.conversation(pair.rejected), tokenizer, sys.maxsize)
    n = _prompt_len(c_labels)
    if _prompt_len(r_labels) != n or c_ids[:n] != r_ids[:n]:
        raise DataError(
            f"{pair.source or 'preference pair'}: chosen and rejected render different prompt tokens; "
            "use the ERNIE chat template or one whose prompt does not depend on the reply"
        )
    return c_ids, c_labels, r_ids, r_labels, n


def encode_preference_pair(
    pair: PreferencePair,
    tokenizer: ErnieTokenizer,
    max_seq_len: int,
    truncation: str = "error",
    index: int | None = None,
) -> dict:
    """Token ids and labels of the chosen and of the rejected sequence, sharing one prompt.

    Each sequence is ``encode_conversation`` of (history, prompt, reply): the same chat-template
    pieces as SFT and inference, so the prompt ids are identical in both and labels are -100
    everywhere except the final reply and its sep token (labels are not shifted).

    Too long means prompt + the longer reply > max_seq_len. truncation="error" raises
    DataError; "truncate" drops prompt tokens from the LEFT (cls, system and the oldest turns
    go first, as TRL's keep_end) keeping at least one, and only if the longer reply still does
    not fit cuts the replies from the right. Returns ``chosen_ids, chosen_labels, rejected_ids,
    rejected_labels`` (int lists), ``prompt_len`` and ``truncated``.
    """
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"truncation='{truncation}'; use 'error' or 'truncate'")
    if max_seq_len < 2:
        raise DataError(
            f"max_seq_len={max_seq_len}; a preference sequence needs at least a prompt token and a reply token"
        )
    c_ids, c_labels, r_ids, r_labels, n = _encode_full(pair, tokenizer)
    longest = max(len(c_ids), len(r_ids))
    truncated = longest > max_seq_len
    if truncated:
        if truncation == "error":
            num = "" if index is None else f" {index}"
            raise DataError(
                f"preference pair{num} ({pair.source or 'pair'}) has {longest} tokens (prompt {n} + longer reply "
                f"{longest - n}) > max_seq_len={max_seq_len}; raise max_seq_len or set truncation='truncate'"
            )
        drop = n - max(1, n - (longest - max_seq_len))
        c_ids, c_labels, r_ids, r_labels = (x[drop : max_seq_len + drop] for x in (c_ids, c_labels, r_ids, r_labels))
        n -= drop
    return {
        "chosen_ids": c_ids,
        "chosen_labels": c_labels,
        "rejected_ids": r_ids,
        "rejected_labels": r_labels,
        "prompt_len": n,
        "truncated": truncated,
    }


def encode_preference_pairs(
    pairs: Sequence[PreferencePair], tokenizer: ErnieTokenizer, max_seq_len: int, truncation: str = "error"
) -> list[dict]:
    """Encode many pairs (see :func:`encode_preference_pair`); one warning counts the truncated ones."""
    out = [encode_preference_pair(p, tokenizer, max_seq_len, truncation, index=i) for i, p in enumerate(pairs)]
    truncated = sum(e["truncated"] for e in out)
    if truncated:
        warnings.warn(
            f"{truncated} of {len(pairs)} preference pairs truncated to max_seq_len={max_seq_len}", stacklevel=2
        )
    return out
