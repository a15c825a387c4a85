"""Prompt datasets for RL: the prompt the policy answers plus the fields rewards check against.

Formats (one JSON record per line, detected per file with train_dataset_type: auto):
- prompt:   {"prompt": str | [messages ending with a user turn], "system"?: str, ...fields}
- erniekit: {"src": [...], "tgt": [...], ...fields}: the last tgt is the reference, field `answer`
- alpaca / messages: as for SFT; the last assistant reply is the field `answer`
Every key not part of the format itself (e.g. "answer", "solution", "tests") becomes a field
passed to reward functions (erniekit/rl/rewards.py). A `"control": {...}` object is rendered into
the prompt as in SFT (erniekit/data/control.py) in every format, and is a field as well; the run counts
it into the model's control_attributes.json (docs/control.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from erniekit.data.control import check_control
from erniekit.data.formats import _READERS, Conversation, _misspelled, detect_format, load_records
from erniekit.errors import DataError

_FORMAT_KEYS = {
    "erniekit": {"system", "src", "tgt", "label", "is_system"},
    "alpaca": {"instruction", "input", "output", "system", "history"},
    "messages": {"messages"},
    "prompt": {"prompt", "system"},
}


@dataclass
class PromptExample:
    conv: Conversation  # history + (prompt, reference or ""): its rendering up to the reply is the model input
    fields: dict[str, Any] = field(default_factory=dict)  # what reward functions receive
    source: str = ""

    @property
    def prompt_text(self) -> str:
        return self.conv.turns[-1][0]


def _prompt_messages(value: Any, where: str) -> tuple[str | None, list[tuple[str, str]], str]:
    """A messages list ending with a user turn -> (system, history pairs, last user text)."""
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of {{'role', 'content'}} messages")
    system = value[0]["content"] if value[0]["role"] == "system" else None
    body = value[1:] if system is not None else value
    roles = [m["role"] for m in body]
    if roles != ["user", "assistant"] * (len(body) // 2) + ["user"]:
        raise DataError(f"{where}: field 'prompt' roles {roles} must alternate user/assistant and end with a user turn")
    history = [(body[i]["content"], body[i + 1]["content"]) for i in range(0, len(body) - 1, 2)]
    return system, history, body[-1]["content"]


def _check_typo(rec: dict, fmt: str, where: str) -> None:
    """Keys beside the format's own are reward fields, but one that looks like a misspelling of a
    format key the record lacks ('sytem') would silently drop what it meant: refused."""
    typo = _misspelled(frozenset(rec), frozenset(_FORMAT_KEYS[fmt]) | {"control"})
    if typo is not None:
        raise DataError(
            f"{where}: unknown field '{typo[0]}'; did you mean '{typo[1]}'? (other keys are passed to the "
            "reward functions as fields)"
        )


def _from_prompt(rec: dict, where: str) -> PromptExample:
    _check_typo(rec, "prompt", where)
    value = rec.get("prompt")
    system = rec.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: field 'system' must be a string")
    if isinstance(value, str):
        history, prompt = [], value
    else:
        msg_system, history, prompt = _prompt_messages(value, where)
        if msg_system is not None and system is not None:  # as the preference reader refuses it
            raise DataError(f"{where}: system prompt given twice ('system' field and a system message); keep one")
        system = system if system is not None else msg_system
    turns = history + [(prompt, "")]
    conv = Conversation(system, turns, [False] * len(history) + [True], where)
    conv.control = check_control(rec.get("control"), where)  # rendered as SFT renders it; also a field
    return PromptExample(conv, {k: v for k, v in rec.items() if k not in _FORMAT_KEYS["prompt"]}, where)


def _from_conversation(fmt: str):
    def read(rec: dict, where: str) -> PromptExample:
        _check_typo(rec, fmt, where)
        conv = _READERS[fmt](rec, where)
        fields = {k: v for k, v in rec.items() if k not in _FORMAT_KEYS[fmt]}
        fields.setdefault("answer", conv.turns[-1][1])
        return PromptExample(conv, fields, where)

    return read


_PROMPT_READERS = {"prompt": _from_prompt, **{f: _from_conversation(f) for f in ("erniekit", "alpaca", "messages")}}


def _detect(rec: object, where: str) -> str:
    if isinstance(rec, dict) and "prompt" in rec:
        return "prompt"
    return detect_format(rec, where)


def load_prompts(path: str, fmt: str = "auto") -> list[PromptExample]:
    """Read and validate RL prompt files (comma-separated list allowed)."""
    return load_records(path, fmt, _PROMPT_READERS, _detect, label="prompt data", kind="prompts")
