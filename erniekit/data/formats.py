"""Dataset readers: validate every record up front and normalise to one internal form.

SFT formats (one record per line in .jsonl, or a JSON list in .json):
- erniekit: {"system"?: str, "src": [str, ...], "tgt": [str, ...], "label"?: [0|1, ...], "is_system"?: 0|1}
  src[i] is user turn i, tgt[i] the assistant reply; label[i] = 0 means "do not train on
  reply i". A bare string src/tgt is read as a one-turn list. "is_system": 1 (ERNIEKit) takes
  src[0] as the system prompt, dropping src[0], tgt[0] and label[0].
- alpaca:   {"instruction": str, "input"?: str, "output": str, "system"?: str,
             "history"?: [[query, reply], ...]}; the user turn is instruction + "\\n" + input.
- messages: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  (optional leading system, then user/assistant alternating, ending with assistant). A user
  content may be a list of OpenAI parts: {"type": "text", "text": ...} and
  {"type": "image_url", "image_url": {"url": path or data: URI}} and
  {"type": "video_url", "video_url": {"url": path}} (vision-language data).
  With tools: {"messages": [...], "tools": [...]} where assistant messages may carry
  "tool_calls" and "reasoning_content" (or reasoning inline as "<think>...</think>"), and "tool"
  messages the results (ERNIEKit's function-call data is this form); erniekit/data/tool_messages.py.
- sharegpt: {"conversations": [{"from": "human"|"gpt"|"function_call"|"observation", "value": str}],
  "system"?: str, "tools"?: str (JSON)}, as LLaMA-Factory reads it.
- any SFT record may carry `"control": {"attribute": "value", ...}`: control attributes rendered as a
  prefix line of the system part (erniekit/data/control.py).
- erniekit_vl: ERNIEKit's VL SFT records {"image_info": [{"image_url": str,
  "matched_text_index": i}], "text_info": [{"text": str, "tag": "mask"|"no_mask"}, ...]}:
  "mask" segments are prompts, "no_mask" the replies trained on; image j goes before text_info[i].
Image paths are relative to the data file's directory; images are decoded later, by the stage
that trains on them (VL-SFT).
Pretrain: .jsonl/.json records {"text": str}, or a plain-text file with one document per
non-empty line (use jsonl for documents that contain newlines).
LLaMA-Factory datasets: a path entry DIR/dataset_info.json:NAME (erniekit/data/dataset_info.py).

Every problem raises DataError naming the file and line. A record key its format does not read is
checked (`check_fields`): a near-miss of a field the record lacks ("inputs" for "input") is a
DataError, other keys (ids, metadata) are named in one warning per file and ignored.
"""

from __future__ import annotations

import codecs
import contextlib
import difflib
import functools
import json
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from erniekit.data.control import check_control, with_control
from erniekit.data.dataset_info import DatasetEntry, load_entry, parse_ref
from erniekit.data.tool_messages import check_tools, is_tool_dialog, normalize_dialog
from erniekit.errors import DataError
from erniekit.utils.io import json_problem
from erniekit.utils.registry import LiveChoices


@dataclass
class Conversation:
    """One SFT example: optional system prompt, (user, assistant) turns, which replies to train on."""

    system: str | None
    turns: list[tuple[str, str]]
    train_on: list[bool]
    source: str = field(default="", compare=False)  # "file:line", for error messages
    # image sources (paths or data: URIs) in the order of IMAGE_MARKERs in the user turns
    images: list[str] = field(default_factory=list)
    # video files in the order of VIDEO_MARKERs
    videos: list[str] = field(default_factory=list)
    # tool conversations (erniekit/data/tool_messages.py): the tool list and the whole normalised
    # message list (tool results, tool calls, reasoning); every assistant message in it is trained on
    tools: list[dict] = field(default_factory=list)
    dialog: list[dict] | None = None
    # control attributes (erniekit/data/control.py), rendered as a prefix line of the system part
    control: dict[str, str] = field(default_factory=dict)

    def messages(self) -> list[dict]:
        """The conversation as OpenAI-style messages (what the chat template renders)."""
        if self.dialog is not None:
            return with_control([dict(m) for m in self.dialog], self.control)
        out = [{"role": "system", "content": self.system}] if self.system else []
        for user, reply in self.turns:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return with_control(out, self.control)


IMAGE_MARKER = "<|IMAGE_PLACEHOLDER|>"  # where an image goes in a user turn (replaced by its tokens)
VIDEO_MARKER = "<|VIDEO_PLACEHOLDER|>"  # where a video goes


def _image_source(url: object, where: str, field_name: str) -> str:
    """A path (made absolute against the data file's directory) or a data: URI."""
    if not isinstance(url, str) or not url:
        raise DataError(f"{where}: {field_name} must be a non-empty string (a path or a data: URI)")
    if url.startswith("data:") or "://" in url or os.path.isabs(url):
        return url
    return os.path.join(os.path.dirname(os.path.abspath(where.rsplit(":", 1)[0])), url)


