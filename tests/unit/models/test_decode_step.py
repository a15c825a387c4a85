"""A model's decode step on the kernels directly (erniekit/models/ernie4_5/decode_step.py): the
logits and the KV cache get the layer-by-layer forward's bits, through KVCache (growing) and the
engine's SlotCache, packed or not, padded or not, dense layers and MoE blocks (with and without
shared experts); what it does not cover takes the layers."""

import numpy as np
import paddle
import pytest

from erniekit.infer.engine import SlotCache
from erniekit.models.ernie4_5 import decode_step
from erniekit.models.ernie4_5.configuration import Ernie4_5Config
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
from erniekit.nn import norm, small_gemm
from erniekit.nn.attention import KVCache, rope_cos_sin

V = 128


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    if norm.forward_kernel() is None or small_gemm._kernels() is None:
        pytest.skip("no C kernels here")
    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", 0)  # the tiny model's projections take the kernels
    yield
    small_gemm._PACKED.clear()


def _model(seed=0, bias=False, **extra):
    paddle.seed(seed)
    cfg = Ernie4_5Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, tie_word_embeddings=True, use_bias=bias, **extra,
    )  # fmt: skip
    model = Ernie4_5ForCausalLM(cfg)
    if bias:  # non-zero biases, so that adding them is seen
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.set_value(paddle.randn(p.shape) * 0.1)
    model.eval()
    return model


def _count_steps(monkeypatch, fast: bool) -> list[bool]:
    """decode_step.run patched to run (fast) or refuse every step; the list records, per call,
    whether the step answered."""
    real, taken = decode_step.run, []

    def step(*a, **k):
        out = real(*a, **k) if fast else None
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decode_step, "run", step)
    return taken


def _roll(model, monkeypatch, fast: bool, B: int, pad: bool, steps: int, cache):
    """Logits (as bits) of a prefill and `steps` decode steps, the number of steps the decode step
    took, and the cache's valid keys and values."""
    real, taken = decode_step.run, _count_steps(monkeypatch, fast)
    rng = np.random.default_rng(3)
    L = 6
    ids = rng.integers(0, V, (B, L))
    mask = np.ones((B, L + steps), np.int64)
    if pad:
        for i in range(B):
            mask[i, : i % L] = 0  # row i's prompt is L - i tokens (left padding)
    out = []
    with paddle.no_grad():
        x = paddle.to_tensor(ids)
        for s in range(steps + 1):
            am = paddle.to_tensor(mask[:, : L + s]) if pad else None
            logits = model(x, attention_mask=am, cache=cache, logits_to_keep=1).logits
            out.append(logits.numpy().view(np.uint32))
            x = paddle.to_tensor(rng.integers(0, V, (B, 1)))
    monkeypatch.setattr(decode_step, "run", real)
    n = cache.length
    kv = [t[:B, :n].numpy().view(np.uint32) for t in (*cache.k, *cache.v)]
    return out, sum(taken), kv


def _compare(model, monkeypatch, B, pad, steps, make_cache):
    fast, taken, kv = _roll(model, monkeypatch, True, B, pad, steps, make_cache())
    slow, none, kv_slow = _roll(model, monkeypatch, False, B, pad, steps, make_cache())
    assert taken == steps and none == 0  # every decode step (not the prefill) took it
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(kv, kv_slow):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "B,pad,packed,bias",
    [
        (1, False, False, False),
        (3, False, True, False),
        (3, True, False, True),
        (3, True, True, False),
        (9, True, True, True),
    ],
)
def test_decode_steps_give_the_layers_bits(monkeypatch, B, pad, packed, bias):
    model = _model(bias=bias)
    if packed:
        assert small_gemm.pack_weights(model) > 0  # 9 rows: only packed weights take the kernels
    _compare(model, monkeypatch, B, pad, 5, lambda: KVCache(model.config, B, 40))


