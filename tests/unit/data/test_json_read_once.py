"""iter_records opens a data file once and reads it once, telling its shape from the first block of that
stream: a FIFO (process substitution, train_dataset_path=/dev/fd/63) reads as the same bytes in a file do,
and a file replaced while it is read is never read half old, half new."""

import builtins
import json
import os
import threading

import pytest
import whole_file_reader

import erniekit.data.formats as formats
from erniekit.data.formats import iter_pretrain_texts, iter_records, load_sft_examples
from erniekit.errors import DataError

WAIT_S = 10  # a reader that opens the FIFO twice waits for a second writer: the test fails after this

# > 64 KB each (a pipe's buffer): the writer blocks until the reader has read the first blocks
LIST = json.dumps([{"src": f"question {i} \u00e9", "tgt": f"answer {i}"} for i in range(3000)], indent=1).encode()
LINES = "\n".join(json.dumps({"src": f"question {i}", "tgt": f"answer {i} \u4e2d"}) for i in range(3000)).encode()


def _through_fifo(path: str, data: bytes, read, to_the_end: bool = True):
    """read(path) while a thread writes `data` into the FIFO at `path` once; what it returned or raised.
    to_the_end: the reader must read every byte (an error may stop it early)."""
    os.mkfifo(path)
    out: dict = {}

    def write() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # the reader closed the FIFO before the end
            out["writer"] = "cut"

    def consume() -> None:
        try:
            out["read"] = read(path)
        except DataError as e:
            out["read"] = f"DataError: {e}"

    threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=consume, daemon=True)]
    for t in threads:
        t.start()
    threads[1].join(WAIT_S)
    stuck = threads[1].is_alive()
    if stuck:  # waiting in open() for another writer: give it one that writes nothing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        threads[1].join(WAIT_S)
    threads[0].join(WAIT_S)
    assert not stuck, f"{path}: the reader opened the FIFO again after its writer was done"
    assert "writer" not in out or not to_the_end, f"{path}: the reader closed the FIFO before reading it to the end"
    return out["read"]


@pytest.mark.parametrize(
    "name, data",
    [("list.json", LIST), ("list.jsonl", LIST), ("lines.jsonl", LINES), ("lines.json", LINES)],
)
def test_a_fifo_reads_as_a_file_with_its_bytes(tmp_path, name, data):
    """A JSON list and JSON lines (also misnamed .json: the first value is read, then the lines from the
    start) come through a FIFO as through a file: same records, same positions."""
    (tmp_path / "file").mkdir()
    file = tmp_path / "file" / name
    file.write_bytes(data)
    want = list(whole_file_reader.iter_records(str(file)))
    assert len(want) == 3000
    got = _through_fifo(str(tmp_path / name), data, lambda p: list(iter_records(p, block=4096)))
    assert got == want


def test_fifo_training_data_and_pretraining_text(tmp_path):
    """split_paths takes a FIFO as a file: SFT examples and pretraining text read from one."""
    convs = _through_fifo(str(tmp_path / "sft.jsonl"), LINES, load_sft_examples)
    assert not isinstance(convs, str), convs
    assert len(convs) == 3000 and convs[2999].turns == [("question 2999", "answer 2999 \u4e2d")]
    docs = "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(5000)).encode()
    texts = _through_fifo(str(tmp_path / "pt.jsonl"), docs, lambda p: list(iter_pretrain_texts(p)))
    assert not isinstance(texts, str), texts
    assert texts == [f"doc {i}" for i in range(5000)]


@pytest.mark.parametrize("name, data", [("bad_line.json", b'{"a": 1}\n{"b": \n'), ("bad_list.json", b"[1, 2,]")])
def test_errors_through_a_fifo_check_the_rest_of_the_same_stream(tmp_path, name, data):
    """A JSON error, then a byte that is not UTF-8 further on: named as the whole-file reader names it, found
    in the rest of the one stream (the FIFO cannot be read again)."""
    data += b" " * 100_000 + b'\n{"c": "caf\xe9"}\n'  # the bad byte blocks past the JSON error
    (tmp_path / "file").mkdir()
    file = tmp_path / "file" / name
    file.write_bytes(data)
    with pytest.raises(DataError) as e:
        list(whole_file_reader.iter_records(str(file)))
    got = _through_fifo(str(tmp_path / name), data, lambda p: list(iter_records(p, block=64)), to_the_end=False)
    assert got == f"DataError: {str(e.value).replace(str(file), str(tmp_path / name))}"
    assert "not UTF-8 (byte 0xe9" in got


SHAPES = {
    "list.json": b'[{"a": 1},\n {"b": 2}]',
    "list.jsonl": b'\n\n  [{"a": 1}]',
    "one_value.json": b'{"a": [1, 2]}\n',
    "lines.json": b'{"a": 1}\n{"b": 2}\n',
    "lines.jsonl": b'{"a": 1}\n\n{"b": 2}',
    "bad_line_then_bad_byte.json": b'{"a": 1}\n{"b": \n{"c": "\xff"}\n',
    "bad_list_then_bad_byte.json": b'[1 2, "\xff"]',
    "bad_byte_first.json": b"\xff[1]",
    "blank.json": b" \n\n",
}


@pytest.mark.parametrize("name", SHAPES)
def test_each_file_is_opened_once(tmp_path, monkeypatch, name):
    """Telling the shape (list, one value, lines), reading it and checking UTF-8 before naming a JSON error
    all use one open handle, with small blocks so that each step reads on."""
    path = tmp_path / name
    path.write_bytes(SHAPES[name])
    opened = []

    def counting_open(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(formats, "open", counting_open, raising=False)
    try:
        got = list(iter_records(str(path), block=2))
    except DataError as e:
        got = f"DataError: {e}"
    try:
        want = list(whole_file_reader.iter_records(str(path)))
    except DataError as e:
        want = f"DataError: {e}"
    assert got == want
    assert opened == [str(path)]


def test_a_file_replaced_while_it_is_read_gives_the_text_first_opened(tmp_path, monkeypatch):
    """The file is replaced (a new file renamed over it) right after it is opened: every record comes from
    the text that was opened, none from the new one (the shape was told from the same stream)."""
    path = tmp_path / "d.json"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')  # JSON lines in a .json: told from the first value, read as lines

    def open_then_replace(file, *args, **kwargs):
        f = builtins.open(file, *args, **kwargs)
        new = tmp_path / "new.json"
        new.write_bytes(b'[{"c": 3}]')
        os.replace(new, path)
        return f

    monkeypatch.setattr(formats, "open", open_then_replace, raising=False)
    assert list(iter_records(str(path), block=4)) == [(1, {"a": 1}), (2, {"b": 2})]
