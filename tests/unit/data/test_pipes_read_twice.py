"""Inputs that are read twice refuse a pipe, which gives its data once: the token store's fingerprint
(a pipe's size and name say nothing of what it carries) and the routing report's JSON kind sniff."""

from __future__ import annotations

import os

import pytest

from erniekit.data.token_store import source_files
from erniekit.errors import DataError
from erniekit.routing.data import _is_text_file


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "stream.jsonl"
    os.mkfifo(path)
    return str(path)


def test_the_token_store_refuses_a_pipe_it_could_not_match_later(fifo, tmp_path):
    with pytest.raises(
        DataError, match=r"tokenized_path: .*stream\.jsonl is not a regular file .* drop tokenized_path"
    ):
        source_files(fifo)
    text = tmp_path / "a.jsonl"
    text.write_text('{"text": "x"}\n')
    assert source_files(str(text))[0][0] == str(text)  # a regular file is fingerprinted


def test_the_routing_report_refuses_a_pipe_before_reading_it(fifo, tmp_path):
    with pytest.raises(DataError, match=r"stream\.jsonl: not a regular file .* write it to a file first"):
        _is_text_file(fifo)  # opening the pipe would block: the refusal comes first
    text = tmp_path / "b.jsonl"
    text.write_text('{"text": "x"}\n')
    assert _is_text_file(str(text))