def test_the_cache_grows_between_steps_and_old_buffers_are_let_go(monkeypatch):
    model = _model(seed=1)
    monkeypatch.setattr(KVCache, "GROW", 1)  # capacity 7 after the prompt, then 14, 28: growth mid-decode
    _compare(model, monkeypatch, 2, True, 12, lambda: KVCache(model.config, 2, 40))
    cache = KVCache(model.config, 2, 40)
    _roll(model, monkeypatch, True, 2, False, 9, cache)  # the last step (the 15th token) grows it
    assert cache.capacity == 28
    held = decode_step._BUFFERS[cache].views
    assert len(held) == 4 and {id(t) for t in (*cache.k, *cache.v)} == set(held)


class _GrowsInPlace(KVCache):
    """A cache whose buffers get new, larger storage in place: the same tensors at new addresses."""

    def _grow(self, end: int) -> None:
        cap = min(self.max_len, max(end + (self.GROW if self.capacity == 0 else 0), 2 * self.capacity))
        for t in (*self.k, *self.v):
            new = paddle.zeros([t.shape[0], cap, *t.shape[2:]], dtype=t.dtype)
            if self.length:
                new[:, : self.length] = t[:, : self.length]
            paddle.assign(new, output=t)


def test_a_cache_buffer_given_new_storage_in_place_is_viewed_again(monkeypatch):
    model = _model(seed=6)
    monkeypatch.setattr(KVCache, "GROW", 1)
    _compare(model, monkeypatch, 2, False, 10, lambda: _GrowsInPlace(model.config, 2, 40))


def test_a_batch_smaller_than_a_kv_caches_rows_takes_the_layers():
    """KVCache's `update` writes every row: the layers refuse 2 new tokens for a 3-row cache, and the
    step must not answer for them (the engine's SlotCache, which writes the first rows, may)."""
    model = _model()
    cache = KVCache(model.config, 3, 20)
    with paddle.no_grad():
        model(paddle.randint(0, V, [3, 4]), cache=cache)
        assert decode_step.run(model.model, paddle.randint(0, V, [2, 1]), None, cache) is None
    assert cache.length == 4


@pytest.mark.parametrize(
    "B,pad,min_bytes,packed,bias,moe",
    [
        (1, False, 1 << 18, False, False, False),  # the default floor: every projection is Paddle's (a tiny model)
        (3, True, 1 << 18, False, True, False),
        (4, True, 1 << 18, False, False, True),
        (2, False, 1 << 15, False, False, False),  # q, o and the MLP on the kernels, k and v on Paddle's GEMM
        (9, True, 0, False, True, False),  # more rows than the kernels take unpacked
        (70, True, 0, True, False, True),  # more rows than packed weights take
    ],
)
def test_products_paddles_gemm_takes_keep_its_bits_in_the_step(monkeypatch, B, pad, min_bytes, packed, bias, moe):
    """Where a layer's product goes to Paddle's linear (MKL's sgemm) the step makes MKL's call with
    Paddle's arguments: a tiny model (the embedded default's) decodes in the step with the layers'
    bits, at any batch."""
    from erniekit.nn import grouped_gemm

    if not grouped_gemm.available():
        pytest.skip("no MKL here: such products keep the layers")
    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", min_bytes)
    model = _model(seed=B, bias=bias, **(dict(moe_num_shared_experts=1, **MOE) if moe else {}))
    if packed:
        assert small_gemm.pack_weights(model) > 0
    _compare(model, monkeypatch, B, pad, 4, lambda: KVCache(model.config, B, 40))


def test_without_mkl_a_tiny_models_step_takes_the_layers(monkeypatch):
    """A wheel without MKL: nothing reproduces Paddle's GEMM, so a model whose projections go there
    decodes layer by layer."""
    from erniekit.nn import grouped_gemm

    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", 1 << 18)
    assert _step_taken(_model(seed=11)) == grouped_gemm.available()
    monkeypatch.setattr(grouped_gemm, "_lib", [None])
    assert not _step_taken(_model(seed=12))  # a fresh model: no plan of the first one's


def test_unpacking_frees_the_packed_copies_the_step_used(monkeypatch):
    import gc
    import weakref

    model = _model(seed=7)
    small_gemm.pack_weights(model)
    packed = [weakref.ref(entry[2]) for entry in small_gemm._PACKED.values()]
    for B in (1, 8):
        cache = KVCache(model.config, B, 20)
        with paddle.no_grad():
            model(paddle.randint(0, V, [B, 4]), cache=cache)
            assert decode_step.run(model.model, paddle.randint(0, V, [B, 1]), None, cache) is not None
    small_gemm.unpack_weights(model)
    gc.collect()
    assert packed and not any(r() is not None for r in packed)


