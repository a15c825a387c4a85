"""A JSON list, or a .json file, is read a block at a time (iter_records): the same records and the same
one-line errors as the whole-file reader it replaces (whole_file_reader.py, beside this file), wherever the
blocks end (inside a string, an escape, a number, a UTF-8 sequence). Its memory is tested in
test_pretrain_streaming.py."""

import json
import random

import pytest
import whole_file_reader

from erniekit.data.formats import iter_records
from erniekit.errors import DataError

BLOCKS = (1, 2, 3, 7, 64)  # bytes read at a time: every cut falls inside some token

STRINGS = ["", "plain", "caf\u00e9 \u4e2d\u6587", "emoji \U0001f600", 'quote " and \\ back', "line\nbreak\ttab"]
STRINGS += ["sep \u2028 \u2029 in a string", "ctrl \x01", "esc \u00e9\u0000"]
NUMBERS = [0, -1, 7, 12345678901234567890, 1.5, -0.25, 1e300, -2.5e-7, 1e5, float("inf"), float("-inf")]


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(STRINGS) * rng.randrange(1, 4)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(STRINGS)
    if kind in (4, 5):
        return {rng.choice(STRINGS) + str(i): _value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _dumps(rng: random.Random, value: object) -> str:
    """JSON text of `value` in one of several layouts: compact, spaced, indented, CRLF, blank lines."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, None, 0, 2]))
    if rng.random() < 0.3:
        text = text.replace("\n", rng.choice(["\r\n", "\n\n", "\n \t\r\n"]))  # newlines only lie between tokens
    return rng.choice(["", " ", "\n", "\r\n\t "]) + text + rng.choice(["", "\n", " \r\n\n"])


def _valid_list(rng: random.Random) -> str:
    items = [_value(rng) for _ in range(rng.randrange(6))]
    if rng.random() < 0.5:
        return _dumps(rng, items)
    sep = rng.choice([",", ", ", " ,\n", ",\r\n\r\n"])  # the list's own commas and blank lines
    return "[" + rng.choice(["", "\n", " "]) + sep.join(_dumps(rng, v) for v in items) + "]" + rng.choice(["", "\n"])


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` with one mistake: truncated, a byte dropped, inserted or not UTF-8, garbage after it."""
    i = rng.randrange(len(data) + 1)
    kind = rng.randrange(6)
    if kind == 0:
        return data[:i]
    if kind == 1:
        return data[:i] + data[i + 1 :]
    if kind == 2:
        return data[:i] + rng.choice([b",", b"]", b"[", b"{", b'"', b"\\", b":", b"x", b"-", b".", b"e"]) + data[i:]
    if kind == 3:
        return data[:i] + rng.choice([b"\xff", b"\xe9", b"\xe4\xb8", b"\xc3"]) + data[i:]
    if kind == 4:
        return data + rng.choice([b"x", b" ]", b"[]", b"\n{}", b"\x0c"])
    return rng.choice([b"\x0c", b"\xc2\xa0", b"\xef\xbb\xbf", b"\xe3\x80\x80"]) + data  # str.strip()'s spaces, a BOM


def _generated(n: int, seed: int) -> list[tuple[str, bytes]]:
    """(file name, bytes): JSON lists (also named .jsonl), one JSON value, JSON lines named .json."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        shape = rng.randrange(3)
        if shape == 0:
            name, text = rng.choice(["d.json", "d.jsonl"]), _valid_list(rng)
        elif shape == 1:
            name, text = "d.json", _dumps(rng, _value(rng))
        else:
            lines = [json.dumps(_value(rng), ensure_ascii=rng.random() < 0.5) for _ in range(rng.randrange(1, 5))]
            name, text = "d.json", rng.choice(["\n", "\r\n", "\n\n"]).join(lines)
        data = text.encode()
        out.append((f"{i}-{name}", _mutate(rng, data) if rng.random() < 0.6 else data))
    return out


EDGES = {
    "empty_list.json": b"[]",
    "empty_list_spaced.jsonl": b" \r\n[ \n ]\n",
    "open_only.json": b"[",
    "open_space.json": b"[ \n ",
    "missing_close.json": b'[{"a": 1},\n {"b": 2}',
    "trailing_comma.json": b"[1, 2,]",
    "trailing_garbage.json": b'[{"a": 1}]\n}',
    "two_lists.json": b"[1]\n[2]",
    "nested_lists.json": b"[[1, [2, [3]]], [], {}]",
    "scalars.json": b'[1, 23, -4.5e+10, 1e5, 0.5, "x", null, true, false, -Infinity, Infinity]',
    "number_then_letter.json": b"[12e, 1]",
    "deep_list.json": b"[" * 100_000,
    "deep_element.json": b"[" + b"[" * 100_000 + b"]" * 100_001,
    "deep_but_fine.json": b"[" + b"[" * 50 + b"]" * 51,
    "big_int.json": b'[{"a": 1' + b"0" * 5000 + b"}]",
    "big_int_then_float.json": b"[1" + b"0" * 5000 + b".5, 1" + b"0" * 10_000 + b".5]",
    "big_int_exponent.json": b"[1" + b"0" * 5000 + b"e-5000, 2]",
    "big_int_alone.json": b"1" + b"0" * 5000,
    "unterminated_string.json": b'[{"text": "abc}, {"text": "def"}]',
    "raw_newline_in_string.json": b'[{"text": "a\nb"}]',
    "u2028_in_strings.json": '[{"text": "a\u2028b"},\n{"text": "\u2029"}]'.encode(),
    "bad_escape.json": b'[{"text": "a\\qb"}]',
    "cut_unicode_escape.json": b'[{"text": "\\ud83d\\ude0',
    "lone_surrogate_escape.json": b'["\\ud83d", "\\ude00x"]',
    "not_utf8_in_list.json": b'[{"text": "ok"}, {"text": "caf\xe9"}]',
    "not_utf8_after_bad_json.json": b'[{"text": "ok"} {"text": "caf\xe9"}]',
    "not_utf8_before_bracket.json": b"\xff[1]",
    "cut_utf8_at_end.json": b'["\xe4\xb8',
    "gbk_list.jsonl": '[\n {"text": "\u4f60\u597d"}\n]\n'.encode("gbk"),
    "bom_list.json": b'\xef\xbb\xbf[{"a": 1}]',
    "bom_object.json": b'\xef\xbb\xbf{"a": 1}',
    "nbsp_before_list.json": b'\xc2\xa0[{"a": 1}]',
    "one_object.json": json.dumps({"text": "one"}, indent=2).encode(),
    "one_string.json": b' "just a string" \n',
    "object_then_more.json": b'{"a": 1}\n{"b": 2}\n\n',
    "lines_with_bad_line.json": b'{"a": 1}\n{"b": \n{"c": 3}\n',
    "lines_bad_line_and_bad_byte.json": b'{"a": 1}\n{"b": \n{"c": "\xff"}\n',
    "object_then_garbage.json": b'{"a": 1} x',
    "only_space.json": b" \n\t ",
    "empty.json": b"",
}


def _outcome(read, path: str):
    try:
        return list(read(path))
    except DataError as e:
        return f"DataError: {e}"


def _check_equal(tmp_path, cases) -> int:
    for name, data in cases:
        path = tmp_path / name
        path.write_bytes(data)
        want = _outcome(whole_file_reader.iter_records, str(path))
        for block in BLOCKS:
            got = _outcome(lambda p, b=block: iter_records(p, block=b), str(path))
            assert got == want, (name, block, data[:200])
    return len(cases)


def test_edge_cases_read_as_the_whole_file_reader_read_them(tmp_path):
    assert _check_equal(tmp_path, EDGES.items()) == len(EDGES)


@pytest.mark.parametrize("seed", range(4))
def test_generated_files_read_as_the_whole_file_reader_read_them(tmp_path, seed):
    cases = _generated(100, seed)
    _check_equal(tmp_path, cases)
    outcomes = [_outcome(whole_file_reader.iter_records, str(tmp_path / name)) for name, _ in cases]
    assert sum(isinstance(o, str) for o in outcomes) > 20 and sum(isinstance(o, list) for o in outcomes) > 40


def test_errors_name_the_line_and_column_across_blocks(tmp_path):
    """A mistake on line 3 of a list read in 2-byte blocks is named by its line and column in the file."""
    path = tmp_path / "d.json"
    path.write_bytes(b'[\n  {"text": "\xe4\xb8\xad"},\n  {"text": "b" "c"}\n]')
    records = iter_records(str(path), block=2)
    assert next(records) == (1, {"text": "\u4e2d"})
    with pytest.raises(DataError) as e:
        next(records)
    assert str(e.value) == f"{path}:3: invalid JSON (Expecting ',' delimiter at column 16); fix the file"


def test_a_record_longer_than_many_blocks(tmp_path):
    """One 3 MB element read in 64-byte blocks: read whole, in time linear in its length."""
    text = "\u4e2d" * 1_000_000
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": text}, 5]), encoding="utf-8")
    assert list(iter_records(str(path), block=64)) == [(1, {"text": "a"}), (2, {"text": text}), (3, 5)]


def test_json_lines_misnamed_json_are_read_a_line_at_a_time(tmp_path):
    """Only line 1 (the first value and what follows it) is read before the first record, so a .json of
    JSON lines streams like .jsonl: line 3's bad byte is met after records 1 and 2."""
    path = tmp_path / "d.json"
    path.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xe9"}\n')
    records = iter_records(str(path), block=4)
    assert [next(records), next(records)] == [(1, {"text": "a"}), (2, {"text": "b"})]
    with pytest.raises(DataError, match=r":3: not UTF-8 \(byte 0xe9 at byte offset 38\)"):
        next(records)
