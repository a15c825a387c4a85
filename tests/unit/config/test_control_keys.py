"""Config checks of the control and credibility keys (docs/control.md): one line naming the key."""

from pathlib import Path

import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "overrides, what",
    [
        (["control_drop_prob=1.5"], "control_drop_prob=1.5 is invalid: it must be in [0, 1]"),
        (["credibility_loss_weight=-1"], "credibility_loss_weight=-1.0 is invalid"),
        (["credibility_every=0"], "credibility_every=0 is invalid"),
        (["credibility_temperature=0"], "credibility_temperature=0.0 is invalid: it must be > 0"),
        (["credibility_loss_weight=0.5", "stage=DPO"], "credibility_loss_weight=0.5 applies to stage SFT, not DPO"),
        (["control_drop_prob=0.2", "stage=pretrain"], "control_drop_prob=0.2 applies to stage SFT, not pretrain"),
        (["credibility_loss_weight=0.5", "nproc_per_node=2"], "runs in one process in this version"),
        (["credibility_loss_weight=0.5", "elastic_depth=[1,2]"], "clear elastic_depth"),
    ],
)
def test_bad_control_keys_are_refused(overrides, what):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert what in str(e.value) and "\n" not in str(e.value)


def test_the_demo_config_is_valid():
    cfg = validate(load_config(str(ROOT / "examples/configs/tiny/sft_control.yaml"), []))
    assert cfg.control.credibility_loss_weight > 0 and cfg.control_drop_prob == 0.2