def _user_content(content: object, where: str, i: int, images: list[str], videos: list[str]) -> str:
    """A user message's text with IMAGE_MARKER / VIDEO_MARKER where its image / video parts were
    (their sources appended)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise DataError(f"{where}: field 'messages[{i}].content' must be a string or a non-empty list of parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), dict):
            images.append(
                _image_source(part["image_url"].get("url"), where, f"messages[{i}].content[{j}].image_url.url")
            )
            out.append(IMAGE_MARKER)
        elif kind == "video_url" and isinstance(part.get("video_url"), dict):
            url = _image_source(part["video_url"].get("url"), where, f"messages[{i}].content[{j}].video_url.url")
            videos.append(url)
            out.append(VIDEO_MARKER)
        else:
            raise DataError(
                f"{where}: messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}, "
                "{'type': 'image_url', 'image_url': {'url': str}} or {'type': 'video_url', 'video_url': {'url': str}}"
            )
    return "".join(out)


def split_paths(path: str) -> list[str]:
    """A dataset path may be one file or a comma-separated list; each must exist. An entry
    `DIR/dataset_info.json:NAME` is a LLaMA-Factory dataset (erniekit/data/dataset_info.py), checked here. A
    FIFO counts as a file (process substitution, /dev/fd/63): iter_records reads it once."""
    paths = [p.strip() for p in str(path).split(",") if p.strip()]
    if not paths:
        raise DataError("empty dataset path; set it to a .jsonl/.json file or a comma-separated list of files")
    for p in paths:
        ref = parse_ref(p)
        if ref is not None:
            load_entry(*ref)
        elif os.path.isdir(p) or not os.path.exists(p):
            where = "is a directory, not a file" if os.path.isdir(p) else "not found"
            raise DataError(f"dataset file {where}: {p} (cwd {os.getcwd()}); check the path or its spelling")
        elif is_device(p):
            raise DataError(f"dataset path is a device, not a file: {p}; point it at a .jsonl/.json/.txt file")
    return paths


def is_device(path: str) -> bool:
    """A character or block device (/dev/zero): a stream that never ends, never a dataset."""
    mode = os.stat(path).st_mode
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _unreadable(path: str, e: OSError) -> DataError:
    return DataError(f"{path}: cannot read the dataset file ({e.strerror}); check its permissions")


def _not_utf8(path: str, line: int, byte: int, offset: int) -> DataError:
    """An encoding mistake (a latin-1 or GBK export) named by file:line and byte offset, before the first step."""
    return DataError(
        f"{path}:{line}: not UTF-8 (byte 0x{byte:02x} at byte offset {offset}); "
        "re-save the file as UTF-8, e.g. iconv -f GBK -t UTF-8"
    )


@contextlib.contextmanager
def _binary(path: str) -> Iterator[BinaryIO]:
    """The file opened for reading bytes; an OSError while it is read is the one-line DataError."""
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as e:
        raise _unreadable(path, e) from None


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of `path`, split at \\n only (the \\n dropped, a \\r kept) as
    `text.split("\\n")` gives them, but read a line at a time: memory holds one line, not the file. The first
    byte that is not UTF-8 is a DataError naming its line and byte offset (`_not_utf8`)."""
    offset = 0
    with _binary(path) as f:
        for lineno, raw in enumerate(f, 1):  # a UTF-8 sequence never holds the byte \n: a cut is safe
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, lineno, raw[e.start], offset + e.start) from None
            offset += len(raw)
            yield lineno, line[:-1] if line.endswith("\n") else line


_BLOCK = 1 << 18  # bytes a JSON file is read in
_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace (str.isspace() knows more)
_STR_SPACE = re.compile(r"\s*")  # str.strip()'s whitespace: re's \s is str.isspace()
_DECODER = json.JSONDecoder()  # json.loads' settings
# How far past an error's position the C scanner may have looked ("-Infinity": 8 characters): an error
# closer than this to the end of the text read so far may come from the cut, and is read on past it.
_LOOKAHEAD = 16
_NUMBER_AT_END = re.compile(r"\d[.eE+-]{0,2}\Z")  # an integer the cut may have shortened (1e / 1. / 12)


