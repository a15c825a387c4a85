"""The number of keys control_attributes.json records is bounded (MAX_RECORDED_KEYS): past it the record
keeps the most frequent keys and is "open_keys" (version 2), so an unlisted key is accepted; a record
within the bound is the version-1 file older erniekit reads (docs/control.md)."""

from __future__ import annotations

import json

import pytest

from erniekit.data.control import (
    CONTROL_RECORD_NAME,
    MAX_RECORDED_KEYS,
    check_trained_control,
    count_controls,
    merge_records,
    read_control_record,
    write_control_record,
)
from erniekit.errors import CheckpointError, DataError

EXTRA = 44  # keys past the bound


def _many_keys() -> list[dict[str, str]]:
    """MAX_RECORDED_KEYS + EXTRA keys, one per record; the first 50 on a second record too."""
    keys = [f"k{i:03d}" for i in range(MAX_RECORDED_KEYS + EXTRA)]
    return [{k: "x"} for k in keys] + [{k: "x"} for k in keys[:50]]


def test_past_the_bound_the_most_frequent_keys_are_kept_and_the_record_is_open(tmp_path):
    rec = count_controls([*_many_keys(), {"style": "words"}, {"style": "words"}])
    attrs = rec["attributes"]
    assert len(attrs) == MAX_RECORDED_KEYS and rec["open_keys"] is True and rec["version"] == 2
    assert rec["records"] == MAX_RECORDED_KEYS + EXTRA + 50 + 2  # every record counts, listed or not
    assert "style" in attrs and all(f"k{i:03d}" in attrs for i in range(50))  # the twice-seen keys
    # the once-seen keys by name: those past the bound are not listed
    n_once = MAX_RECORDED_KEYS - 51
    assert f"k{49 + n_once:03d}" in attrs and f"k{50 + n_once:03d}" not in attrs
    write_control_record(str(tmp_path), rec)
    assert read_control_record(str(tmp_path)) == rec
    # an open record takes a key it does not list, and still checks the values of the keys it lists
    check_trained_control({f"k{MAX_RECORDED_KEYS + EXTRA - 1:03d}": "x", "style": "words"}, rec, "--control ")
    check_trained_control({"anything": "at all"}, rec, "--control ")
    with pytest.raises(DataError, match="this model was trained on style = words only"):
        check_trained_control({"style": "digits"}, rec, "--control ")
    # exactly at the bound: closed, the version-1 file older erniekit reads
    exactly = count_controls([{f"k{i:03d}": "x"} for i in range(MAX_RECORDED_KEYS)])
    assert exactly["version"] == 1 and "open_keys" not in exactly and len(exactly["attributes"]) == MAX_RECORDED_KEYS
    with pytest.raises(DataError, match="not trained with the attribute 'other'"):
        check_trained_control({"other": "x"}, exactly, "--control ")


def test_merged_records_past_the_bound_open_and_an_open_one_stays_open():
    half = MAX_RECORDED_KEYS // 2 + 1
    a = count_controls([{f"a{i:03d}": "x"} for i in range(half)])
    b = count_controls([{f"b{i:03d}": "x"} for i in range(half)])
    assert "open_keys" not in a and "open_keys" not in b
    m = merge_records(a, b)
    assert m["open_keys"] and m["version"] == 2 and len(m["attributes"]) == MAX_RECORDED_KEYS
    assert m["records"] == 2 * half
    again = merge_records(m, count_controls([{"style": "words"}]))
    assert again["open_keys"] and again["version"] == 2  # what made it open is still trained on
    small = merge_records(count_controls([{"style": "words"}]), count_controls([{"tone": "formal"}]))
    assert small["version"] == 1 and "open_keys" not in small


def test_a_refusal_lists_sixteen_keys_then_a_count():
    rec = count_controls([{f"k{i:03d}": "x"} for i in range(40)])
    with pytest.raises(DataError) as e:
        check_trained_control({"zzz": "x"}, rec, "--control ")
    listed = ", ".join(f"k{i:03d}" for i in range(16))
    assert f"its attributes: {listed} and 24 more (docs/control.md)" in str(e.value)


def test_an_older_version_1_file_reads_and_a_bad_open_keys_is_one_line(tmp_path):
    old = {"version": 1, "records": 2, "attributes": {"style": {"open": False, "values": {"words": 2}}}}
    (tmp_path / CONTROL_RECORD_NAME).write_text(json.dumps(old))
    assert read_control_record(str(tmp_path)) == old
    with pytest.raises(DataError):  # closed: an unknown key is refused as before
        check_trained_control({"tone": "formal"}, old, "--control ")
    (tmp_path / CONTROL_RECORD_NAME).write_text(json.dumps({**old, "version": 2, "open_keys": "yes"}))
    with pytest.raises(CheckpointError, match="'open_keys' must be true or false") as e:
        read_control_record(str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_key_an_open_record_left_out_stays_open_when_trained_again():
    """Continued training of a key the starting open_keys record did not list: the values the start
    learnt are unknown, so the key is open (it came back closed with the new run's values only, and
    chat refused one the model had learnt)."""
    keys = [{f"k{i:03d}": "x"} for i in range(MAX_RECORDED_KEYS)] * 10
    start = count_controls([*keys, {"tone": "formal"}, {"tone": "casual"}])
    assert start["open_keys"] and "tone" not in start["attributes"]
    check_trained_control({"tone": "casual"}, start, "--control ")  # accepted: an unlisted key of an open record
    merged = merge_records(start, count_controls([{"tone": "formal"}] * 50))
    assert merged["attributes"]["tone"]["open"] is True
    check_trained_control({"tone": "casual"}, merged, "--control ")
    closed = merge_records(count_controls([{"tone": "formal"}]), count_controls([{"tone": "formal"}] * 5))
    assert closed["attributes"]["tone"]["open"] is False  # no open_keys part: as before
