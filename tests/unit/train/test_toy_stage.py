"""Adding a stage is one file: a `Stage` subclass with `@register_stage` (this file) trains through
the shared loop, is validated by what it declares it supports, and leaves no state behind."""

import json

import numpy as np
import pytest

from erniekit.errors import ConfigError
from erniekit.train.stage import Stage, Supports, eval_loss
from erniekit.train.stages import get_stage, register_stage, stage_names, unregister_stage


class ToyStage(Stage):
    """Next-token loss on one repeated pattern: the loss must fall within a few steps."""

    name = "Toy"
    aliases = ("toy-lm",)
    supports = Supports(packing=True)

    def build_train_rows(self, cfg, tokenizer):
        self.built = True  # run state on the instance: the next run's instance must not see it
        ids = np.asarray([(5 + i % 7) for i in range(24)], np.int64)
        return [{"input_ids": ids, "labels": ids.copy()} for _ in range(32)]

    def build_eval_data(self, cfg, tokenizer):
        return self.build_train_rows(cfg, tokenizer)[:4]

    def evaluate(self, model, tokenizer, eval_data, cfg):
        return eval_loss(model, eval_data, cfg.per_device_eval_batch_size, tokenizer.pad_token_id)


@pytest.fixture
def toy():
    register_stage(ToyStage)
    yield ToyStage
    unregister_stage("Toy")


def _cfg(tmp_path, *overrides):
    from erniekit.config import load_config, validate

    return validate(
        load_config(
            None,
            [
                "stage=toy-lm",
                "model_name_or_path=tiny-dense",
                "model_overrides.num_hidden_layers=1",
                "max_steps=6",
                "per_device_train_batch_size=4",
                "learning_rate=1e-2",
                "lr_scheduler_type=constant",
                "logging_steps=1",
                "save_steps=100",
                "disable_tqdm=true",
                f"output_dir={tmp_path / 'toy'}",
                *overrides,
            ],
        )
    )


def test_a_registered_stage_trains_through_the_shared_loop(toy, tmp_path):
    from erniekit.train.run import run_train

    cfg = _cfg(tmp_path)
    assert cfg.stage == "Toy" and "Toy" in stage_names()
    res = run_train(cfg, log=lambda s: None)
    losses = [
        json.loads(x)["train/loss"] for x in open(tmp_path / "toy" / "vdl_log" / "scalars.jsonl") if "train/loss" in x
    ]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    assert res["train"]["train/loss"] == losses[-1]
    assert (tmp_path / "toy" / "checkpoint-6" / "optimizer.safetensors").exists()
    assert not hasattr(get_stage("Toy"), "built")  # a fresh instance per run


def test_validation_reads_what_the_stage_declares(toy, tmp_path):
    _cfg(tmp_path, "packing=true")  # declared: accepted
    with pytest.raises(
        ConfigError, match=r"loss_token_balance applies to the pretrain, SFT and VL-SFT stages, not Toy"
    ):
        _cfg(tmp_path, "loss_token_balance=true")
    with pytest.raises(
        ConfigError, match=r"elastic_\* sub-model training applies to the DPO, pretrain and SFT stages, not Toy"
    ):
        _cfg(tmp_path, "elastic_depth=[1]")


def test_an_unregistered_stage_is_gone(tmp_path):
    with pytest.raises(ConfigError, match="stage"):
        _cfg(tmp_path)
    assert "Toy" not in stage_names()


def test_help_lists_a_registered_stage(toy):
    from erniekit.cli import _train_help

    stage_line = next(line for line in _train_help().splitlines() if line.startswith("      training stage:"))
    listed = stage_line.split("one of: ")[1].split(", ")
    assert "Toy" in listed and "SFT" in listed


def test_stage_order_does_not_follow_import_order():
    """Importing one stage module before the registry loads the others (as a test or a plugin may)
    leaves the built-in stages in module order, and the messages that list them unchanged."""
    import subprocess
    import sys

    code = (
        "import erniekit.train.stages.vl_sft\n"
        "from erniekit.train.stages import stage_names\n"
        "from erniekit.config.checks import _stages_that\n"
        "print(stage_names().index('VL-SFT') > stage_names().index('SFT'), _stages_that('token_balance'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True pretrain, SFT and VL-SFT"