class _JsonText:
    """A JSON file's text read a block at a time from one open stream (a FIFO is read once): `buf[pos:]` is not
    read yet, `more()` appends the next block. Lines and columns of errors count from the file's start, as
    json.loads(whole text) gives them."""

    def __init__(self, path: str, f: BinaryIO, block: int = _BLOCK):
        self.path, self._f, self._block = path, f, block
        self.buf, self.pos, self.eof = "", 0, False
        self._lines = 0  # "\n" before buf[0]
        self._col = 0  # characters from the last "\n" before buf[0] to buf[0]
        self._raw = b""  # bytes not decoded yet: a UTF-8 sequence cut by the block's end
        self._offset = 0  # byte offset of _raw[0] in the file
        self._raw_lines = 0  # b"\n" before _raw[0]
        self._bad: DataError | None = None  # the first byte that is not UTF-8, past the end of buf
        self._held = False  # looking_ahead: nothing is dropped, so pos can go back

    def _decode(self, data: bytes) -> str:
        """The text of `data` (after the bytes left over); b"" is the file's end. At a byte that is not UTF-8
        the text stops and the error waits in `_bad` until a reader needs what follows."""
        data, final = self._raw + data, not data
        try:
            text, used = codecs.utf_8_decode(data, "strict", final)
        except UnicodeDecodeError as e:
            line = self._raw_lines + data.count(b"\n", 0, e.start) + 1
            self._bad = _not_utf8(self.path, line, data[e.start], self._offset + e.start)
            text, used = data[: e.start].decode("utf-8"), len(data)  # nothing past it is decoded
        self._raw_lines += data.count(b"\n", 0, used)
        self._offset += used
        self._raw = data[used:]
        return text

    def more(self) -> bool:
        """Drop the text read, append at least one more character; False at the end of the file. A block
        as long as what is kept at least (a value longer than a block is decoded in O(its length))."""
        if self._append():
            return True
        if self._bad is not None:
            raise self._bad
        return False

    def _append(self) -> bool:
        """more(), but False at a byte that is not UTF-8 too (its error waits in `_bad`)."""
        if self.eof:
            return False
        if not self._held:
            self._drop_read()
        while self._bad is None:
            data = self._f.read(max(self._block, len(self.buf)))
            text = self._decode(data)
            if text:
                self.buf += text
                return True
            self.eof = not data and self._bad is None
            if self.eof:
                return False
        return False

    def _drop_read(self) -> None:
        """Forget buf[:pos], counting its lines for the errors' line and column."""
        cut = self.pos
        newlines = self.buf.count("\n", 0, cut)
        self._col = cut - self.buf.rfind("\n", 0, cut) - 1 if newlines else self._col + cut
        self._lines += newlines
        self.buf, self.pos = self.buf[cut:], 0

    def peek(self) -> str:
        """The character at pos ("" at the end of the file)."""
        while self.pos >= len(self.buf):
            if not self.more():
                return ""
        return self.buf[self.pos]

    def skip_space(self) -> None:
        """Move pos past JSON whitespace, reading on as needed."""
        while True:
            self.pos = _JSON_SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.more():
                return

    def value(self) -> object:
        """The JSON value at pos (pos moves past it), read on past the end of the block while its end, or
        an error, may come from the cut. Raises what json.loads would (positions in buf); a RecursionError
        is met at a bracket in buf, so the whole text has it too."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:  # "Unterminated string" is said at its start, wherever the cut
                if self.eof or (not e.msg.startswith("Unterminated string") and e.pos + _LOOKAHEAD <= len(self.buf)):
                    raise
            except ValueError:  # an integer past the digit limit: complete unless buf ends in its digits
                if self.eof or not _NUMBER_AT_END.search(self.buf):
                    raise
            else:
                if self.eof or end + 3 <= len(self.buf):  # a number ends where 3 more characters say so
                    self.pos = end
                    return value
            self.more()

    def invalid(self, e: ValueError | RecursionError) -> DataError:
        """`e` as json.loads on the whole text reports it, unless a byte of the file is not UTF-8: that error
        comes first, as when the whole file was decoded before it was parsed."""
        self.check_rest_utf8()
        if not isinstance(e, json.JSONDecodeError):
            return DataError(f"{self.path}: invalid JSON ({json_problem(e)}); fix the file")
        line = self._lines + self.buf.count("\n", 0, e.pos) + 1
        newline = self.buf.rfind("\n", 0, e.pos)
        column = e.pos - newline if newline >= 0 else self._col + e.pos + 1
        return DataError(f"{self.path}:{line}: invalid JSON ({e.msg} at column {column}); fix the file")

    def check_rest_utf8(self) -> None:
        """Raise the not-UTF-8 DataError of the first such byte past what was read, if there is one."""
        while self._bad is None and not self.eof:
            data = self._f.read(self._block)
            self._decode(data)
            self.eof = not data
        if self._bad is not None:
            raise self._bad

    def starts_list(self) -> bool:
        """Whether the first character past str.strip()'s whitespace is "[" (a JSON list), reading only as far
        as it; a byte that is not UTF-8 is not "[" (whichever reader follows names it). pos stays at the start
        of that character's line: only whole lines of JSON whitespace before it are dropped."""
        seen = self.pos  # buf[pos:seen] is whitespace
        while True:
            seen = _STR_SPACE.match(self.buf, seen).end()
            if seen < len(self.buf):
                return self.buf[seen] == "["
            blank = _JSON_SPACE.match(self.buf, self.pos).end()
            self.pos = self.buf.rfind("\n", self.pos, blank) + 1 or self.pos
            seen -= self.pos  # where it is once _append dropped buf[:pos]
            if not self._append():
                return False

    @contextlib.contextmanager
    def looking_ahead(self) -> Iterator[None]:
        """Read on keeping every character, then go back to pos as it was (telling the file's shape)."""
        start, self._held = self.pos, True
        try:
            yield
        finally:
            self.pos, self._held = start, False

    def lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text) of each line from pos (the start of a line) to the end of the file, as
        iter_lines gives them: split at \\n only, memory holding a block and a line; a byte that is not UTF-8
        is the DataError of iter_lines, at the same line."""
        lineno = self._lines + self.buf.count("\n", 0, self.pos) + 1
        while True:
            newline = self.buf.find("\n", self.pos)
            if newline >= 0:
                yield lineno, self.buf[self.pos : newline]
                self.pos, lineno = newline + 1, lineno + 1
            elif not self.more():
                if self.pos < len(self.buf):
                    yield lineno, self.buf[self.pos :]
                return


def _json_list(text: _JsonText) -> Iterator[tuple[int, object]]:
    """(position, element) of a JSON list, one element at a time: memory holds a block and the element
    being read, not the file. Errors as json.loads on the whole text: the first in the text, but a byte
    that is not UTF-8 anywhere in the file before them (the whole file was decoded first)."""
    try:
        yield from enumerate(_list_elements(text), 1)  # position in the list stands in for the line
        text.skip_space()
        if text.peek():
            raise json.JSONDecodeError("Extra data", text.buf, text.pos)
    except (ValueError, RecursionError) as e:
        raise text.invalid(e) from None


def _list_elements(text: _JsonText) -> Iterator[object]:
    """The elements of the list at the start of `text`, checked as json's C scanner checks them."""
    text.skip_space()
    if text.peek() != "[":  # a character str.strip() takes for space and JSON does not (\x0c, U+3000)
        raise json.JSONDecodeError("Expecting value", text.buf, text.pos)
    text.pos += 1
    text.skip_space()
    if text.peek() == "]":
        text.pos += 1
        return
    while True:
        yield text.value()
        text.skip_space()
        c = text.peek()
        if c != "," and c != "]":  # "" at the end of the file
            raise json.JSONDecodeError("Expecting ',' delimiter", text.buf, text.pos)
        text.pos += 1
        if c == "]":
            return
        text.skip_space()


