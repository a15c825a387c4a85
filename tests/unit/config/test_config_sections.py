"""Config sections (issue #24): every flat key belongs to exactly one section, a section carries
the validated values under the same names, and it cannot be written through."""

import dataclasses

import pytest

from erniekit.config.schema import SECTION_KEYS, SECTIONS, TrainConfig, fields


def test_every_key_is_in_exactly_one_section():
    keys = [k for ks in SECTION_KEYS.values() for k in ks]
    assert sorted(keys) == sorted(f.name for f in fields()) and len(keys) == len(set(keys))
    assert not set(SECTION_KEYS) & {f.name for f in fields()}  # a section name never hides a key


def test_a_section_holds_the_validated_values_and_is_read_only(tmp_path):
    from erniekit.config import load_config, validate

    cfg = validate(
        load_config(
            "examples/configs/tiny/sft.yaml",
            [f"output_dir={tmp_path}", "compute_type=fp8", "learning_rate=2e-3", "nproc_per_node=1"],
        )
    )
    optim, precision = cfg.optim, cfg.precision
    assert isinstance(optim, SECTIONS["optim"]) and optim.learning_rate == 2e-3 == cfg.learning_rate
    assert precision.fp8 is True  # compute_type=fp8 normalised into the flag before the section is read
    assert cfg.parallelism.nproc_per_node == 1 and cfg.elastic.elastic_depth == []
    assert {f.name for f in dataclasses.fields(optim)} == set(SECTION_KEYS["optim"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        optim.learning_rate = 1.0
    assert TrainConfig().optim.learning_rate == TrainConfig().learning_rate
