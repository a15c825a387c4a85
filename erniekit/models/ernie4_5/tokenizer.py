"""ERNIE 4.5 tokenizer: sentencepiece + special-token splitting + the ERNIE chat template.

Reads and writes the public ERNIE-4.5 Hugging Face tokenizer layout (tokenizer.model,
tokenizer_config.json, special_tokens_map.json, optional added_tokens.json and
chat_template.jinja), so a directory moves between erniekit, PaddleFormers and transformers.

Where the defaults come from:
- Special tokens: the hub ERNIE-4.5-*-PT tokenizer as transformers' conversion script
  (convert_ernie4_5_tokenizer.py, baidu/ERNIE-4.5-0.3B-Base-PT) sets it up: bos "<s>",
  eos "</s>", unk "<unk>", pad "<unk>" (config.json pad_token_id=0), cls
  "<|begin_of_sentence|>", sep "<|end_of_sentence|>", mask "<mask:1>", no BOS/EOS added on
  encode (add_bos_token=False, legacy=True, add_prefix_space=False). The hub's
  sys_start/sys_end/header_start/header_end tokens are "<mask:4>".."<mask:7>".
  PaddleFormers' Ernie4_5_Tokenizer encodes the same way (sentencepiece pieces, special
  tokens kept whole, no clean-up of spaces on decode).
- Chat template: DEFAULT_CHAT_TEMPLATE in transformers' ERNIE 4.5 tokenizer port and the
  hub tokenizer_config.json "chat_template" (identical text), reproduced verbatim below.
"""

from __future__ import annotations

import json
import operator
import os
import re
from typing import Any, Iterable, Sequence

import sentencepiece as spm

from erniekit.errors import CheckpointError, DataError
from erniekit.models.ernie4_5.thinking_template import ERNIE_THINKING_CHAT_TEMPLATE, THINKING_TOKENS, render_thinking
from erniekit.utils.io import atomic_write, read_json_object
from erniekit.utils.text import non_text_span

# Verbatim from the ERNIE-4.5 hub tokenizer_config.json / transformers' ERNIE 4.5 port.
ERNIE_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}\n"
    "    {%- set add_generation_prompt = true -%}\n"
    "{%- endif -%}\n"
    "{%- if not cls_token is defined -%}\n"
    '    {%- set cls_token = "<|begin_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{%- if not sep_token is defined -%}\n"
    '    {%- set sep_token = "<|end_of_sentence|>" -%}\n'
    "{%- endif -%}\n"
    "{{- cls_token -}}\n"
    "{%- for message in messages -%}\n"
    '    {%- if message["role"] == "user" -%}\n'
    '        {{- "User: " + message["content"] + "\\n" -}}\n'
    '    {%- elif message["role"] == "assistant" -%}\n'
    '        {{- "Assistant: " + message["content"] + sep_token -}}\n'
    '    {%- elif message["role"] == "system" -%}\n'
    '        {{- message["content"] + "\\n" -}}\n'
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "Assistant: " -}}\n'
    "{%- endif -%}"
)

# Role tokens of the hub special_tokens_map.json.
DEFAULT_SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<unk>",
    "cls_token": "<|begin_of_sentence|>",
    "sep_token": "<|end_of_sentence|>",
    "mask_token": "<mask:1>",
}
# ERNIE control tokens beyond the role tokens (user-defined pieces in the shipped model).
DEFAULT_ADDITIONAL_SPECIAL_TOKENS = ["<|endofprompt|>"] + [f"<mask:{i}>" for i in range(8)]
SPECIAL_KEYS = tuple(DEFAULT_SPECIAL_TOKENS)
THINK_END = "</think>"
TEXT_TAGS = tuple(t for t in THINKING_TOKENS if t not in ("<|im_start|>", "<|im_end|>"))
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESOURCE_DIR = os.path.join(_PACKAGE_DIR, "resources", "tokenizer")