_LINES = object()  # _single_value: the file is not one JSON value


def _single_value(text: _JsonText) -> object:
    """The file's JSON value when it holds exactly one (and only whitespace after it), else _LINES: the
    JSON lines it holds are then read from where this began (the text it read is kept). Reads as far as
    the first value and what follows it."""
    with text.looking_ahead():
        text.skip_space()  # a byte-order mark is no value: the lines that follow name it
        try:
            value = text.value()
        except (ValueError, RecursionError):
            return _LINES
        text.skip_space()
        return _LINES if text.peek() else value


def _json_lines(text: _JsonText, utf8_first: bool = False) -> Iterator[tuple[int, object]]:
    """(line, record) of each non-blank line, read a line at a time (JSON lines end at \\n only: U+2028
    may sit in a string). utf8_first: a line that is not JSON is named only when no byte of the rest of
    the file is not UTF-8 (the order of the whole-file reader; the lines before it were UTF-8)."""
    for lineno, line in text.lines():
        if not line.strip():
            continue
        try:
            rec = _json_line(text.path, lineno, line)
        except DataError:
            if utf8_first:
                text.check_rest_utf8()
            raise
        yield lineno, rec


def _json_line(path: str, lineno: int, line: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise DataError(f"{path}:{lineno}: invalid JSON ({json_problem(e)}); fix or remove this line") from None


def iter_records(path: str, block: int = _BLOCK) -> Iterator[tuple[int, object]]:
    """(line, record) of a data file, one record at a time, memory holding one record and a block (bytes
    read at once), not the file: JSON lines; a JSON list, whatever the extension (line = position in the
    list); a .json file holding one JSON value (record 1), or else JSON lines misnamed .json. Errors name
    file:line; a byte that is not UTF-8 is named before a JSON error of a .json file or list. The file is
    opened once and read once, its shape told from its first block: a FIFO (train_dataset_path=/dev/fd/63)
    or a file replaced while it is read gives one consistent text."""
    with _binary(path) as f:
        text = _JsonText(path, f, block)
        if text.starts_list():
            yield from _json_list(text)
            return
        value = _single_value(text) if path.endswith(".json") else _LINES
        if value is _LINES:
            yield from _json_lines(text, utf8_first=path.endswith(".json"))
        else:
            yield 1, value


_TYPO_CUTOFF = 0.8  # difflib ratio: "inputs"/"input" 0.91, "sytem"/"system" 0.91, "lable"/"label" 0.8


@functools.lru_cache(maxsize=1024)
def _misspelled(keys: frozenset[str], known: frozenset[str]) -> tuple[str, str] | None:
    """(key, field): a key of a record that looks like a misspelling of a field the record lacks. A key
    holding the field as a word ("prompt_id", "is_system") names something else, as does any key
    beside a record's own copy of the field."""
    missing = sorted(known - keys)
    for key in sorted(keys - known):
        words = set(re.split(r"[^a-z0-9]+", key.lower()))
        for near in difflib.get_close_matches(key.lower(), missing, n=3, cutoff=_TYPO_CUTOFF):
            if len(words) == 1 or near not in words:
                return key, near
    return None


def check_fields(rec: dict, known: frozenset[str] | None, where: str, ignored: set[str]) -> None:
    """Raise on a misspelled field of `rec` (a typo silently changes what trains: alpaca "inputs"
    drops the input, erniekit "lable" trains a masked reply); add its other unread keys (ids,
    metadata) to `ignored`, for one `warn_ignored` per file. known=None: not checked."""
    if known is None:
        return
    extra = rec.keys() - known  # the common case, every key known, costs this set difference
    if not extra:
        return
    typo = _misspelled(frozenset(rec), known)
    if typo is not None:
        raise DataError(f"{where}: unknown field '{typo[0]}'; did you mean '{typo[1]}'?")
    ignored.update(extra)


def warn_ignored(path: str, fmt: str, ignored: set[str]) -> None:
    """One warning per file naming the keys no reader of its format reads."""
    if ignored:
        warnings.warn(
            f"{path}: fields {sorted(ignored)} are not read by the {fmt} format and are ignored", stacklevel=3
        )


def _str(rec: dict, key: str, where: str, required: bool = True) -> str | None:
    value = rec.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        what = "missing" if key not in rec else f"must be a string, got {type(value).__name__}"
        raise DataError(f"{where}: field '{key}' {what}")
    return value


def _str_list(rec: dict, key: str, where: str) -> list[str]:
    value = rec.get(key)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        what = "missing" if key not in rec else "must be a non-empty list of strings"
        raise DataError(f"{where}: field '{key}' {what}")
    return value


def _from_erniekit(rec: dict, where: str) -> Conversation:
    src, tgt = _str_list(rec, "src", where), _str_list(rec, "tgt", where)
    if len(src) != len(tgt):
        raise DataError(f"{where}: 'src' has {len(src)} turns but 'tgt' has {len(tgt)}; they must pair up")
    label = rec.get("label")
    if label is None:
        train_on = [True] * len(tgt)
    elif (
        isinstance(label, list)
        and len(label) == len(tgt)
        and all(v in (0, 1) and not isinstance(v, float) for v in label)
    ):
        train_on = [bool(v) for v in label]
    else:
        raise DataError(f"{where}: field 'label' must be a list of {len(tgt)} values 0/1 (one per tgt turn)")
    system = _str(rec, "system", where, required=False)
    if src_is_system(rec, src, system, where):
        system, src, tgt, train_on = src[0] or None, src[1:], tgt[1:], train_on[1:]
    return Conversation(system, list(zip(src, tgt)), train_on, where)


def src_is_system(rec: dict, src: list, system: str | None, where: str) -> bool:
    """ERNIEKit's `is_system: 1` (SFT and preference records): src[0] is the system prompt and tgt[0]
    its placeholder reply, both to drop; checked as 0 or 1, with a user turn after, and not beside
    a `system` field."""
    is_system = rec.get("is_system", 0)
    if is_system not in (0, 1) or isinstance(is_system, (bool, float)):
        raise DataError(f"{where}: field 'is_system' must be 0 or 1, got {is_system!r}")
    if is_system == 1:
        if len(src) < 2:
            raise DataError(f"{where}: 'is_system': 1 needs src[0] as the system prompt plus at least one user turn")
        if system:
            raise DataError(f"{where}: 'system' and 'is_system': 1 both give a system prompt; keep one")
    return is_system == 1


def _from_alpaca(rec: dict, where: str) -> Conversation:
    instruction, output = _str(rec, "instruction", where), _str(rec, "output", where)
    extra = _str(rec, "input", where, required=False)
    query = f"{instruction}\n{extra}" if extra else instruction
    history = rec.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(h, (list, tuple)) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in history
    ):
        raise DataError(f"{where}: field 'history' must be a list of [query, reply] string pairs")
    turns = [(q, a) for q, a in history] + [(query, output)]
    return Conversation(_str(rec, "system", where, required=False), turns, [True] * len(turns), where)


