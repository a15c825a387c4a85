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


def _token_field(config: dict, smap: dict, key: str, cfg_path: str, map_path: str) -> str | None:
    """A role token (`eos_token`, ...) from tokenizer_config.json or special_tokens_map.json:
    a string or an AddedToken dict; any other type is a CheckpointError naming the file and key."""
    where, value = (cfg_path, config[key]) if key in config else (map_path, smap.get(key))
    if value is None:
        return None
    if _content(value) is None:
        raise CheckpointError(f"{where}: {key} must be a token string, got {json.dumps(value)[:60]}; fix the file")
    return _content(value)


def _token_list(data: dict, where: str) -> list[str]:
    """additional_special_tokens: a list of strings or AddedToken dicts (a bare string would be
    split into single characters, each then a special token)."""
    value = data.get("additional_special_tokens") or []
    if not isinstance(value, list) or any(_content(t) is None for t in value):
        raise CheckpointError(
            f"{where}: additional_special_tokens must be a list of token strings, got {json.dumps(value)[:60]}; "
            "fix the file"
        )
    return [_content(t) for t in value]


def _added_ids(entries: dict, where: str) -> dict[str, int]:
    """{token: id} with every id a non-negative integer."""
    out = {}
    for tok, tid in entries.items():
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise CheckpointError(f"{where}: added token {tok!r} has id {tid!r}; ids are integers >= 0, fix the file")
        out[tok] = tid
    return out


