"""Pretraining documents are read a line at a time, a JSON list an element at a time (iter_pretrain_texts):
the same documents, warnings and errors as the whole-file reader they replace, with memory that does not
grow with the corpus."""

import json
import tracemalloc
import warnings

import pytest
from whole_file_reader import _records, read_text

from erniekit.data.formats import (
    _PRETRAIN_FIELDS,
    _str,
    check_fields,
    iter_pretrain_texts,
    load_pretrain_texts,
    split_paths,
    warn_ignored,
)
from erniekit.errors import DataError


def _whole_file_texts(path: str) -> list[str]:
    """The reader before streaming (every file read whole by read_text), kept here as the reference."""
    texts: list[str] = []
    for p in split_paths(path):
        before = len(texts)
        if p.endswith((".jsonl", ".json")):
            ignored: set[str] = set()
            for lineno, rec in _records(p):
                where = f"{p}:{lineno}"
                if not isinstance(rec, dict):
                    raise DataError(f"{where}: expected a JSON object with a 'text' field, got {type(rec).__name__}")
                check_fields(rec, _PRETRAIN_FIELDS, where, ignored)
                texts.append(_str(rec, "text", where))
            warn_ignored(p, "pretraining text", ignored)
        else:
            texts.extend(line.rstrip("\r") for line in read_text(p).split("\n") if line.strip())
        if len(texts) == before:
            raise DataError(f"{p}: no examples; the file is empty or has only blank lines")
    return texts


def _outcome(fn, path: str):
    """(documents or the error's text, the warnings' texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(path)
        except DataError as e:
            out = f"DataError: {e}"
    return out, [str(w.message) for w in caught]


CASES = {
    "crlf.txt": b"first doc\r\nsecond doc  \r\n\r\n   \r\nthird\r\n",
    "blank_lines.txt": b"\n\n  one  \n\t\n\ntwo\n\n",
    "no_final_newline.txt": "a\nlast line, no newline: \u00e9\u4e2d".encode(),
    "separators.txt": "keeps U+2028 \u2028 and \x0c inside a line\nnext\x1c\n".encode(),
    "bom.txt": "\ufeffwith a byte-order mark\nplain\n".encode(),
    "only_blank.txt": b"\n  \n\r\n",
    "empty.txt": b"",
    "extra_fields.jsonl": b'{"text": "doc one", "id": 1}\r\n\n{"text": "two\\nlines", "meta": {"u": 1}}',
    "list_in.jsonl": b'  \n[{"text": "from a list"}, {"text": "second"}]\n',
    "list.json": b'[{"text": "a"}, {"text": "b", "src": "x"}]',
    "object.json": b'{"text": "one object"}',
    "lines_misnamed.json": b'{"text": "a"}\n{"text": "b"}\n',
    "typo.jsonl": b'{"text": "ok"}\n{"txt": "typo"}\n',
    "not_object.jsonl": b'{"text": "ok"}\n[1, 2]\n',
    "bad_json.jsonl": b'{"text": "ok"}\n\n{"text": \n',
    "latin1_line3.txt": b"ok\nfine\ncaf\xe9 au lait\nafter\n",
    "latin1_line2.jsonl": b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
    "cut_utf8_at_eol.txt": b"ok\nhalf \xe4\xb8\nnext\n",
    "gbk_list_in.jsonl": '[\n {"text": "\u4f60\u597d"}\n]\n'.encode("gbk"),  # a list: "not UTF-8", not line 1's JSON
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_reader_equals_the_whole_file_reader(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(CASES[name])
    got, want = _outcome(load_pretrain_texts, str(path)), _outcome(_whole_file_texts, str(path))
    assert got == want
    docs, _ = got
    assert docs and (isinstance(docs, list) or "\n" not in docs)


def test_errors_name_the_line_and_byte(tmp_path):
    """The non-UTF-8 message (file:line and byte offset), 'no examples' and the typo check, as before."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"ok\nfine\ncaf\xe9 au lait\n")
    with pytest.raises(DataError) as e:
        load_pretrain_texts(str(bad))
    assert str(e.value) == (
        f"{bad}:3: not UTF-8 (byte 0xe9 at byte offset 11); re-save the file as UTF-8, e.g. iconv -f GBK -t UTF-8"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    with pytest.raises(DataError, match=f"^{empty}: no examples; the file is empty or has only blank lines$"):
        load_pretrain_texts(str(empty))


@pytest.mark.parametrize(
    "name, data", [("c.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "\xe9"}\n'), ("c.txt", b"a\nb\n\xe9\n")]
)
def test_documents_come_one_at_a_time(tmp_path, name, data):
    """A corpus whose line 3 is not UTF-8 still gives lines 1-2 first: nothing is read ahead of its use
    (the whole-file reader decoded the file before its first document)."""
    path = tmp_path / name
    path.write_bytes(data)
    docs = iter_pretrain_texts(str(path))
    assert [next(docs), next(docs)] == ["a", "b"]
    with pytest.raises(DataError, match=":3: not UTF-8"):
        next(docs)


def test_a_comma_list_and_a_dataset_info_entry_stream_in_order(tmp_path):
    (tmp_path / "pt.jsonl").write_text(json.dumps({"text": "doc one"}) + "\n" + json.dumps({"text": "doc two"}))
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"pt": {"file_name": "pt.jsonl", "columns": {"prompt": "text"}}})
    )
    (tmp_path / "b.txt").write_text("plain\n")
    path = f"{tmp_path / 'dataset_info.json'}:pt,{tmp_path / 'b.txt'}"
    assert list(iter_pretrain_texts(path)) == ["doc one", "doc two", "plain"]


def _heap_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_reading_memory_does_not_grow_with_the_corpus(tmp_path):
    """50 MB of plain text and 10 MB of jsonl are read with a Python heap of well under 1 MB (a
    document at a time; the whole-file reader held the file's bytes and text: over 100 MB)."""
    line = ("lorem ipsum dolor sit amet 12+34=46 " * 40).strip()  # ~1.4 KB a document
    text = tmp_path / "big.txt"
    with open(text, "w") as f:
        for i in range(50_000_000 // (len(line) + 1)):
            f.write(f"{line}\n" if i % 7 else f"{line}\r\n\n")
    jsonl = tmp_path / "big.jsonl"
    with open(jsonl, "w") as f:
        record = json.dumps({"text": line, "id": 0}) + "\n"
        f.write(record * (10_000_000 // len(record)))
    counts = {}

    def read(path):
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                counts[path] = sum(1 for _ in iter_pretrain_texts(path))

        return run

    assert _heap_peak(read(str(text))) < 1 << 20
    assert _heap_peak(read(str(jsonl))) < 1 << 20
    assert counts[str(text)] > 30_000 and counts[str(jsonl)] > 6_000


def test_a_large_json_list_is_read_in_bounded_memory(tmp_path):
    """A 24 MB JSON list of pretraining documents is read with a Python heap under a tenth of the file
    (the whole-file reader held its bytes, its text and every record: several times the file)."""
    doc = json.dumps({"text": ("lorem ipsum dolor sit amet \u00e9 12+34=46 " * 30).strip()}, ensure_ascii=False)
    path = tmp_path / "big.json"
    n = 24_000_000 // (len(doc.encode()) + 3)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(f"{doc},\r\n" * (n - 1))
        f.write(doc + "\n]\n")
    size = path.stat().st_size
    count = []
    peak = _heap_peak(lambda: count.append(sum(1 for _ in iter_pretrain_texts(str(path)))))
    assert count == [n]
    assert peak < size / 10, (peak, size)