def dialog_conversation(msgs: list, tools: object, where: str) -> Conversation:
    """A conversation with tools, tool calls, tool results or reasoning (normalised, checked)."""
    tool_list = check_tools(tools, where)
    dialog = normalize_dialog(msgs, where, tool_list, end="assistant")
    system = dialog[0]["content"] if dialog[0]["role"] == "system" else None
    users = [m["content"] for m in dialog if m["role"] == "user"]
    final = dialog[-1].get("content") or ""
    return Conversation(system, [(users[-1], final)], [True], where, tools=tool_list, dialog=dialog)


def _from_messages(rec: dict, where: str) -> Conversation:
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field 'messages' {'missing' if msgs is None else 'must be a non-empty list'}")
    if is_tool_dialog(msgs, rec.get("tools")):
        return dialog_conversation(msgs, rec.get("tools"), where)
    images: list[str] = []
    videos: list[str] = []
    for i, m in enumerate(msgs):
        user_parts = isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), list)
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or not (isinstance(m.get("content"), str) or user_parts)
        ):
            raise DataError(
                f"{where}: field 'messages[{i}]' must be {{'role': 'system'|'user'|'assistant', 'content': str}}"
                " (a user content may also be a list of text / image_url parts)"
            )
    msgs = [dict(m, content=_user_content(m["content"], where, i, images, videos)) for i, m in enumerate(msgs)]
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
    body = msgs[1:] if system is not None else msgs
    roles = [m["role"] for m in body]
    expected = ["user", "assistant"] * (len(body) // 2)
    if roles != expected or not body:
        raise DataError(
            f"{where}: field 'messages' roles {roles} must alternate user/assistant after an optional system and end with assistant"
        )
    turns = [(body[i]["content"], body[i + 1]["content"]) for i in range(0, len(body), 2)]
    return Conversation(system, turns, [True] * len(turns), where, images, videos)


def _from_erniekit_vl(rec: dict, where: str) -> Conversation:
    """ERNIEKit's VL SFT record: text segments tagged mask (prompt) / no_mask (reply), images placed
    before the text segment they name."""
    texts, infos = rec.get("text_info"), rec.get("image_info") or []
    if not isinstance(texts, list) or not texts:
        raise DataError(
            f"{where}: field 'text_info' must be a non-empty list of {{'text': str, 'tag': 'mask'|'no_mask'}}"
        )
    if not isinstance(infos, list):
        raise DataError(
            f"{where}: field 'image_info' must be a list of {{'image_url': str, 'matched_text_index': int}}"
        )
    before: dict[int, list[str]] = {}
    for j, info in enumerate(infos):
        idx = info.get("matched_text_index", 0) if isinstance(info, dict) else None
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(texts):
            raise DataError(
                f"{where}: image_info[{j}].matched_text_index must be an index into text_info (0..{len(texts) - 1})"
            )
        before.setdefault(idx, []).append(_image_source(info.get("image_url"), where, f"image_info[{j}].image_url"))
    turns: list[list[str]] = []  # [prompt, reply] pairs built from runs of tags
    images: list[str] = []
    for i, seg in enumerate(texts):
        if (
            not isinstance(seg, dict)
            or not isinstance(seg.get("text"), str)
            or seg.get("tag") not in ("mask", "no_mask")
        ):
            raise DataError(f"{where}: text_info[{i}] must be {{'text': str, 'tag': 'mask'|'no_mask'}}")
        reply = seg["tag"] == "no_mask"
        if reply and i in before:
            raise DataError(
                f"{where}: image_info places an image in reply text_info[{i}]; images go in prompts (tag mask)"
            )
        text = IMAGE_MARKER * len(before.get(i, [])) + seg["text"]
        images += before.get(i, [])
        if not reply and (not turns or turns[-1][1]):
            turns.append([text, ""])
        elif not reply:
            turns[-1][0] += text
        elif not turns:
            raise DataError(f"{where}: text_info starts with a reply (no_mask); it must start with a prompt (mask)")
        else:
            turns[-1][1] += text
    if not turns[-1][1]:
        raise DataError(f"{where}: text_info ends with a prompt (mask); the last segment must be a reply (no_mask)")
    return Conversation(None, [(a, b) for a, b in turns], [True] * len(turns), where, images)


_READERS: dict[str, Callable[[dict, str], Conversation]] = {}
_DETECTORS: dict[str, Callable[[dict], bool]] = {}


_FIELDS: dict[str, frozenset[str] | None] = {}  # format -> the record keys its reader reads (None: unchecked)


def register_sft_format(name: str, detect: Callable[[dict], bool], fields: Iterable[str] | None = None):
    """Decorator: `reader(record, "file:line") -> Conversation` reads SFT format `name`, a valid
    `train_dataset_type` / `eval_dataset_type` from then on; `detect(record)` says whether a record
    is in it (auto-detection asks the formats in registration order). `fields`: every record key the
    reader reads ("control" is added), so that a misspelled one is an error (`check_fields`); None
    leaves the format's keys unchecked. CONTRIBUTING.md: adding a format."""

    def add(reader: Callable[[dict, str], Conversation]) -> Callable[[dict, str], Conversation]:
        _READERS[name] = _reading_control(reader)
        _DETECTORS[name] = detect
        _FIELDS[name] = None if fields is None else frozenset(fields) | {"control"}
        return reader

    return add


def _reading_control(reader: Callable[[dict, str], Conversation]) -> Callable[[dict, str], Conversation]:
    """Every SFT format takes a record's optional `"control": {attribute: value}` the same way."""

    def read(rec: dict, where: str) -> Conversation:
        conv = reader(rec, where)
        conv.control = check_control(rec.get("control"), where)
        return conv

    return read


def unregister_sft_format(name: str) -> None:
    _READERS.pop(name, None)
    _DETECTORS.pop(name, None)
    _FIELDS.pop(name, None)


def sft_format_names() -> list[str]:
    return list(_READERS)


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


def _from_sharegpt(rec: dict, where: str) -> Conversation:
    """ShareGPT / LLaMA-Factory records: {"conversations": [{"from": human|gpt|function_call|observation,
    "value": str}], "system"?: str, "tools"?: JSON string}; a function_call value is a JSON call
    {"name", "arguments"} or a list of them (parallel calls)."""
    turns = rec.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of {{'from', 'value'}}")
    msgs: list[dict] = []
    if rec.get("system") is not None:
        msgs.append({"role": "system", "content": _str(rec, "system", where)})
    for i, t in enumerate(turns):
        who = t.get("from") if isinstance(t, dict) else None
        if who not in _SHAREGPT_ROLES or not isinstance(t.get("value"), str):
            raise DataError(
                f"{where}: conversations[{i}] must be {{'from': {'|'.join(_SHAREGPT_ROLES)}, 'value': str}}"
            )
        if who == "function_call":
            try:
                calls = json.loads(t["value"])
            except (ValueError, RecursionError) as e:
                raise DataError(
                    f"{where}: conversations[{i}] function_call value is not JSON ({json_problem(e)})"
                ) from None
            calls = calls if isinstance(calls, list) else [calls]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{"function": c} for c in calls]})
        else:
            msgs.append({"role": _SHAREGPT_ROLES[who], "content": t["value"]})
    return dialog_conversation(msgs, rec.get("tools"), where)


