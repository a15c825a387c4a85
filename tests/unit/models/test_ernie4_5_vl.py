"""ERNIE-4.5-VL against transformers' `ernie4_5_vl_moe` on tiny random checkpoints of random shapes:
logits of text, one image, images of different sizes and a video, both ways (their checkpoint
loaded by us, ours loaded by them); greedy generation token for token on the same kinds of prompt;
the 3-D rope and its positions against their formulas."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Ernie4_5_VLMoeForConditionalGeneration"):
    pytest.skip("transformers without ernie4_5_vl_moe", allow_module_level=True)

from erniekit.models.ernie4_5_vl.configuration import Ernie4_5_VLConfig  # noqa: E402
from erniekit.models.ernie4_5_vl.modeling import moe_modality, rope_index  # noqa: E402
from erniekit.models.registry import load_model, save_model  # noqa: E402
from erniekit.nn.attention import rope_cos_sin, rope_cos_sin_3d  # noqa: E402

PATCH = 3 * 14 * 14
IDS = dict(
    image_start_token_id=500,
    image_end_token_id=501,
    image_token_id=502,
    video_start_token_id=503,
    video_end_token_id=504,
    video_token_id=505,
)


def _their_config(seed: int):
    """Shapes drawn at random (seeded): heads, widths, expert counts and sizes, layer pattern."""
    r = np.random.default_rng(seed)
    heads = int(r.choice([2, 4]))
    head_dim = int(r.choice([16, 32]))
    t = int(r.choice([2, 4]))
    hw = (head_dim // 2 - t) // 2
    layers = int(r.integers(2, 4))
    v_heads = int(r.choice([1, 2]))
    return transformers.Ernie4_5_VLMoeConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=heads * head_dim,
            intermediate_size=int(r.choice([64, 96])),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(r.choice([1, heads])),
            head_dim=head_dim,
            moe_intermediate_size=[int(r.choice([32, 48])), int(r.choice([16, 32]))],
            moe_k=2,
            moe_num_experts=int(r.choice([3, 4])),
            moe_num_shared_experts=int(r.choice([0, 1])),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [hw, hw, t]},
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
            initializer_range=0.1,
        ),
        vision_config=dict(
            depth=int(r.integers(1, 3)),
            hidden_size=v_heads * 16,
            num_heads=v_heads,
            intermediate_size=48,
            rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
            initializer_range=0.1,
        ),
        **IDS,
    )


@pytest.fixture(scope="module", params=[0, 1, 2])
def theirs(request, tmp_path_factory):
    torch.manual_seed(request.param)
    model = transformers.Ernie4_5_VLMoeForConditionalGeneration(_their_config(request.param)).eval()
    path = tmp_path_factory.mktemp(f"vl{request.param}")
    model.save_pretrained(path)
    return model, str(path)


def _inputs(parts, seed=0):
    """input_ids [1, S] with placeholders for each ('image' | 'video', (t, h, w)), their patches."""
    r = np.random.default_rng(seed)
    ids, out = [], {"image": ([], []), "video": ([], [])}
    for kind, val in parts:
        if kind == "text":
            ids += r.integers(3, 400, val).tolist()
            continue
        t, h, w = val
        per = 4 if kind == "image" else 8
        pre = "image" if kind == "image" else "video"
        ids += (
            [IDS[f"{pre}_start_token_id"]]
            + [IDS[f"{pre}_token_id"]] * (t * h * w // per)
            + [IDS[f"{pre}_end_token_id"]]
        )
        out[kind][0].append(r.standard_normal((t * h * w, PATCH)).astype(np.float32))
        out[kind][1].append(list(val))
    return np.array([ids]), out


def _their_logits(model, ids, vis):
    mm = np.zeros_like(ids)
    mm[ids == IDS["image_token_id"]] = 1
    mm[ids == IDS["video_token_id"]] = 2
    moe = mm.copy()
    moe[np.isin(ids, [IDS["image_start_token_id"], IDS["image_end_token_id"]])] = 1
    moe[np.isin(ids, [IDS["video_start_token_id"], IDS["video_end_token_id"]])] = 2
    kw = dict(input_ids=torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(mm))
    kw["moe_mm_token_type_ids"] = torch.from_numpy(moe)
    for kind, (pix, grid) in {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }.items():
        if vis[kind][0]:
            kw[pix] = torch.from_numpy(np.concatenate(vis[kind][0]))
            kw[grid] = torch.tensor(vis[kind][1])
    with torch.no_grad():
        return model(**kw).logits.numpy()


def _our_logits(model, ids, vis):
    kw = {}
    if vis["image"][0]:
        kw.update(
            pixel_values=paddle.to_tensor(np.concatenate(vis["image"][0])), image_grid_thw=np.array(vis["image"][1])
        )
    if vis["video"][0]:
        kw.update(
            pixel_values_videos=paddle.to_tensor(np.concatenate(vis["video"][0])),
            video_grid_thw=np.array(vis["video"][1]),
        )
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids), **kw).logits.numpy()


CASES = {
    "text": [("text", 11)],
    "one image": [("text", 5), ("image", (1, 4, 6)), ("text", 4)],
    "images of two sizes": [("text", 3), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 6, 2)), ("text", 3)],
    "video": [("text", 3), ("video", (4, 4, 2)), ("text", 5)],
    "image and video": [("image", (1, 2, 4)), ("text", 2), ("video", (2, 2, 2)), ("text", 2)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_their_checkpoint_gives_their_logits(theirs, case):
    model, path = theirs
    ids, vis = _inputs(CASES[case])
    want = _their_logits(model, ids, vis)
    got = _our_logits(load_model(path), ids, vis)
    assert np.abs(want).max() > 0.05  # not a degenerate model
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)


def test_our_checkpoint_gives_the_same_logits_in_transformers(theirs, tmp_path):
    _, path = theirs
    paddle.seed(7)
    ours = load_model(path, {"initializer_range": 0.1})
    ours.init_weights()
    ours._init_vision()
    save_model(ours, str(tmp_path))
    back = transformers.Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for case in CASES:
        ids, vis = _inputs(CASES[case], seed=3)
        want = _our_logits(ours, ids, vis)
        np.testing.assert_allclose(_their_logits(back, ids, vis), want, atol=1e-4 * max(1.0, np.abs(want).max()))
    again = load_model(str(tmp_path))  # and our own round trip is exact
    for (n, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=n)


def test_positions_are_their_rope_index(theirs):
    model, path = theirs
    cfg = Ernie4_5_VLConfig.from_pretrained(path)
    ids, vis = _inputs([("text", 2), ("image", (1, 4, 6)), ("text", 3), ("video", (4, 2, 4)), ("image", (1, 2, 2))])
    mm = np.zeros_like(ids)
    mm[ids == IDS["image_token_id"]] = 1
    mm[ids == IDS["video_token_id"]] = 2
    want, want_delta = model.model.get_rope_index(
        torch.from_numpy(ids),
        torch.from_numpy(mm),
        image_grid_thw=torch.tensor(vis["image"][1]),
        video_grid_thw=torch.tensor(vis["video"][1]),
    )
    got, delta = rope_index(ids, cfg, np.array(vis["image"][1]), np.array(vis["video"][1]))
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(delta, want_delta.numpy().reshape(-1))
    modality = moe_modality(ids, cfg)
    assert modality[0, 2] == 1 and modality[0, 0] == 0  # the image's start token goes to the vision experts


def test_3d_rope_is_text_rope_on_equal_rows_and_reads_each_rows_pairs():
    pos = paddle.to_tensor(np.arange(10).reshape(1, 10))
    cos3, sin3 = rope_cos_sin_3d(paddle.stack([pos, pos, pos]), 32, 10000.0, [4, 4, 8])
    cos, sin = rope_cos_sin(pos, 32, 10000.0)
    np.testing.assert_array_equal(cos3.numpy(), cos.numpy())
    np.testing.assert_array_equal(sin3.numpy(), sin.numpy())
    t, h, w = (paddle.to_tensor(np.full((1, 1), v)) for v in (3, 5, 7))
    _, sin = rope_cos_sin_3d(paddle.stack([t, h, w]), 32, 10000.0, [4, 4, 8])
    inv = 1.0 / 10000.0 ** (np.arange(0, 32, 2) / 32)
    axis = [5 if p < 8 and p % 2 == 0 else 7 if p < 8 else 3 for p in range(16)]  # h even, w odd, t last
    np.testing.assert_allclose(sin.numpy()[0, 0, 0, ::2], np.sin(np.array(axis) * inv), rtol=1e-5, atol=1e-6)


def test_config_json_round_trips_and_odd_layer_patterns_are_refused(theirs):
    from erniekit.errors import CheckpointError
    from erniekit.models.ernie4_5_vl.configuration import _moe_layers

    _, path = theirs
    cfg = Ernie4_5_VLConfig.from_pretrained(path)
    assert Ernie4_5_VLConfig.from_dict(cfg.to_dict()) == cfg
    assert _moe_layers(["dense", "sparse", "dense", "sparse"]) == {
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 3,
        "moe_layer_interval": 2,
    }
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        _moe_layers(["sparse", "dense", "sparse", "sparse"])


GENERATION_CASES = {
    "text": [("text", 9)],
    "one image": [("text", 4), ("image", (1, 4, 4)), ("text", 3)],
    "images of two sizes": [("image", (1, 2, 4)), ("text", 2), ("image", (1, 4, 6)), ("text", 3)],
    "video": [("text", 2), ("video", (4, 2, 4)), ("text", 3)],
}


@pytest.mark.parametrize("case", list(GENERATION_CASES))
def test_greedy_generation_equals_transformers(theirs, case):
    from erniekit.infer.vl_generate import generate_vl

    model, path = theirs
    ids, vis = _inputs(GENERATION_CASES[case], seed=5)
    media = {k: (np.concatenate(v[0]), np.array(v[1])) if v[0] else None for k, v in vis.items()}
    got = generate_vl(load_model(path), ids[0].tolist(), media["image"], 8, [], videos=media["video"])
    mm = np.zeros_like(ids)
    mm[ids == IDS["image_token_id"]] = 1
    mm[ids == IDS["video_token_id"]] = 2
    moe = mm.copy()
    moe[np.isin(ids, [IDS["image_start_token_id"], IDS["image_end_token_id"]])] = 1
    moe[np.isin(ids, [IDS["video_start_token_id"], IDS["video_end_token_id"]])] = 2
    kw = {}
    if media["image"] is not None:
        kw.update(pixel_values=torch.from_numpy(media["image"][0]), image_grid_thw=torch.tensor(media["image"][1]))
    if media["video"] is not None:
        kw.update(
            pixel_values_videos=torch.from_numpy(media["video"][0]), video_grid_thw=torch.tensor(media["video"][1])
        )
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.ones_like(torch.from_numpy(ids)),
            mm_token_type_ids=torch.from_numpy(mm),
            moe_mm_token_type_ids=torch.from_numpy(moe),
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    assert got == out[0, ids.shape[1] :].tolist()


def test_model_overrides_reach_the_vision_config():
    from erniekit.errors import CheckpointError
    from erniekit.models.ernie4_5_vl.configuration import PRESETS

    c = PRESETS["tiny-vl"].replace(vision={"hidden_size": 128}, num_hidden_layers=2)
    assert (
        c.vision.hidden_size == 128 and c.vision.depth == PRESETS["tiny-vl"].vision.depth and c.num_hidden_layers == 2
    )
    assert PRESETS["tiny-vl"].vision.hidden_size == 64  # the preset itself is untouched
    with pytest.raises(CheckpointError, match="unknown field"):
        PRESETS["tiny-vl"].replace(vision={"widht": 3})


def test_the_vision_attention_kernel_gives_the_gemm_paths_values_and_gradients(monkeypatch):
    """Float32 on the CPU the vision attention takes erniekit/nn/fused_attention.py, visiting each
    frame's own keys only; Paddle's GEMMs over all N x N scores give the same to float32 rounding,
    forward and backward, over frames of unequal sizes (the block-diagonal mask)."""
    from erniekit.models.ernie4_5_vl import vision
    from erniekit.models.ernie4_5_vl.configuration import VisionConfig
    from erniekit.nn import fused_attention

    if fused_attention._kernels() is None:
        pytest.skip("no C kernel here")
    paddle.seed(0)
    layer = vision.VisionAttention(VisionConfig(depth=1, hidden_size=64, num_heads=4, intermediate_size=64))
    rng = np.random.default_rng(0)
    lengths = [36, 16, 52]  # three frames
    n = sum(lengths)
    seg = np.repeat(np.arange(3), lengths)
    bias = paddle.to_tensor(np.where(seg[:, None] == seg[None, :], 0.0, -1e30).astype(np.float32))
    angles = rng.uniform(0, 3, (n, 8)).astype(np.float32)  # head_dim 16: two halves of 8
    cos, sin = (paddle.to_tensor(np.concatenate([f(angles)] * 2, -1)) for f in (np.cos, np.sin))
    x_np = rng.standard_normal((n, 64)).astype(np.float32)
    w = paddle.to_tensor(rng.standard_normal((n, 64)).astype(np.float32))
    taken = []
    real_usable = fused_attention.usable
    monkeypatch.setattr(fused_attention, "usable", lambda *a: taken.append(real_usable(*a)) or taken[-1])
    results = []
    for fused in (True, False):
        if not fused:
            assert taken == [True]  # the first pass went through the kernel
            monkeypatch.setattr(fused_attention, "usable", lambda *_: False)
        layer.clear_gradients()
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = layer(x, cos, sin, bias)
        (y * w).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), layer.qkv.weight.grad.numpy()])
    for name, a, b in zip(("output", "input grad", "qkv weight grad"), *results):
        np.testing.assert_allclose(a, b, atol=3e-5, rtol=1e-4, err_msg=name)
    # a frame's output depends on its own patches only
    x2 = x_np.copy()
    x2[36:52] += 1.0
    with paddle.no_grad():
        monkeypatch.undo()
        a, b = layer(paddle.to_tensor(x_np), cos, sin, bias), layer(paddle.to_tensor(x2), cos, sin, bias)
    np.testing.assert_array_equal(a.numpy()[:36], b.numpy()[:36])
    np.testing.assert_array_equal(a.numpy()[52:], b.numpy()[52:])
