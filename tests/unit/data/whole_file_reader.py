"""The JSON reader before streaming, kept verbatim as the reference the streaming readers must equal:
`read_text` decodes the whole file, `_records` parses a JSON list or a .json file whole, `iter_records`
streamed only JSON lines in a file not named .json."""

import json
from collections.abc import Iterator

from erniekit.data.formats import _json_line, _not_utf8, _starts_with_bracket, _unreadable, iter_lines
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


def iter_records(path: str) -> Iterator[tuple[int, object]]:
    """`_records(path)`, with a JSON-lines file read a line at a time. A JSON list, or any .json file, is
    parsed whole."""
    if path.endswith(".json") or _starts_with_bracket(path):
        yield from _records(path)
        return
    for lineno, line in iter_lines(path):  # JSON lines end at \n only (U+2028 may sit in a string)
        if line.strip():
            yield lineno, _json_line(path, lineno, line)