register_sft_format("messages", lambda rec: "messages" in rec, ("messages", "tools"))(_from_messages)
register_sft_format("sharegpt", lambda rec: "conversations" in rec, ("conversations", "system", "tools"))(
    _from_sharegpt
)
register_sft_format(
    "alpaca", lambda rec: "instruction" in rec, ("instruction", "input", "output", "system", "history")
)(_from_alpaca)
register_sft_format(
    "erniekit", lambda rec: "src" in rec or "tgt" in rec, ("src", "tgt", "label", "system", "is_system")
)(_from_erniekit)
register_sft_format("erniekit_vl", lambda rec: "text_info" in rec or "image_info" in rec, ("text_info", "image_info"))(
    _from_erniekit_vl
)


def detect_format(rec: object, where: str) -> str:
    """Guess the SFT format from a record's keys."""
    if isinstance(rec, dict):
        for name, detect in _DETECTORS.items():
            if detect(rec):
                return name
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(
        f"{where}: cannot tell the data format from keys {keys}; use erniekit (src/tgt), alpaca (instruction/output)"
        f", messages{''.join(f', {n}' for n in _READERS if n not in ('messages', 'alpaca', 'erniekit'))} or set "
        "train_dataset_type"
    )


def iter_load_records(
    path: str,
    fmt: str,
    readers: dict[str, Callable[[dict, str], Any]],
    detect: Callable[[object, str], str],
    label: str = "data",
    kind: str = "examples",
    ranking: bool = False,
    fields: dict[str, frozenset[str] | None] | None = None,
) -> Iterator[Any]:
    """Read the JSON records of the (comma-separated) files at `path` through `readers[fmt]`, one at a time
    (a file is never held whole: iter_records), detecting the format per file when fmt == "auto"; shared by
    SFT, preference (`ranking`) and prompt data. A dataset_info.json entry's records are mapped onto
    `readers`' own keys first. `fields`: format -> the keys its reader reads, for `check_fields` (None: keys
    unchecked, as RL prompt data, whose other keys are reward fields). A reader may stop early (eval
    --routing --max-samples)."""
    if fmt != "auto" and fmt not in readers:
        raise DataError(f"unknown {label} format '{fmt}'; use one of {', '.join(['auto', *readers])}")
    for p in split_paths(path):
        ref = parse_ref(p)
        if ref is not None:
            yield from _entry_records(load_entry(*ref), fmt, readers, label, kind, ranking)
            continue
        file_fmt = None if fmt == "auto" else fmt
        ignored: set[str] = set()
        empty = True
        for lineno, rec in iter_records(p):
            where = f"{p}:{lineno}"
            if file_fmt is None:
                file_fmt = detect(rec, where)
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            check_fields(rec, fields.get(file_fmt) if fields else None, where, ignored)
            empty = False
            yield readers[file_fmt](rec, where)
        if empty:
            raise DataError(f"{p}: no {kind}; the file is empty or has only blank lines")
        warn_ignored(p, file_fmt, ignored)


