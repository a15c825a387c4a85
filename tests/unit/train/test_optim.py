"""AdamW (erniekit/train/optim.py) against the formula in float64, on both of its paths: the numpy
update for dense float32 CPU tensors and the Paddle-op update every other tensor takes; and how
the gradient clip groups sharded gradients."""

import numpy as np
import paddle
import pytest

from erniekit.nn import native
from erniekit.train import optim
from erniekit.utils.dtensor import host_view


def _reference(p0, grads, lr, b1, b2, eps, wd, mult, decay):
    p, m, v = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        plr = lr * mult
        if decay:
            p = p * (1 - plr * wd)
        p = p - plr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("path", ["c", "numpy", "paddle"])
def test_adamw_follows_the_formula(monkeypatch, path):
    if path == "numpy":
        monkeypatch.setattr(optim, "_native_adamw", lambda *a: False)
    if path == "paddle":
        monkeypatch.setattr(optim, "_numpy_step", lambda *a: False)
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "norm": (7,), "lora_B": (3, 4)}
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    grads = {n: [rng.standard_normal(s).astype(np.float32) * 10.0**-k for k in range(4)] for n, s in shapes.items()}
    params = {n: paddle.create_parameter(list(s), "float32") for n, s in shapes.items()}
    for n, p in params.items():
        p.set_value(paddle.to_tensor(init[n]))
    opt = optim.AdamW(
        list(params.items()), lr=3e-2, weight_decay=0.1, no_decay={"norm"}, lr_mult={"lora_B": 4.0}, epsilon=1e-6
    )
    for k in range(4):
        for n, p in params.items():
            (p * paddle.to_tensor(grads[n][k])).sum().backward()
        opt.step()
        opt.clear_grad()
    for n, p in params.items():
        want = _reference(init[n], grads[n], 3e-2, 0.9, 0.999, 1e-6, 0.1, 4.0 if n == "lora_B" else 1.0, n != "norm")
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-6, atol=1e-7)
        assert not np.allclose(p.numpy(), init[n])
    assert opt.state_dict()["w::exp_avg"].shape == [5, 7]


@pytest.mark.parametrize("decay", [None, 0.999])
def test_the_c_kernel_gives_numpys_bits_on_any_thread_count(monkeypatch, decay):
    """kernels/adamw.c against the numpy passes it replaces: the same bits, cut over 1 or 3 threads."""
    if native.adamw() is None:
        pytest.skip(f"no C kernel here: {native.why_not.get('adamw')}")
    rng = np.random.default_rng(1)
    n = 10007  # not a multiple of any vector width
    start = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    start[2] = np.abs(start[2])  # v >= 0
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 2, n)).astype(np.float32)  # tiny to large
    args = (0.9, 0.999, 3e-3 / (1 - 0.9**3), 1 - 0.999**3, 1e-8, decay)

    def run(use_c: bool, threads: str) -> list[np.ndarray]:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        p, m, v = (paddle.to_tensor(a.copy()) for a in start)
        if not use_c:
            monkeypatch.setattr(optim, "_native_adamw", lambda *a: False)
        assert optim._numpy_step(p, paddle.to_tensor(g), m, v, *args)
        monkeypatch.undo()
        return [t.numpy().view(np.uint32) for t in (p, m, v)]

    monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
    want = run(False, "1")
    for threads in ("1", "3"):
        monkeypatch.setattr(native, "PARALLEL_BYTES", 1)
        for got, exp in zip(run(True, threads), want):
            np.testing.assert_array_equal(got, exp)
    assert not np.array_equal(want[0], start[0].view(np.uint32))


def test_numpy_path_only_takes_dense_float32_cpu_tensors():
    assert host_view(paddle.ones([2, 3])) is not None
    assert host_view(paddle.ones([2, 3], "float64")) is None
    p = paddle.create_parameter([2, 2], "float32")
    view = host_view(p)
    view += 1.0  # writes through to the parameter: no copy
    np.testing.assert_array_equal(view, p.numpy())


def test_vit_lr_ratio_scales_the_vision_side_of_a_vl_model_only():
    """VL-SFT's vit_lr_ratio reaches AdamW as the vision encoder's and resampler's multiplier;
    the text model keeps the base learning rate; 0 and negatives are refused before training."""
    from erniekit.config import load_config, validate
    from erniekit.errors import ConfigError
    from erniekit.models.registry import load_model
    from erniekit.train.stages import get_stage

    cfg = load_config(None, ["stage=VL-SFT", "model_name_or_path=tiny-vl", "vit_lr_ratio=0.1"])
    model = load_model("tiny-vl")
    opt = optim.build_optimizer(model, cfg.optim, lr_ratios=get_stage(cfg.stage).lr_ratios(cfg))
    names = [n for n, _ in model.named_parameters()]
    vision = [n for n in names if n.startswith(("vision_model.", "resampler_model."))]
    assert vision and {opt.lr_mult[n] for n in vision} == {0.1}
    assert set(opt.lr_mult) == set(vision)
    with pytest.raises(ConfigError, match="vit_lr_ratio"):
        validate(load_config(None, ["stage=VL-SFT", "model_name_or_path=tiny-vl", "vit_lr_ratio=0"]))


