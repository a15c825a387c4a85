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


def test_a_pipe_is_refused_for_several_processes_and_a_device_always(fifo, tmp_path):
    """A pipe gives its data once: with several processes one rank read it all and the others hung at
    open, then the job failed in a collective; /dev/zero was read forever."""
    from erniekit.config import TrainConfig, validate
    from erniekit.data.formats import split_paths
    from erniekit.errors import ConfigError

    def cfg(**kw):
        return TrainConfig(model_name_or_path="tiny-dense", output_dir=str(tmp_path / "out"), **kw)

    validate(cfg(train_dataset_path=fifo))  # one process reads it once
    with pytest.raises(ConfigError, match=r"train_dataset_path: .*stream\.jsonl is a pipe, .* each of the 2 processes"):
        validate(cfg(train_dataset_path=fifo, nproc_per_node=2))
    with pytest.raises(ConfigError, match=r"eval_dataset_path: /dev/zero is a device"):
        validate(cfg(train_dataset_path=fifo, eval_dataset_path="/dev/zero", do_eval=True))
    with pytest.raises(DataError, match=r"dataset path is a device, not a file: /dev/zero"):
        split_paths("/dev/zero")