def load_records(*args: Any, **kwargs: Any) -> list:
    """iter_load_records(same arguments) as a list, for callers that count or index the records."""
    return list(iter_load_records(*args, **kwargs))


def _entry_records(entry: DatasetEntry, fmt: str, readers: dict, label: str, kind: str, ranking: bool) -> Iterator:
    """The records of a LLaMA-Factory dataset, each mapped by its columns / tags and read by our reader."""
    if entry.ranking and not ranking:
        raise DataError(
            f"{entry.where} has ranking: true (chosen / rejected pairs): train it with stage DPO, "
            f"or give {label} without ranking"
        )
    if ranking and not entry.ranking:
        raise DataError(
            f"{entry.where} has no ranking: true; DPO needs pairs: set ranking: true and columns chosen / rejected"
        )
    target = entry.reader_format(ranking)
    if target not in readers:
        raise DataError(f"{entry.where}: {entry.formatting} records cannot be read as {label}; use alpaca formatting")
    if fmt not in ("auto", target):
        raise DataError(
            f"{entry.where}: its formatting ({entry.formatting}) sets the format; set the dataset type to auto, not {fmt}"
        )
    for file in entry.files:
        seen: set[str] = set()
        empty = True
        for lineno, rec in iter_records(file):
            where = f"{file}:{lineno}"
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            seen.update(rec)
            mapped = entry.to_record(rec, where)
            if "control" in rec:  # control attributes travel whatever the columns map
                mapped["control"] = rec["control"]
            empty = False
            yield readers[target](mapped, where)
        if empty:
            raise DataError(f"{file}: no {kind}; the file is empty or has only blank lines")
        entry.check_columns_seen(seen, file)


