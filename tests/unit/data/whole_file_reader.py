"""The JSON reader before streaming, kept verbatim (with the line helpers it used) as the reference the
streaming readers must equal: `read_text` decodes the whole file, `_records` parses a JSON list or a
.json file whole, `iter_records` streamed only JSON lines in a file not named .json."""

import codecs
import json
from collections.abc import Iterator

from erniekit.data.formats import _not_utf8, _unreadable
from erniekit.errors import DataError
from erniekit.utils.io import json_problem


def read_text(path: str) -> str:
    """The file's text; bytes that are not UTF-8 are a DataError naming file:line and the byte offset."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, data.count(b"\n", 0, e.start) + 1, data[e.start], e.start) from None


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of `path`, split at \\n only (the \\n dropped, a \\r kept) as
    `read_text(path).split("\\n")` gives them, but read a line at a time: memory holds one line, not the
    file. Bytes that are not UTF-8 are read_text's DataError (same line and byte offset)."""
    offset = 0
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):  # a UTF-8 sequence never holds the byte \n: a cut is safe
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, lineno, raw[e.start], offset + e.start) from None
                offset += len(raw)
                yield lineno, line[:-1] if line.endswith("\n") else line
    except OSError as e:
        raise _unreadable(path, e) from None


def _records(path: str) -> Iterator[tuple[int, object]]:
    """Yield (line, record) from a .jsonl file or a .json list (line = 1-based position)."""
    text = read_text(path)
    data = None
    if text.lstrip().startswith("["):  # a JSON list of records, whatever the extension
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise DataError(f"{path}{line}: invalid JSON ({json_problem(e)}); fix the file") from None
    elif path.endswith(".json"):  # one JSON object, or JSON lines misnamed .json
        try:
            data = [json.loads(text)]
        except (ValueError, RecursionError):  # read as JSON lines below, which names the line
            data = None
    if data is not None:
        if not isinstance(data, list):
            raise DataError(f"{path}:1: expected a JSON list of records, got {type(data).__name__}")
        yield from enumerate(data, 1)  # position in the list stands in for the line
        return
    for lineno, line in enumerate(text.split("\n"), 1):  # JSON lines end at \n only (U+2028 may sit in a string)
        if line.strip():
            yield lineno, _json_line(path, lineno, line)


def _json_line(path: str, lineno: int, line: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise DataError(f"{path}:{lineno}: invalid JSON ({json_problem(e)}); fix or remove this line") from None


def _starts_with_bracket(path: str, block: int = 1 << 16) -> bool:
    """Whether the file's first character after whitespace is "[" (a JSON list), reading only as far as it.
    Bytes that are not UTF-8 read as U+FFFD here: whichever reader follows names them."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        with open(path, "rb") as f:
            while data := f.read(block):
                text = decoder.decode(data).lstrip()
                if text:
                    return text.startswith("[")
    except OSError as e:
        raise _unreadable(path, e) from None
    return False


def iter_records(path: str) -> Iterator[tuple[int, object]]:
    """`_records(path)`, with a JSON-lines file read a line at a time. A JSON list, or any .json file, is
    parsed whole."""
    if path.endswith(".json") or _starts_with_bracket(path):
        yield from _records(path)
        return
    for lineno, line in iter_lines(path):  # JSON lines end at \n only (U+2028 may sit in a string)
        if line.strip():
            yield lineno, _json_line(path, lineno, line)
