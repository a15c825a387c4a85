"""The hidden-state distillation loss (erniekit/train/hidden_distill.py): the default layer map, the
loss against a float64 numpy formula, and the layer-output capture against the model's own output."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from erniekit.models.layer_init import depth_fraction_layer_map
from erniekit.train.hidden_distill import HiddenProjection, layer_loss_sum, layer_outputs


@pytest.mark.parametrize(
    "m,n,want",
    [
        (2, 4, [1, 3]),
        (3, 12, [3, 7, 11]),
        (4, 4, [0, 1, 2, 3]),
        (1, 6, [5]),
        (6, 12, [1, 3, 5, 7, 9, 11]),
        (4, 2, [0, 0, 0, 1]),  # deeper than its source: never a negative index
    ],
)
def test_default_map_takes_equal_fractions_of_depth_and_ends_on_the_last_layer(m, n, want):
    assert depth_fraction_layer_map(m, n) == want


def _normed(h: np.ndarray) -> np.ndarray:
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def _by_hand(students, teachers, segment_ids, w=None) -> float:
    """Sum over real tokens of the mean over layer pairs of the squared error of RMS-normalised states."""
    real = segment_ids > 0
    total = 0.0
    for b, t in zip(*np.nonzero(real)):
        errs = []
        for hs, ht in zip(students, teachers):
            v = hs[b, t].astype(np.float64)
            v = v @ w.astype(np.float64) if w is not None else v
            d = _normed(v) - _normed(ht[b, t].astype(np.float64))
            errs.append((d * d).mean())
        total += float(np.mean(errs))
    return total


def test_loss_is_the_normalised_squared_error_summed_over_real_tokens():
    rng = np.random.default_rng(0)
    seg = np.array([[1, 1, 1, 0], [1, 1, 2, 2]])
    s = [rng.normal(size=(2, 4, 8)).astype(np.float32) * k for k in (1.0, 30.0)]
    t = [rng.normal(size=(2, 4, 8)).astype(np.float32) * k for k in (5.0, 0.1)]
    got = layer_loss_sum([paddle.to_tensor(x) for x in s], [paddle.to_tensor(x) for x in t], seg)
    assert float(got) == pytest.approx(_by_hand(s, t, seg), rel=1e-5)
    # scale-free: scaling either side leaves it unchanged; equal directions give 0
    scaled = layer_loss_sum([paddle.to_tensor(x * 7.0) for x in s], [paddle.to_tensor(x) for x in t], seg)
    assert float(scaled) == pytest.approx(float(got), rel=1e-5)
    same = layer_loss_sum([paddle.to_tensor(x * 3.0) for x in t], [paddle.to_tensor(x) for x in t], seg)
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    # a padded position never counts
    t_pad = [x.copy() for x in t]
    t_pad[0][0, 3] = 1e3
    moved = layer_loss_sum([paddle.to_tensor(x) for x in s], [paddle.to_tensor(x) for x in t_pad], seg)
    assert float(moved) == pytest.approx(float(got), rel=1e-6)


def test_a_narrower_student_goes_through_the_learned_map_and_only_it_gets_gradients():
    rng = np.random.default_rng(1)
    seg = np.ones((2, 3), np.int64)
    s = rng.normal(size=(2, 3, 4)).astype(np.float32)
    t = rng.normal(size=(2, 3, 8)).astype(np.float32)
    paddle.seed(0)
    proj = HiddenProjection(4, 8, std=0.5)
    hs = paddle.to_tensor(s, stop_gradient=False)
    ht = paddle.to_tensor(t, stop_gradient=False)
    got = layer_loss_sum([hs], [ht], seg, proj)
    assert float(got) == pytest.approx(_by_hand([s], [t], seg, proj.linear.weight.numpy()), rel=1e-5)
    got.backward()
    assert hs.grad is not None and proj.linear.weight.grad is not None
    assert ht.grad is None  # the teacher's side is a target


def test_captured_layer_outputs_are_the_forwards_own():
    from erniekit.models import registry

    paddle.seed(3)
    model = registry.load_model("tiny-moe", {"num_hidden_layers": 3, "hidden_size": 64, "moe_intermediate_size": 64})
    model.eval()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(5, 100, size=(2, 7)))
    with paddle.no_grad(), layer_outputs(model, [0, 2]) as out:
        res = model(input_ids=ids)
    assert sorted(out) == [0, 2]
    # the last layer's output, through the final norm, is the model's final hidden states
    np.testing.assert_allclose(model.model.norm(out[2]).numpy(), res.hidden_states.numpy(), rtol=1e-6, atol=1e-6)
    # layer 0's output is layer 0 applied to the embeddings
    cos, sin, mask = model.model.rope_and_mask(ids)
    with paddle.no_grad():
        h0 = model.model.layers[0](model.model.embed_tokens(ids), cos, sin, mask, None)
    np.testing.assert_allclose(out[0].numpy(), h0.numpy(), rtol=1e-6, atol=1e-6)
    # the hooks are gone after the block: a later forward leaves the captured outputs alone
    kept = out[2]
    with paddle.no_grad():
        model(input_ids=ids * 0 + 7)
    assert out[2] is kept
    assert not any(layer._forward_post_hooks for layer in model.model.layers)