def _added_tokens(config: dict, where: str) -> dict[str, int]:
    """{token: id} of tokenizer_config.json's added_tokens_decoder ({"id": {"content": ...}})."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{where}: added_tokens_decoder must be an object {{id: token}}; fix the file")
    entries = {}
    for tid, entry in decoder.items():
        if _content(entry) is None:
            raise CheckpointError(f"{where}: added_tokens_decoder[{tid!r}] has no token string; fix the file")
        entries[_content(entry)] = int(tid) if tid.strip().isdigit() else tid
    return _added_ids(entries, f"{where}: added_tokens_decoder")


def _read_template(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path}: not UTF-8 text (byte offset {e.start}); re-save the template as UTF-8"
        ) from None


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
        self.chat_template_source = "chat_template"  # where the template came from, for error messages
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
            pieces = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
        except RuntimeError as e:
            raise CheckpointError(f"{model_file}: not a sentencepiece model ({e}); replace the file") from e
        if pieces == 0:  # an empty file parses as a model with no pieces, then every encode fails
            raise CheckpointError(f"{model_file}: sentencepiece model with no pieces (empty file?); replace the file")

        cfg_path, map_path = os.path.join(path, "tokenizer_config.json"), os.path.join(path, "special_tokens_map.json")
        config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        smap = _read_json(map_path) if os.path.isfile(map_path) else {}
        special = {k: _token_field(config, smap, k, cfg_path, map_path) for k in SPECIAL_KEYS}
        special = {k: v for k, v in special.items() if v}
        additional = _token_list(smap, map_path) if "additional_special_tokens" in smap else None
        if additional is None:
            additional = _token_list(config, cfg_path)
        # hub role tokens without a standard attribute (sys_start_token = "<mask:4>", ...)
        additional += [
            v
            for k, v in {**config, **smap}.items()
            if k.endswith("_token") and k not in SPECIAL_KEYS and isinstance(v, str)
        ]
        added = _added_tokens(config, cfg_path)
        added_path = os.path.join(path, "added_tokens.json")
        if os.path.isfile(added_path):
            added.update(_added_ids(_read_json(added_path), added_path))
        template, where = config.get("chat_template"), f"{cfg_path}: chat_template"
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            template, where = _read_template(jinja_path), jinja_path
        if isinstance(template, list):  # transformers' named-template list form
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{where} must be a string (a jinja template), got {type(template).__name__}")
        if template:
            _compile(template, where)  # a syntax error is reported now, naming the file, not at the first render
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            flags[key] = config.get(key) or False
            if not isinstance(flags[key], bool):
                raise CheckpointError(f"{cfg_path}: {key} must be true or false, got {config[key]!r}")
        known = {
            *SPECIAL_KEYS,
            "additional_special_tokens",
            "added_tokens_decoder",
            "chat_template",
            "add_bos_token",
            "add_eos_token",
        }
        tok = cls(
            proto,
            special_tokens=special,
            additional_special_tokens=list(dict.fromkeys(t for t in additional if t)),
            added_tokens=added,
            chat_template=template,
            extra_config={k: v for k, v in config.items() if k not in known},
            **flags,
        )
        tok.chat_template_source = where if template else "the built-in ERNIE chat template"
        tok._check_vocabulary(path)
        return tok

    def _check_vocabulary(self, path: str) -> None:
        """Added tokens must not take an id the sentencepiece model (or another added token) already
        uses for something else, and the end-of-text token must exist: either makes ids and text disagree."""
        by_id: dict[int, str] = {}
        for tok, tid in self.added_tokens.items():
            piece = self.sp.id_to_piece(tid) if tid < self.sp.get_piece_size() else by_id.get(tid, tok)
            if piece != tok:
                raise CheckpointError(
                    f"{path}: added token {tok!r} has id {tid}, which already belongs to {piece!r}; "
                    "fix added_tokens_decoder / added_tokens.json so every token has its own id"
                )
            by_id[tid] = tok
        if self.eos_token_id is None:
            raise CheckpointError(
                f"{path}: eos_token {self.eos_token!r} is not in the vocabulary; set eos_token in "
                "tokenizer_config.json to a token of tokenizer.model (ERNIE: </s>)"
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
        if i in self._id_to_added:
            return self._id_to_added[i]
        # an id between the sentencepiece pieces and a later added token names nothing: no text
        return self.sp.id_to_piece(i) if i < self.sp.get_piece_size() or i >= self.vocab_size else ""

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
        size, pieces = self.vocab_size, self.sp.get_piece_size()
        for i in (int(x) for x in ids):
            if not 0 <= i < size:
                raise DataError(
                    f"decode: token id {i} outside the vocabulary [0, {size}); check the model's vocab_size"
                )
            if i >= pieces and i not in self._id_to_added:
                continue  # between the pieces and a later added token: an id with no text (as transformers')
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
            values = {**self.special_tokens, **kwargs}
            text = render_template(
                self.chat_template, self.chat_template_source, messages, tools, add_generation_prompt, values
            )
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
# A chat template is code from the checkpoint: bound the work and memory of one render. Legit templates
# run a few hundred template lines per message; a nested range() loop would run for hours.
MAX_TEMPLATE_LINES = 2_000_000  # template source lines executed per render
MAX_TEMPLATE_CHARS = 64 << 20  # rendered text, and any string or list a template builds with * or **


class _TemplateLimit(Exception):
    """A render went past MAX_TEMPLATE_LINES / MAX_TEMPLATE_CHARS."""


def _too_big(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_CHARS:
        raise _TemplateLimit(f"{what} is too large ({n} elements, at most {MAX_TEMPLATE_CHARS})")


_FORMAT_SPEC = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def _check_format(fmt: str) -> None:
    """`'%2000000000s' % x` would allocate its width: widths and precisions are bounded."""
    for width, precision in _FORMAT_SPEC.findall(fmt):
        for n in (width, precision):
            if n == "*" or (n and int(n) > MAX_TEMPLATE_CHARS):
                raise _TemplateLimit(f"a % format width of {n} is too large")


def _checked_filters() -> dict[str, Any]:
    """The jinja filters whose arguments choose the size of what they build (center's width,
    replace's growth, join's separator, batch's fill...), checked before they build it."""
    from jinja2 import filters as f
    from jinja2 import pass_eval_context

    def center(value, width=80):
        _too_big(int(width), "center()")
        return f.do_center(value, width)

    def indent(s, width=4, first=False, blank=False):
        unit = len(width) if isinstance(width, str) else int(width)
        _too_big(len(str(s)) + unit * (str(s).count("\n") + 1), "indent()")
        return f.do_indent(s, width, first, blank)

    @pass_eval_context
    def replace(eval_ctx, s, old, new, count=None):
        text, old, new = str(s), str(old), str(new)
        hits = (len(text) + 1 if not old else text.count(old)) if count is None else min(int(count), len(text) + 1)
        _too_big(len(text) + hits * max(0, len(new) - len(old)), "replace()")
        return f.do_replace(eval_ctx, s, old, new, count)

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _too_big(len(str(d)) * max(0, len(items) - 1), "join()")
        return f.do_join(eval_ctx, items, d, attribute)

    def batch(value, linecount, fill_with=None):
        _too_big(int(linecount), "batch()")
        return f.do_batch(value, linecount, fill_with)

    def slice_(value, slices, fill_with=None):
        _too_big(int(slices), "slice()")
        return f.do_slice(value, slices, fill_with)

    def format_(value, *args, **kwargs):
        _check_format(str(value))
        return f.do_format(value, *args, **kwargs)

    return {
        "center": center,
        "indent": indent,
        "replace": replace,
        "join": join,
        "batch": batch,
        "slice": slice_,
        "format": format_,
    }


def _sandbox():
    """jinja2's immutable sandbox, with what could build a huge string or list checked first: `*`,
    `**`, `+`, `%` formatting, `~` (compiled to checked_concat) and the sizing filters."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b ~ c`
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Generator

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.filters.update(_checked_filters())

        @staticmethod
        def checked_concat(parts: tuple) -> str:
            texts = [str(p) for p in parts]
            _too_big(sum(map(len, texts)), "a ~ b")
            return "".join(texts)

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            sized = (str, list, tuple)
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, sized) and isinstance(n, int):
                    _too_big(len(seq) * n, f"{len(seq)} * {n}")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > 1 << 16:
                    raise _TemplateLimit(f"{left} ** {right} is too large")
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                _too_big(len(left) + len(right), "a + b")
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
            return super().call_binop(context, operator, left, right)

    return Sandbox


def _compile(template: str, where: str = "chat_template"):
    """Compile a chat template in a sandbox, with the options transformers uses (no constant folding:
    it would evaluate `'x' * 10**10` while compiling, outside the checks)."""
    if template not in _TEMPLATES:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        def raise_exception(message: str) -> None:
            raise DataError(f"chat template: {message}")

        env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            _TEMPLATES[template] = env.from_string(template)
        except (TemplateError, RecursionError, MemoryError) as e:
            raise CheckpointError(
                f"{where}: the chat template does not compile ({type(e).__name__}: {e}); fix it"
            ) from None
    return _TEMPLATES[template]


def _line_budget(limit: int):
    """A sys.settrace function counting the template's executed lines (only frames of compiled
    templates get a local tracer) and stopping the render past `limit`."""
    left = [limit]

    def local(frame, event, arg):
        if event == "line":
            left[0] -= 1
            if left[0] < 0:
                raise _TemplateLimit(f"more than {limit} template lines executed")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename == "<template>" else None

    return trace


def render_template(
    template: str, where: str, messages: list, tools: list | None, add_generation_prompt: bool, values: dict
) -> str:
    """Render a chat template from a checkpoint with bounded time and memory; every failure of the
    template (an error it raises, a Python error in it, too much work) is one DataError naming `where`."""
    import sys

    from erniekit.errors import ErniekitError

    compiled = _compile(template, where)
    trusted = template == ERNIE_CHAT_TEMPLATE  # ours: no need for the (slower) line count
    previous = sys.gettrace()
    if not trusted:
        sys.settrace(_line_budget(MAX_TEMPLATE_LINES))
    try:
        out, size = [], 0
        for chunk in compiled.generate(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **values
        ):
            size += len(chunk)
            if size > MAX_TEMPLATE_CHARS:
                raise _TemplateLimit(f"output over {MAX_TEMPLATE_CHARS} characters")
            out.append(chunk)
        return "".join(out)
    except _TemplateLimit as e:
        raise DataError(f"{where}: the chat template does too much work ({e}); fix the template") from None
    except ErniekitError:
        raise  # raise_exception() in the template: its own message
    except Exception as e:  # noqa: BLE001 - the template is code from the checkpoint; any error is its own
        raise DataError(
            f"{where}: the chat template cannot render these messages ({type(e).__name__}: {str(e)[:200]}); "
            "tool calls, tool results and reasoning need a template that renders them: chat_template: ernie_thinking"
        ) from None
    finally:
        if not trusted:
            sys.settrace(previous)


def default_tokenizer() -> ErnieTokenizer:
    """The small tokenizer shipped in erniekit/resources/tokenizer (see tools/make_tokenizer.py)."""
    return ErnieTokenizer.from_pretrained(RESOURCE_DIR)