def _content(value: Any) -> str | None:
    """Token entries are either plain strings or AddedToken dicts {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    return read_json_object(path, "fix or regenerate the tokenizer file")


def _write_atomic(path: str, data: bytes | str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)

    atomic_write(path, write)


class ErnieTokenizer:
    """Sentencepiece tokenizer with ERNIE special tokens and chat template.

    Text is first split on special tokens (each becomes one id), then the pieces in between
    go through sentencepiece, like transformers/PaddleFormers do, so ids match theirs.
    """

    def __init__(
        self,
        model_proto: bytes,
        special_tokens: dict[str, str] | None = None,
        additional_special_tokens: Sequence[str] | None = None,
        added_tokens: dict[str, int] | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._model_proto = model_proto
        self.special_tokens = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
        self.additional_special_tokens = list(
            DEFAULT_ADDITIONAL_SPECIAL_TOKENS if additional_special_tokens is None else additional_special_tokens
        )
        self.chat_template = chat_template or ERNIE_CHAT_TEMPLATE
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.extra_config = dict(extra_config or {})
        base = self.sp.get_piece_size()
        # added tokens live either inside the spm vocab or after it (ids >= base)
        self.added_tokens = {t: i for t, i in (added_tokens or {}).items()}
        self._id_to_added = {i: t for t, i in self.added_tokens.items() if i >= base}
        self._unk_id = self.sp.unk_id()
        specials = list(self.special_tokens.values()) + self.additional_special_tokens + list(self.added_tokens)
        # keep only tokens the vocabulary really has (a listed token missing from it is plain text)
        self._special_ids = {}
        for tok in dict.fromkeys(specials):
            tid = self._lookup(tok)
            if tid is not None:
                self._special_ids[tok] = tid
        self.all_special_ids = set(self._special_ids.values())
        # the thinking format's tags are text of a reply (its parser reads them): decoded even when
        # special tokens are skipped, and saved as non-special added tokens, as the hub does
        self._text_tag_ids = {self._special_ids[t] for t in TEXT_TAGS if t in self._special_ids}
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    # ---------------------------------------------------------------- loading / saving
    @classmethod
    def from_pretrained(cls, path: str) -> "ErnieTokenizer":
        """Load a hub-layout tokenizer directory (tokenizer.model + json side files)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"tokenizer directory not found: {path}; check model_name_or_path")
        model_file = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(model_file):
            raise CheckpointError(
                f"{path}: missing tokenizer.model (sentencepiece file); copy it from the original checkpoint"
            )
        with open(model_file, "rb") as f:
            proto = f.read()
        try:
            spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as e:
            raise CheckpointError(f"{model_file}: not a sentencepiece model ({e}); replace the file") from e

        cfg_path, map_path = os.path.join(path, "tokenizer_config.json"), os.path.join(path, "special_tokens_map.json")
        config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        smap = _read_json(map_path) if os.path.isfile(map_path) else {}
        special = {k: _content(config.get(k, smap.get(k))) for k in SPECIAL_KEYS}
        special = {k: v for k, v in special.items() if v}
        additional = [
            _content(t) for t in smap.get("additional_special_tokens", config.get("additional_special_tokens", []))
        ]
        # hub role tokens without a standard attribute (sys_start_token = "<mask:4>", ...)
        additional += [
            v
            for k, v in {**config, **smap}.items()
            if k.endswith("_token") and k not in SPECIAL_KEYS and isinstance(v, str)
        ]
        added: dict[str, int] = {}
        for tid, entry in (config.get("added_tokens_decoder") or {}).items():
            if _content(entry):
                added[_content(entry)] = int(tid)
        added_path = os.path.join(path, "added_tokens.json")
        if os.path.isfile(added_path):
            added.update({t: int(i) for t, i in _read_json(added_path).items()})
        template = config.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # transformers' named-template list form
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        known = {
            *SPECIAL_KEYS,
            "additional_special_tokens",
            "added_tokens_decoder",
            "chat_template",
            "add_bos_token",
            "add_eos_token",
        }
        return cls(
            proto,
            special_tokens=special,
            additional_special_tokens=list(dict.fromkeys(t for t in additional if t)),
            added_tokens=added,
            chat_template=template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            extra_config={k: v for k, v in config.items() if k not in known},
        )

    def save_pretrained(self, save_dir: str) -> list[str]:
        """Write the hub layout; transformers' AutoTokenizer loads it with the same ids."""
        os.makedirs(save_dir, exist_ok=True)
        base = self.sp.get_piece_size()
        decoder = {
            str(tid): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": tid not in self._text_tag_ids,
            }
            for tok, tid in sorted(self._special_ids.items(), key=lambda kv: kv[1])
        }
        config = {
            **self.extra_config,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "add_prefix_space": False,
            "legacy": True,
            "clean_up_tokenization_spaces": False,
            "spaces_between_special_tokens": False,
            "added_tokens_decoder": decoder,
            **self.special_tokens,
            "additional_special_tokens": self.additional_special_tokens,
            "chat_template": self.chat_template,
        }
        config.setdefault("model_max_length", 131072)
        config.setdefault("padding_side", "right")
        # transformers' ERNIE-4.5 conversion saves LlamaTokenizerFast (sentencepiece BPE, byte fallback)
        config.setdefault("tokenizer_class", "LlamaTokenizer")
        smap = {**self.special_tokens, "additional_special_tokens": self.additional_special_tokens}
        files = {
            "tokenizer.model": self._model_proto,
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
            "special_tokens_map.json": json.dumps(smap, indent=2, ensure_ascii=False) + "\n",
        }
        if os.path.isfile(os.path.join(save_dir, "chat_template.jinja")):  # would shadow the config's template
            files["chat_template.jinja"] = self.chat_template
        beyond = {t: i for t, i in self.added_tokens.items() if i >= base}
        if beyond:
            files["added_tokens.json"] = json.dumps(beyond, indent=2, ensure_ascii=False) + "\n"
        paths = []
        for name, data in files.items():
            paths.append(os.path.join(save_dir, name))
            _write_atomic(paths[-1], data)
        return paths

    # ---------------------------------------------------------------- vocabulary
    def _lookup(self, token: str) -> int | None:
        if token in self.added_tokens:
            return self.added_tokens[token]
        tid = self.sp.piece_to_id(token)
        return tid if tid != self._unk_id or token == self.sp.id_to_piece(self._unk_id) else None

    @property
    def vocab_size(self) -> int:
        """Number of ids (sentencepiece pieces plus added tokens past them)."""
        return max([self.sp.get_piece_size() - 1, *self._id_to_added]) + 1

    def __len__(self) -> int:
        return self.vocab_size

    def _id(self, key: str) -> int:
        return self._lookup(self.special_tokens[key])

    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))
    cls_token_id = property(lambda self: self._id("cls_token"))
    sep_token_id = property(lambda self: self._id("sep_token"))
    mask_token_id = property(lambda self: self._id("mask_token"))
    bos_token = property(lambda self: self.special_tokens["bos_token"])
    eos_token = property(lambda self: self.special_tokens["eos_token"])
    pad_token = property(lambda self: self.special_tokens["pad_token"])
    cls_token = property(lambda self: self.special_tokens["cls_token"])
    sep_token = property(lambda self: self.special_tokens["sep_token"])

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int]:
        """Token string(s) to id(s); unknown tokens give the unk id."""
        if isinstance(tokens, str):
            tid = self._lookup(tokens)
            return self._unk_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Id(s) to token string(s) (sentencepiece pieces, e.g. '▁the')."""
        try:
            i = operator.index(ids)  # int or numpy integer
        except TypeError:
            return [self.convert_ids_to_tokens(i) for i in ids]
        return self._id_to_added[i] if i in self._id_to_added else self.sp.id_to_piece(i)

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text to ids. Special tokens in the text become single ids.

        add_special_tokens adds BOS/EOS only when the config says so (add_bos_token /
        add_eos_token); ERNIE 4.5 sets both False, like transformers does for it.
        """
        span = non_text_span(text)
        if span is not None:  # sentencepiece would raise a bare RuntimeError
            raise DataError(
                f"text to encode is not valid Unicode: {text[span[0] : span[1]]!r} at character {span[0]} "
                "(an unpaired surrogate, e.g. from bytes that were not UTF-8); pass UTF-8 text"
            )
        parts = self._split_re.split(text) if self._split_re else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:  # odd entries are the captured special tokens
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(self.sp.encode(part))
        if add_special_tokens:
            ids = [self.bos_token_id] * self.add_bos_token + ids + [self.eos_token_id] * self.add_eos_token
        return ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids to text; special tokens are dropped or written out as their strings."""
        out, run = [], []
        size = self.vocab_size
        for i in (int(x) for x in ids):
            if not 0 <= i < size:
                raise DataError(
                    f"decode: token id {i} outside the vocabulary [0, {size}); check the model's vocab_size"
                )
            if i in self.all_special_ids or i in self._id_to_added:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens or i not in self.all_special_ids or i in self._text_tag_ids:
                    out.append(self.convert_ids_to_tokens(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the tokenizer's template (same text as transformers renders).

        Plain conversations are {"role": system|user|assistant, "content": str}; with tools, tool
        results, tool calls or reasoning the messages are checked by erniekit.data.tool_messages.
        The built-in ERNIE thinking template is rendered in Python (identical text, tested)."""
        from erniekit.data.tool_messages import is_tool_dialog

        if tools or is_tool_dialog(messages):
            self._check_dialog(messages, tools)
        else:
            for n, m in enumerate(messages):
                if (
                    not isinstance(m, dict)
                    or m.get("role") not in ("system", "user", "assistant")
                    or not isinstance(m.get("content"), str)
                ):
                    raise DataError(
                        f"messages[{n}]: need {{'role': 'system'|'user'|'assistant', 'content': str}}, got {str(m)[:80]}"
                    )
        if self.chat_template == ERNIE_THINKING_CHAT_TEMPLATE:
            text = render_thinking(messages, tools, add_generation_prompt, kwargs.get("enable_thinking", True))
        else:
            from jinja2 import TemplateError

            try:
                text = _compile(self.chat_template).render(
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **kwargs},
                )
            except (TypeError, TemplateError) as e:
                raise DataError(
                    f"chat template cannot render these messages ({type(e).__name__}: {e}); tool calls, tool results "
                    "and reasoning need a template that renders them: chat_template: ernie_thinking"
                ) from None
        return self.encode(text) if tokenize else text

    @staticmethod
    def _check_dialog(messages: list[dict], tools: list[dict] | None) -> None:
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise DataError(f"messages[{n}]: role must be system, user, assistant or tool, got {str(m)[:80]}")
            if m["role"] != "assistant" and not isinstance(m.get("content"), str):
                raise DataError(f"messages[{n}]: a {m['role']} message needs a string content")
            if m["role"] == "assistant" and not (isinstance(m.get("content"), str) or m.get("tool_calls")):
                raise DataError(f"messages[{n}]: an assistant message needs a string content or tool_calls")

    @property
    def thinking(self) -> bool:
        """Whether replies start inside a thinking block (the template's generation prompt opens
        `<think>`), so what the model writes is parsed into reasoning / answer / tool calls."""
        if THINK_END not in self._special_ids:
            return False
        prompt = self.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)
        return prompt.rstrip("\n").endswith("<think>")

    def with_thinking_template(self) -> "ErnieTokenizer":
        """This tokenizer with the ERNIE thinking chat format: its tags become single tokens (added
        after the vocabulary where it lacks them) and the built-in thinking template is its template."""
        missing = [t for t in THINKING_TOKENS if self._lookup(t) is None]
        added = dict(self.added_tokens)
        for k, tok in enumerate(missing):
            added[tok] = self.vocab_size + k
        return ErnieTokenizer(
            self._model_proto,
            special_tokens=self.special_tokens,
            additional_special_tokens=list(dict.fromkeys([*self.additional_special_tokens, *THINKING_TOKENS])),
            added_tokens=added,
            chat_template=ERNIE_THINKING_CHAT_TEMPLATE,
            add_bos_token=self.add_bos_token,
            add_eos_token=self.add_eos_token,
            extra_config=self.extra_config,
        )


_TEMPLATES: dict[str, Any] = {}


def _compile(template: str):
    """Compile a chat template in a sandbox, with the options transformers uses."""
    if template not in _TEMPLATES:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DataError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]


def default_tokenizer() -> ErnieTokenizer:
    """The small tokenizer shipped in erniekit/resources/tokenizer (see tools/make_tokenizer.py)."""
    return ErnieTokenizer.from_pretrained(RESOURCE_DIR)