def test_the_engines_slot_cache_with_fewer_running_rows_than_slots(monkeypatch):
    model = _model(seed=2)
    _compare(model, monkeypatch, 3, True, 4, lambda: SlotCache(model.config, 5, 20, "float32"))


def test_a_step_past_the_caches_end_is_refused_as_the_layers_refuse_it(monkeypatch):
    model = _model()
    for fast in (True, False):
        with pytest.raises(ValueError, match="KV cache full: 8 tokens > max_len=7"):
            _roll(model, monkeypatch, fast, 1, False, 2, KVCache(model.config, 1, 7))


def _step_taken(model, cache_len=6, B=2, **kw) -> bool:
    cache = KVCache(model.config, B, 20)
    with paddle.no_grad():
        model(paddle.randint(0, V, [B, cache_len]), cache=cache)
    before = cache.length
    with paddle.no_grad():
        out = decode_step.run(model.model, paddle.randint(0, V, [B, 1]), None, cache)
    assert out is not None or cache.length == before  # refused: nothing written
    return out is not None


def test_what_the_step_does_not_cover_takes_the_layers(monkeypatch):
    model = _model()
    assert _step_taken(model)
    handle = model.model.layers[1].mlp.register_forward_post_hook(lambda layer, args, out: out)
    assert not _step_taken(model)
    handle.remove()
    model.train()
    assert not _step_taken(model)
    model.eval()
    model.model.active_layers = [0]
    assert not _step_taken(model, B=1)
    model.model.active_layers = None
    cache = KVCache(model.config, 1, 20)
    with paddle.no_grad():
        model(paddle.randint(0, V, [1, 4]), cache=cache)
    assert decode_step.run(model.model, paddle.randint(0, V, [1, 1]), None, cache) is None  # gradient mode
    with paddle.no_grad():
        assert decode_step.run(model.model, paddle.to_tensor([[V]]), None, cache) is None  # the embedding reports it
        assert decode_step.run(model.model, paddle.randint(0, V, [1, 2]), None, cache) is None  # two tokens


MOE = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1)


@pytest.mark.parametrize(
    "B,pad,packed,shared,extra",
    [
        (1, False, False, 0, {}),
        (3, True, True, 1, {}),
        (9, True, True, 2, {}),
        (4, False, False, 1, {}),
        # top-4: a token's four rows are summed in index_add's order (top-2's two commute)
        (5, True, False, 0, dict(moe_k=4, moe_layer_start_index=0)),
        (5, False, True, 1, dict(moe_k=3, moe_layer_interval=2, moe_layer_start_index=0)),
    ],
)
def test_moe_decode_steps_give_the_layers_bits_and_routing(monkeypatch, B, pad, packed, shared, extra):
    """MoE blocks of 8 experts after a dense layer (or from layer 0, or every other layer), top-2 to
    top-4, with 0-2 shared experts: the logits, the cache and the routing each block records (RL's
    rollouts read it) are the layers'."""
    from erniekit.nn import grouped_gemm

    if not grouped_gemm.available():
        pytest.skip("no MKL batched GEMM here: MoE blocks take the layers")
    model = _model(seed=B, moe_num_shared_experts=shared, **{**MOE, **extra})
    if packed:
        assert small_gemm.pack_weights(model) > 0
    _compare(model, monkeypatch, B, pad, 5, lambda: KVCache(model.config, B, 40))
    blocks = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == "MoEBlock"]
    seen, real = {}, decode_step.run
    for fast in (True, False):
        taken = []
        monkeypatch.setattr(decode_step, "run", lambda *a, f=fast, t=taken: t.append(1) or real(*a) if f else None)
        cache = KVCache(model.config, B, 20)
        with paddle.no_grad():
            model(paddle.to_tensor(np.arange(B * 4).reshape(B, 4) % V), cache=cache)
            taken.clear()
            model(paddle.to_tensor(np.arange(B).reshape(B, 1) + 7), cache=cache)
        assert len(taken) == fast
        seen[fast] = [(b.last_topk_idx.numpy(), b.last_probs.numpy().view(np.uint32)) for b in blocks]
    monkeypatch.setattr(decode_step, "run", real)
    for (i, p), (j, q) in zip(seen[True], seen[False]):
        np.testing.assert_array_equal(i, j)
        np.testing.assert_array_equal(p, q)


