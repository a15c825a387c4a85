"""init_layers_from / init_layer_map (erniekit/models/layer_init.py): a shallower model started from
a checkpoint's layers computes what that checkpoint computes with only those layers; heads, ties,
bad maps and shapes that do not fit; the config checks; a run started this way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError
from erniekit.models import registry
from erniekit.models.layer_init import even_layer_map, init_from_layers, source_name

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "arithmetic"
SMALL = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64}


def _model(layers: int, seed: int, **overrides):
    paddle.seed(seed)
    return registry.load_model("tiny-moe", {**SMALL, "num_hidden_layers": layers, **overrides})


def test_the_default_map_spreads_the_layers_keeping_first_and_last():
    assert even_layer_map(2, 4) == [0, 3]
    assert even_layer_map(6, 12) == [0, 2, 4, 7, 9, 11]
    assert even_layer_map(4, 4) == [0, 1, 2, 3]
    assert even_layer_map(1, 12) == [0]
    assert source_name("model.layers.1.mlp.gate.weight", [0, 3]) == "model.layers.3.mlp.gate.weight"
    assert source_name("model.embed_tokens.weight", [0, 3]) == "model.embed_tokens.weight"


def test_a_student_computes_its_source_with_only_the_mapped_layers():
    source = _model(4, seed=3)
    student = _model(2, seed=4)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, source.config.vocab_size, (2, 9)))
    source.eval(), student.eval()
    with paddle.no_grad():
        before = student(ids).logits.numpy()
        assert init_from_layers(student, source, None) == [0, 3]
        source.model.active_layers = [0, 3]  # the source's own forward over those two layers
        want = source(ids).logits.numpy()
        got = student(ids).logits.numpy()
    np.testing.assert_array_equal(got, want)
    assert not np.allclose(before, want)


def test_an_explicit_map_and_a_tied_source_for_an_untied_head():
    source = _model(3, seed=5, tie_word_embeddings=True)
    student = _model(2, seed=6, tie_word_embeddings=False)
    init_from_layers(student, source, [0, 2])
    embed = source.model.embed_tokens.weight.numpy()
    np.testing.assert_array_equal(student.lm_head.weight.numpy(), embed.T)
    np.testing.assert_array_equal(
        student.model.layers[1].self_attn.q_proj.weight.numpy(), source.model.layers[2].self_attn.q_proj.weight.numpy()
    )


def test_maps_and_shapes_that_do_not_fit_are_refused():
    source = _model(4, seed=7)
    with pytest.raises(ConfigError, match=r"init_layer_map=\[0\]: needs 2 indices .* in \[0, 4\)"):
        init_from_layers(_model(2, seed=8), source, [0])
    with pytest.raises(ConfigError, match=r"init_layer_map=\[0, 4\]"):
        init_from_layers(_model(2, seed=8), source, [0, 4])
    with pytest.raises(ConfigError, match=r"the model's layer 0 and layer 1 of init_layers_from differ in kind"):
        init_from_layers(_model(2, seed=8), source, [1, 2])  # layer 0 is dense, the source's layer 1 MoE
    narrow = _model(2, seed=9, intermediate_size=96)
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj.weight is \[64, 128\] where .* \[64, 96\]"):
        init_from_layers(narrow, source, None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("source") / "moe"
    model = _model(4, seed=11)
    registry.save_model(model, str(path), tokenizer=registry.family_of("tiny-moe").default_tokenizer())
    return str(path)


def _cfg(tmp_path, *overrides):
    return validate(
        load_config(
            None,
            [
                "model_name_or_path=tiny-moe",
                *(f"model_overrides.{k}={v}" for k, v in SMALL.items()),
                "model_overrides.num_hidden_layers=2",
                f"train_dataset_path={DATA / 'train.jsonl'}",
                f"eval_dataset_path={DATA / 'eval.jsonl'}",
                f"output_dir={tmp_path / 'out'}",
                *overrides,
            ],
        )
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["init_layer_map=[0,1]"], "init_layer_map applies with init_layers_from"),
        (["init_layers_from={tmp}/nowhere"], "nowhere is not a checkpoint directory with a config.json"),
        (["init_layers_from={ckpt}", "init_layer_map=[0,7]"], r"7 is not a layer of .* \(it has 4\)"),
    ],
)
def test_the_config_checks(tmp_path, checkpoint, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *(o.format(tmp=tmp_path, ckpt=checkpoint) for o in overrides))


def test_a_run_starts_from_the_checkpoints_layers(tmp_path, checkpoint):
    from erniekit.train.run import load_model

    cfg = _cfg(tmp_path, f"init_layers_from={checkpoint}", "init_layer_map=[0,2]")
    model = load_model(cfg)
    source = registry.load_model(checkpoint)
    for i, j in enumerate([0, 2]):
        np.testing.assert_array_equal(
            model.model.layers[i].self_attn.o_proj.weight.numpy(),
            source.model.layers[j].self_attn.o_proj.weight.numpy(),
        )
    np.testing.assert_array_equal(model.model.norm.weight.numpy(), source.model.norm.weight.numpy())
