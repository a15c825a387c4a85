"""read_json_object: every file json cannot read is one CheckpointError naming it, not a traceback
(a hostile config.json, index or adapter_config.json)."""

import pytest

from erniekit.errors import CheckpointError
from erniekit.utils.io import read_json_object


@pytest.mark.parametrize(
    "content,message",
    [
        (b"{not json", r":1: invalid JSON \(Expecting property name"),
        (b'{"vocab_size": ' + b"9" * 5000 + b"}", r": invalid JSON \(Exceeds the limit \(\d+ digits\)"),
        (b"[" * 100000 + b"]" * 100000, r": invalid JSON \(arrays or objects nested too deeply to read\)"),
        (b'{"a": "\xff\xfe"}', r": not UTF-8 text \(byte 7\)"),
        (b"[1, 2]", r": expected a JSON object at top level"),
    ],
)
def test_unreadable_json_is_one_line_naming_the_file(tmp_path, content, message):
    file = tmp_path / "config.json"
    file.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"^{file}{message}.*; fix config\.json$") as e:
        read_json_object(str(file), "fix config.json")
    assert "\n" not in str(e.value)


def test_a_json_object_is_returned(tmp_path):
    file = tmp_path / "index.json"
    file.write_text('{"a": [1, {"b": null}]}')
    assert read_json_object(str(file)) == {"a": [1, {"b": None}]}