def test_moe_steps_in_the_engines_slot_cache(monkeypatch):
    from erniekit.nn import grouped_gemm

    if not grouped_gemm.available():
        pytest.skip("no MKL batched GEMM here")
    model = _model(seed=5, moe_num_shared_experts=1, **MOE)
    _compare(model, monkeypatch, 3, True, 4, lambda: SlotCache(model.config, 5, 20, "float32"))


def test_the_steps_buffers_start_at_64_bytes_as_paddles_do():
    """MKL may round a product by its operands' alignment: the buffers the MoE blocks hand it are
    aligned as Paddle's tensors are (numpy's own start 16 bytes past a boundary, or 32, or 48)."""
    buf = decode_step._Buffers()
    for rows in (1, 3, 9):
        arrays = buf.activations(rows, {"a": (1, 5), "b": (3, 7), "c": (2, 64)})
        assert all(a.ctypes.data % 64 == 0 and a.flags.c_contiguous for a in arrays.values())
        assert [a.shape for a in arrays.values()] == [(rows, 5), (3 * rows, 7), (2 * rows, 64)]
        assert all(not a.any() for a in arrays.values())


def test_moe_blocks_the_step_does_not_reproduce_take_the_layers(monkeypatch):
    from erniekit.nn import grouped_gemm
    from erniekit.nn.lora import LoraConfig, apply_lora
    from erniekit.nn.moe import RoutingReference

    if not grouped_gemm.available():
        pytest.skip("no MKL batched GEMM here")
    model = _model(**MOE)
    assert _step_taken(model)
    block, gate = model.model.layers[1].mlp, model.model.layers[1].mlp.gate
    for obj, name, value in (
        (block, "capacity_factor", 1.0),  # assignments may be dropped
        (gate, "active_k", 1),  # an elastic sub-model
        (gate, "active_experts", 4),
        (block.experts, "fp8_block", 16),  # FP8 experts
    ):
        before = getattr(obj, name)
        setattr(obj, name, value)
        assert not _step_taken(model), name
        setattr(obj, name, before)
    cache = KVCache(model.config, 2, 20)
    with paddle.no_grad():
        model(paddle.randint(0, V, [2, 6]), cache=cache)
        block.routing_reference = RoutingReference(paddle.zeros([2, 2], "int64"), paddle.ones([2], "bool"), True)
        assert decode_step.run(model.model, paddle.randint(0, V, [2, 1]), None, cache) is None  # routing replay
        block.routing_reference = None
    assert _step_taken(model)
    with monkeypatch.context() as m:
        m.setattr(grouped_gemm, "available", lambda: False)
        assert not _step_taken(model)
    for hooked in (gate, block.experts, block):
        handle = hooked.register_forward_post_hook(lambda layer, args, out: out)
        assert not _step_taken(model)
        handle.remove()
    block.train()  # a block in training mode inside an eval model counts its load as the layers do
    assert not _step_taken(model)
    block.eval()
    assert _step_taken(model)
    lora = _model(**MOE)
    apply_lora(lora, LoraConfig(r=4, target_modules=[".*experts"]))
    lora.eval()
    assert not _step_taken(lora)