def load_sft_examples(path: str, fmt: str = "auto") -> list[Conversation]:
    """Read and validate SFT files (comma-separated list allowed); auto-detects per file."""
    return load_records(path, fmt, _READERS, detect_format, fields=_FIELDS)


def iter_sft_examples(path: str, fmt: str = "auto") -> Iterator[Conversation]:
    """load_sft_examples one conversation at a time."""
    return iter_load_records(path, fmt, _READERS, detect_format, fields=_FIELDS)


_PRETRAIN_FIELDS = frozenset({"text"})


def iter_pretrain_texts(path: str) -> Iterator[str]:
    """Pretraining documents of the (comma-separated) files at `path`, in order, one at a time: .jsonl
    ({"text": ...} records) and plain-text files (one document per non-empty line) are read a line at a
    time, a JSON list an element at a time (iter_records), so memory holds one document, never the
    corpus. A dataset_info.json entry reads its alpaca prompt column."""
    for p in split_paths(path):
        empty = True
        for text in _file_texts(p):
            empty = False
            yield text
        if empty:
            raise DataError(f"{p}: no examples; the file is empty or has only blank lines")


def load_pretrain_texts(path: str) -> list[str]:
    """Every pretraining document of `path` in a list (iter_pretrain_texts); training streams them instead."""
    return list(iter_pretrain_texts(path))


def _file_texts(p: str) -> Iterator[str]:
    ref = parse_ref(p)
    if ref is not None:
        yield from _entry_texts(load_entry(*ref))
    elif p.endswith((".jsonl", ".json")):
        yield from _record_texts(p)
    else:
        for _, line in iter_lines(p):
            if line.strip():
                yield line.rstrip("\r")


def _entry_texts(entry: DatasetEntry) -> Iterator[str]:
    """The prompt column of a LLaMA-Factory alpaca dataset's records, as its pretraining reads it."""
    if entry.formatting != "alpaca" or entry.ranking:
        raise DataError(
            f"{entry.where}: pretraining reads an alpaca dataset's prompt column (e.g. columns: "
            "{prompt: text}); sharegpt and ranking data are not pretraining data"
        )
    for file in entry.files:
        for n, rec in iter_records(file):
            yield entry.text(rec if isinstance(rec, dict) else {}, f"{file}:{n}")


def _record_texts(p: str) -> Iterator[str]:
    """The "text" of each record of a .jsonl / .json file; other keys named in one warning at its end."""
    ignored: set[str] = set()
    for lineno, rec in iter_records(p):
        where = f"{p}:{lineno}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object with a 'text' field, got {type(rec).__name__}")
        check_fields(rec, _PRETRAIN_FIELDS, where, ignored)
        yield _str(rec, "text", where)
    warn_ignored(p, "pretraining text", ignored)


def dataset_type_spellings() -> dict[str, str]:
    """lower-case spelling -> dataset type: auto, text (pretraining), prompt (preference / RL data)
    and every registered SFT format."""
    return {n.lower(): n for n in ("auto", "text", "prompt", *_READERS)}


DATASET_TYPE_SPELLINGS = LiveChoices(dataset_type_spellings)  # train_dataset_type / eval_dataset_type choices