def test_clip_sums_squares_once_per_sharding_pattern_and_gives_the_dense_norm(monkeypatch):
    """clip_grad_norm_ adds the local squares of gradients sharded over the same mesh dims and
    reduces each such group once (the e2e distributed test checks the reduction on 2 processes);
    here, on one process, which gradients share a group and that the norm and the scaling are the
    plain ones."""
    import paddle.distributed as dist

    rng = np.random.default_rng(0)
    mesh = dist.ProcessMesh([[0]], dim_names=["dp", "tp"])
    other = dist.ProcessMesh([0], dim_names=["ep"])
    values = [rng.standard_normal(s).astype(np.float32) for s in ([4, 6], [6, 4], [5], [3, 2], [2, 2], [7])]

    def dist_grad(v, mesh, placements):
        return dist.shard_tensor(paddle.to_tensor(v), mesh, placements)

    grads = [
        dist_grad(values[0], mesh, [dist.Replicate(), dist.Shard(1)]),  # tp column
        dist_grad(values[1], mesh, [dist.Replicate(), dist.Shard(0)]),  # tp row: same dims, same group
        dist_grad(values[2], mesh, [dist.Replicate(), dist.Replicate()]),  # replicated: on its own
        dist_grad(values[3], mesh, [dist.Shard(0), dist.Replicate()]),  # over dp: another group
        dist_grad(values[4], other, [dist.Shard(0)]),  # another mesh: another group
        paddle.to_tensor(values[5]),  # a plain tensor
    ]
    assert [optim._shard_dims(g) for g in grads] == [(1,), (1,), None, (0,), (0,), None]
    partial = dist.shard_tensor(paddle.to_tensor(values[2]), mesh, [dist.Partial(), dist.Replicate()])
    assert optim._shard_dims(partial) is None  # a partial sum is reduced before it is squared

    groups = []
    real = optim._sum_over_shards
    monkeypatch.setattr(optim, "_sum_over_shards", lambda g, d: groups.append(([id(x) for x in g], d)) or real(g, d))
    want = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in values)))
    params = [object() for _ in grads]
    norm = optim.clip_grad_norm_(params, want / 2, {id(p): g for p, g in zip(params, grads)})
    assert sorted(groups, key=str) == sorted(
        [([id(grads[0]), id(grads[1])], (1,)), ([id(grads[3])], (0,)), ([id(grads[4])], (0,))], key=str
    )
    assert norm == pytest.approx(want, rel=1e-6)
    coef = (want / 2) / (norm + 1e-6)
    for v, g in zip(values, grads):
        local = g._local_value() if g.is_dist() else g
        np.testing.assert_allclose(local.numpy(), v * coef, rtol=1e-6)


def test_clear_grad_gives_the_gradients_memory_back_and_the_next_step_starts_from_zero():
    """As torch's zero_grad(set_to_none=True): Paddle's clear_gradient(set_to_zero=False) kept every
    buffer allocated through the next forward; the next backward's gradient is its own, not a sum."""
    from types import SimpleNamespace

    from erniekit.utils.malloc import live_bytes as live

    if live() is None:
        pytest.skip("glibc >= 2.33 (mallinfo2)")

    model = paddle.nn.Linear(2048, 2048, bias_attr=False)  # a 16 MiB weight
    hp = SimpleNamespace(learning_rate=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
    opt = optim.build_optimizer(model, hp)
    x = paddle.ones([1, 2048])
    model(x).sum().backward()
    opt.step()
    before = live()
    opt.clear_grad()
    assert model.weight.grad is None and before - live() >= 16 << 20
    (model(x) * 3).sum().backward()
    np.testing.assert_array_equal(model.weight.grad.numpy(), np.full([2048, 2048], 3, np.float32))


def _two_layer_steps(clear, steps=3):
    """Step 1 trains both layers; later steps only the first (the second gets no gradient), with
    `clear(opt)` between steps and `restore_unused_grads` after each backward, as the trainer does."""
    from types import SimpleNamespace

    paddle.seed(0)
    a, b = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
    hp = SimpleNamespace(learning_rate=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.1)
    opt = optim.build_optimizer(paddle.nn.LayerList([a, b]), hp)
    x = paddle.ones([2, 4])
    for i in range(steps):
        (b(a(x)) if i == 0 else a(x)).sum().backward()
        opt.restore_unused_grads()
        opt.step()
        clear(opt)
    return [p.numpy().copy() for p in (*a.parameters(), *b.parameters())]


def test_a_parameter_without_a_gradient_still_steps_on_zeros_as_before():
    """Paddle's clear_gradient(set_to_zero=False) left zeros that AdamW stepped on (momentum and
    decay keep moving an unused parameter); dropping the gradient must not change that."""

    def paddle_clear(opt):
        for _, p in opt.params:
            p.clear_gradient(set_to_zero=False)

    ours, before = _two_layer_steps(lambda opt: opt.clear_grad()), _two_layer_steps(paddle_clear)
    for x, y in zip(ours, before):
        np.testing.assert_array_equal(x, y)
    once = _two_layer_steps(lambda opt: opt.clear_grad(), steps=1)
    assert not np.array_equal(ours[2], once[2])  # the unused layer moved after step 1


def test_clear_grad_keeps_a_dist_tensors_gradient_readable():
    """`grad = None` on a DistTensor parameter leaves an undefined tensor the next step crashes on;
    clear_grad keeps Paddle's clear there, so a step in which it gets no gradient still runs."""
    from types import SimpleNamespace

    import paddle.distributed as dist

    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    layer = paddle.nn.Linear(4, 4)
    layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate()])
    hp = SimpleNamespace(learning_rate=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
    opt = optim.build_optimizer(layer, hp)
    x = dist.shard_tensor(paddle.ones([2, 4]), mesh, [dist.Replicate()])
    layer(x).sum().backward()
    opt.step()
    opt.clear_grad()
    assert layer.weight.grad is not None and layer.weight.grad._is_initialized()
    opt.restore_unused_grads()
    grads = optim.reduced_grads([p for _, p in opt.params])
    optim.clip_grad_norm_([p for _, p in opt.params], 1.0, grads)
    opt.step(grads)