def test_an_adapter_is_never_skipped(monkeypatch):
    from erniekit.nn.lora import LoraConfig, apply_lora

    model = _model(seed=4)
    apply_lora(model, LoraConfig(r=4, target_modules=[".*v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: a non-zero one changes the logits
            p.set_value(paddle.randn(p.shape) * 0.5)
    model.eval()
    assert not _step_taken(model)


@pytest.mark.parametrize("packed", [False, True])
def test_weights_changed_in_place_between_steps_are_read_again(monkeypatch, packed):
    """The step keeps its kernels' calls while the weights are the same tensors; a weight changed in
    place after a step must still be read: the kernels read it as it is, and a packed copy made stale
    by one of Paddle's in-place ops (which bump the tensor's version) is dropped."""
    model = _model(seed=5)
    if packed:
        small_gemm.pack_weights(model)
    real = decode_step.run

    def logits(fast):
        monkeypatch.setattr(decode_step, "run", real if fast else (lambda *a: None))
        cache = KVCache(model.config, 3, 20)
        with paddle.no_grad():
            model(paddle.to_tensor([[1, 2, 3]] * 3), cache=cache)
            return model(paddle.to_tensor([[4], [5], [6]]), cache=cache).logits.numpy().view(np.uint32)

    before = logits(True)
    w = model.model.layers[1].mlp.down_proj.weight
    if packed:
        with paddle.no_grad():
            w.scale_(1.5)
        assert small_gemm.packed_of(w) is None
    else:
        w.set_value(w * 1.5)
    after = logits(True)
    want = logits(False)
    assert not np.array_equal(before, after)
    np.testing.assert_array_equal(after, want)


def _core(D, theta):
    cfg = Ernie4_5Config(vocab_size=V, hidden_size=D * 2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=D, rope_theta=theta, num_hidden_layers=1)  # fmt: skip
    return cfg, Ernie4_5ForCausalLM(cfg).model


def _same_bits(got, want, rows):
    want = want.numpy().reshape(rows, -1)
    assert got.dtype == np.float32 and got.shape == want.shape and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("D,theta", [(16, 500000.0), (64, 10000.0), (128, 10000.0)])
def test_the_rope_tables_rows_are_rope_and_masks_bits(monkeypatch, D, theta):
    """A step reads cos / sin from a table filled 256 rows at a time (to 768 here) and builds
    its bias in numpy: each must be what `rope_and_mask` gives, bit for bit, at one row and at
    several, without a mask and with a left-padding one (a row of padding only included); a table
    is one (head_dim, theta)'s only."""
    monkeypatch.setattr(decode_step, "_ROPE_ROWS", {})
    cfg, core = _core(D, theta)
    rng = np.random.default_rng(D)
    for past in (0, 1, 255, 256, 257, 511, 700, 3):  # 3: a row of the rebuilt table
        for B in (1, 3):
            ids = paddle.zeros([B, 1], "int64")
            cos, sin, bias = decode_step._rope_rows(cfg, past, B)
            want = core.rope_and_mask(ids, None, None, None, past)
            _same_bits(cos, want[0], B)
            _same_bits(sin, want[1], B)
            assert bias.shape[0] == 1 and not bias[0, : past + 1].any()
            _same_bits(bias[:, : past + 1], want[2][1], 1)
            starts = rng.integers(0, past + 2, (B, 1))
            starts[-1] = past + 1  # the last row: padding only
            mask = (np.arange(past + 1)[None] >= starts).astype(np.int64)
            got = decode_step._rope_rows(cfg, past, B, mask)
            want = core.rope_and_mask(ids, None, None, paddle.to_tensor(mask), past)
            for g, w in zip(got, (*want[:2], want[2][1])):
                _same_bits(g, w, B)
    table = decode_step._ROPE_ROWS[(D, theta)]
    assert table.n == 768 and len(table.cos) == 1024  # filled 256 rows at a time, its buffer doubled
    other, _ = _core(D, theta * 2)
    assert not np.array_equal(decode_step._rope_rows(other, 5, 1)[0], decode_step._rope_rows(cfg, 5, 1)[0])


def test_a_long_unmasked_generation_gives_the_layers_bits_across_the_tables_growth(monkeypatch):
    """Past 256 positions the table is rebuilt at 512 rows mid-generation; every step's logits and
    the cache stay the layers'."""
    model = _model(seed=8)
    monkeypatch.setattr(decode_step, "_ROPE_ROWS", {})
    _compare(model, monkeypatch, 2, False, 260, lambda: KVCache(model.config, 2, 280))
    assert decode_step._ROPE_ROWS[(16, float(model.config.rope_theta))].n == 512


def test_the_rope_table_filled_from_several_threads_holds_the_positions_values(monkeypatch):
    """The engine's thread and a chat's may fill one table at once: every row any of them reads is
    the one-call table's, bit for bit."""
    import threading

    monkeypatch.setattr(decode_step, "_ROPE_ROWS", {})
    cfg, core = _core(16, 10000.0)
    want = [
        t.numpy().reshape(-1, 16).view(np.uint32) for t in rope_cos_sin(paddle.arange(3000).unsqueeze(0), 16, 10000.0)
    ]
    bad = []

    def reader(seed):
        rng = np.random.default_rng(seed)
        for past in [*np.sort(rng.integers(0, 2999, 60)), 2999]:
            mask = (np.arange(past + 1)[None] >= rng.integers(0, past + 1, (3, 1))).astype(np.int64)
            cos, sin, _ = decode_step._rope_rows(cfg, int(past), 3, mask)
            pos = mask.sum(axis=1) - 1
            if not (
                np.array_equal(cos.view(np.uint32), want[0][pos]) and np.array_equal(sin.view(np.uint32), want[1][pos])
            ):
                bad.append(int(past))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not bad and decode_step._ROPE_ROWS[(16, 10000.0)].n == 3072


def test_a_float_or_uint8_mask_takes_the_table_as_an_int64_one():
    """rope_and_mask sums the mask as int64: a float mask must index the table as well, and a uint8
    one with a row of padding only must not wrap below zero."""
    cfg, core = _core(16, 10000.0)
    mask = np.array([[0, 1, 1, 1], [0, 0, 0, 0]], np.int64)
    want = decode_step._rope_rows(cfg, 3, 2, mask)
    for dtype in (np.float32, np.uint8, bool):
        got = decode_step._rope_rows(cfg, 3, 2, mask.astype(dtype))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def _vl_roll(model, monkeypatch, fast: bool, steps: int, B: int, image: bool):
    """A VL model's logits (as bits) over a prefill and `steps` decode steps of text tokens, as
    generate_vl (one row with an image) or the engine (B rows, left padding, a 3-D position offset
    per row) drive it; the steps taken, the cache and each MoE block's recorded routing."""
    from erniekit.models.ernie4_5_vl.modeling import rope_index

    real, taken = decode_step.run, _count_steps(monkeypatch, fast)
    c, rng = model.config, np.random.default_rng(5)
    L = 12
    ids = rng.integers(3, 1000, (B, L))
    kw, delta = {}, np.zeros(B, np.int64)
    if image:  # a 1 x 4 x 4 grid: 4 placeholders between its start and end tokens
        ids[0, 3:9] = [c.image_start_token_id] + [c.image_token_id] * 4 + [c.image_end_token_id]
        pixels = rng.standard_normal((16, 3 * 14 * 14)).astype(np.float32)
        kw = dict(pixel_values=paddle.to_tensor(pixels), image_grid_thw=[[1, 4, 4]])
        pos, deltas = rope_index(ids, c, kw["image_grid_thw"], None)
        kw["position_ids"], delta = paddle.to_tensor(pos), np.asarray(deltas, np.int64)
    mask = np.ones((B, L + steps), np.int64)
    for i in range(B):
        mask[i, : 2 * i] = 0
    if B > 1:
        delta = np.arange(B) * 3  # as the engine offsets a row's positions
        pos = np.clip(np.cumsum(mask[:, :L], axis=1) - 1, 0, None) + delta[:, None]
        kw["position_ids"] = paddle.to_tensor(np.broadcast_to(pos[None], (3, B, L)).copy())
    cache = KVCache(c, B, L + steps)
    out, routing = [], []
    blocks = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == "MoEBlock"]
    with paddle.no_grad():
        am = paddle.to_tensor(mask[:, :L]) if B > 1 else None
        logits = model(paddle.to_tensor(ids), attention_mask=am, cache=cache, logits_to_keep=1, **kw).logits
        for s in range(steps):
            out.append(logits.numpy().view(np.uint32))
            p = mask[:, : L + s + 1].sum(axis=1) - 1 + delta if B > 1 else np.full(1, cache.length + delta[0])
            pos3 = paddle.to_tensor(np.broadcast_to(p[None, :, None], (3, B, 1)).copy())
            am = paddle.to_tensor(mask[:, : L + s + 1]) if B > 1 else None
            x = paddle.to_tensor(rng.integers(3, 1000, (B, 1)))
            logits = model(x, attention_mask=am, position_ids=pos3, cache=cache, logits_to_keep=1).logits
            routing.append([(b.last_topk_idx.numpy(), b.last_probs.numpy().view(np.uint32)) for b in blocks])
    monkeypatch.setattr(decode_step, "run", real)
    out.append(logits.numpy().view(np.uint32))
    kv = [t[:B, : cache.length].numpy().view(np.uint32) for t in (*cache.k, *cache.v)]
    return out, sum(taken), kv, routing


@pytest.mark.parametrize("B,image,min_bytes", [(1, True, 0), (1, True, 1 << 18), (3, False, 0)])
def test_a_vl_models_text_tokens_take_the_step_with_the_layers_bits(monkeypatch, B, image, min_bytes):
    """ERNIE-4.5-VL's decode of text tokens (3-D positions with equal rows, modality-isolated MoE
    blocks routing them to the text experts): logits, cache and recorded routing (global expert
    columns) are the layers', after a prompt with an image or, as the engine drives it, padded rows
    at offset positions."""
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.registry import model_config
    from erniekit.nn import grouped_gemm

    if not grouped_gemm.available():
        pytest.skip("no MKL here: MoE blocks take the layers")
    monkeypatch.setattr(small_gemm, "KN_MIN_BYTES", min_bytes)
    paddle.seed(B)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    model.eval()
    fast = _vl_roll(model, monkeypatch, True, 4, B, image)
    slow = _vl_roll(model, monkeypatch, False, 4, B, image)
    assert fast[1] == 4 and slow[1] == 0
    for a, b in zip(fast[0] + fast[2], slow[0] + slow[2]):
        np.testing.assert_array_equal(a, b)
    for step_a, step_b in zip(fast[3], slow[3]):
        for (i, p), (j, q) in zip(step_a, step_b):
            assert p.shape[1] == 16  # both modalities' columns, the vision ones zero
            np.testing.assert_array_equal(i, j)
            np.testing.assert_array_equal(p, q)


def test_positions_the_step_cannot_take_leave_it_to_the_layers():
    pos = paddle.to_tensor([[[4]], [[4]], [[5]]])  # a vision token's 3-D position: rows differ
    assert decode_step._text_positions(pos, 1, True) is None
    assert decode_step._text_positions(paddle.to_tensor([[-1]]), 1, True) is None
    assert decode_step._text_positions(paddle.to_tensor([[2, 3]]), 1, True) is None
    equal = paddle.to_tensor([[[7]], [[7]], [[7]]])
    assert decode_step._text_positions(equal, 1, True).tolist() == [7]
    assert decode_step._text_positions(equal, 1, False) is None  # a text model: the layers refuse 3-D positions
    model = _model()
    cache = KVCache(model.config, 1, 20)
    with paddle.no_grad():
        model(paddle.randint(0, V, [1, 4]), cache=cache)
        assert decode_step.run(model.model, paddle.randint(0, V, [1, 1]), None, cache, equal) is None
        assert (
            decode_step.run(model.model, paddle.randint(0, V, [1, 1]), None, cache, paddle.to_tensor([[4]])) is not None
        )


@pytest.mark.parametrize("B,k", [(32, 2), (33, 2), (16, 4), (17, 4)])
def test_the_step_and_the_layers_pick_the_same_expert_products_on_either_side_of_decode_rows(monkeypatch, B, k):
    """Up to grouped_gemm.DECODE_ROWS dispatched rows (B x top-k) the experts' small groups take the
    kn kernel, past it MKL's batch: the step decides as the layers do, so the bits stay equal."""
    from erniekit.nn import grouped_gemm

    model = _model(seed=B, moe_num_shared_experts=1, **{**MOE, "moe_k": k, "moe_layer_start_index": 0})
    decided = []
    real = grouped_gemm.run_products
    monkeypatch.setattr(grouped_gemm, "run_products", lambda p, d: decided.append(d) or real(p, d))
    _compare(model, monkeypatch, B, True, 3, lambda: KVCache(model.config, B, 20))
    assert decided and all(d == (B * k <= grouped_gemm.DECODE_ROWS) for d in decided[-4:])
