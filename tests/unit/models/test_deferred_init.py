"""Loading a checkpoint builds the model without random weights first (erniekit/nn/deferred_init.py):
the load draws nothing from Paddle's generator and gives exactly the checkpoint's weights, while a
preset (fresh weights) is still drawn as before."""

import dataclasses

import numpy as np
import paddle
import pytest
from paddle.base import initializer as paddle_init
from paddle.nn.initializer import Constant

import erniekit.models.ernie4_5_vl.family  # noqa: F401  (registers the VL family)
from erniekit.elastic.submodels import ElasticSpec, _source, extract_submodel, layer_subset
from erniekit.models import registry
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.checkpoint import from_pretrained
from erniekit.models.registry import load_model, save_model
from erniekit.nn.deferred_init import random_init_skipped, skip_random_init


def _params(model) -> dict[str, np.ndarray]:
    return {n: p.numpy().copy() for n, p in model.named_parameters()}


def _draws_nothing(build) -> object:
    """build() with the generator seeded; asserts the next draw is the seed's first."""
    paddle.seed(123)
    out = build()
    after = paddle.rand([8]).numpy()
    paddle.seed(123)
    np.testing.assert_array_equal(after, paddle.rand([8]).numpy())
    return out


def test_inside_the_block_parameters_are_zero_and_init_weights_draws_nothing():
    paddle.seed(0)
    with skip_random_init():
        assert random_init_skipped()
        model = Ernie4_5ForCausalLM(get_preset("tiny-moe"))
    assert not random_init_skipped()
    assert all(not p.numpy().any() for p in model.parameters())  # RMSNorm's ones too: every one is loaded
    assert paddle_init._global_weight_initializer() is None and paddle_init._global_bias_initializer() is None


def test_the_block_restores_on_error_and_nests():
    with pytest.raises(RuntimeError), skip_random_init():
        with skip_random_init():
            pass
        # the inner block's exit leaves the outer one in force, zero initializer included
        assert random_init_skipped() and isinstance(paddle_init._global_weight_initializer(), Constant)
        raise RuntimeError("boom")
    assert not random_init_skipped()
    assert paddle_init._global_weight_initializer() is None


def test_blocks_overlapping_across_threads_put_paddles_initializer_back():
    """A enters, B enters, A leaves, B leaves: the last to leave restores, not the first."""
    a, b = skip_random_init(), skip_random_init()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert random_init_skipped() and isinstance(paddle_init._global_weight_initializer(), Constant)
    b.__exit__(None, None, None)
    assert not random_init_skipped() and paddle_init._global_weight_initializer() is None


def test_a_family_that_does_not_promise_a_full_load_still_draws(tmp_path, monkeypatch):
    """Only a family with loads_every_parameter builds zero-filled: another family's load may keep
    layers it does not find in the checkpoint, which must stay randomly initialised."""
    paddle.seed(3)
    save_model(load_model("tiny-dense"), str(tmp_path))
    fam = registry.get_family("ernie4_5")
    assert fam.loads_every_parameter
    monkeypatch.setitem(registry._families, "ernie4_5", dataclasses.replace(fam, loads_every_parameter=False))
    paddle.seed(123)
    load_model(str(tmp_path))
    after = paddle.rand([8]).numpy()
    paddle.seed(123)
    assert not np.array_equal(after, paddle.rand([8]).numpy())  # the build drew its random weights


def test_a_preset_still_gets_seeded_random_weights():
    cfg = get_preset("tiny-dense")
    paddle.seed(7)
    a = load_model("tiny-dense")
    paddle.seed(7)
    b = Ernie4_5ForCausalLM(cfg)
    w = a.model.layers[0].mlp.gate_proj.weight.numpy()
    assert abs(float(w.std()) - cfg.initializer_range) < 0.1 * cfg.initializer_range
    for (n, x), y in zip(_params(a).items(), _params(b).values()):
        np.testing.assert_array_equal(x, y, err_msg=n)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-vl"])
def test_loading_a_checkpoint_draws_nothing_and_gives_its_weights(tmp_path, preset):
    paddle.seed(1)
    src = load_model(preset)
    save_model(src, str(tmp_path))
    loaded = _draws_nothing(lambda: load_model(str(tmp_path)))
    want = _params(src)
    got = _params(loaded)
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    if preset == "tiny-dense":
        direct = _draws_nothing(lambda: from_pretrained(str(tmp_path)))
        for n, v in _params(direct).items():
            np.testing.assert_array_equal(v, want[n], err_msg=n)


def test_an_elastic_submodel_copies_its_parent_without_drawing():
    paddle.seed(2)
    parent = load_model("tiny-moe")
    spec = ElasticSpec(depth=2)
    sub = _draws_nothing(lambda: extract_submodel(parent, spec))
    src = dict(parent.named_parameters())
    keep = layer_subset(parent.config.num_hidden_layers, spec.depth)
    for n, p in sub.named_parameters():  # each the parent's values, not the block's zeros
        np.testing.assert_array_equal(p.numpy(), src[_source(n, keep)].numpy(), err_msg=n)
