"""Decode-sized products (erniekit/nn/small_gemm.py, kernels/small_gemm.c): the C kernels give the
bits of their numpy twins at any thread count and the product in float64 to rounding; only
gradient-free float32 CPU calls of a few rows take them; a model decodes the same tokens with and
without them."""

import numpy as np
import paddle
import pytest

from erniekit.nn import linear as lin
from erniekit.nn import native
from erniekit.nn import small_gemm as sg

KERNEL_MODULE = sg


def _tiny_lm(vocab: int, layers: int, seed: int):
    """A random tied ERNIE 4.5 causal LM with 64-wide hidden states."""
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config
    from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM

    paddle.seed(seed)
    cfg = Ernie4_5Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return Ernie4_5ForCausalLM(cfg)


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize(
    "rows,k,n", [(1, 16, 16), (3, 64, 80), (7, 1024, 3072), (8, 64, 32), (5, 96, 4112), (2, 17 * 16, 32)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kn_gives_its_numpy_twins_bits_and_the_product(kernel, bits, rows, k, n, with_bias):
    x, w, b = _arrays((rows, k), (k, n), (n,), seed=rows + k + n)
    b = b if with_bias else None
    with paddle.no_grad():
        y = sg.matmul_kn(paddle.to_tensor(x), paddle.to_tensor(w), None if b is None else paddle.to_tensor(b))
    np.testing.assert_array_equal(bits(y), bits(sg.numpy_kn(x, w, b)))
    want = x.astype(np.float64) @ w + (0 if b is None else b)
    np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=4e-6 * np.sqrt(k) * np.abs(want).max())


@pytest.mark.parametrize("rows,k,n", [(1, 16, 1), (3, 64, 81), (8, 1024, 1000), (2, 48, 7)])
def test_nk_gives_its_numpy_twins_bits_and_the_product(kernel, bits, rows, k, n):
    x, w = _arrays((rows, k), (n, k), seed=rows * k + n)
    y = sg.matmul_nk(paddle.to_tensor(x), paddle.to_tensor(w))
    np.testing.assert_array_equal(bits(y), bits(sg.numpy_nk(x, w)))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=4e-6 * np.sqrt(k) * np.abs(want).max())


def test_the_numpy_twins_are_the_sums_they_describe():
    """kn: two in-order halves of k, each by fused multiply-adds (native.fma32: one rounding per k),
    added; nk: 16 lanes (k % 16) of rounded products in order, then the lanes."""
    x, w = _arrays((1, 32), (32, 1), seed=6)
    p = x[0] * w[:, 0]
    halves = [np.float32(0)] * 2
    for k in range(32):
        halves[k // 16] = native.fma32(x[0, k], w[k, 0], halves[k // 16])
    assert sg.numpy_kn(x, w)[0, 0] == np.float32(halves[0] + halves[1])
    unfused = [np.float32(0)] * 2
    for k in range(32):
        unfused[k // 16] = np.float32(unfused[k // 16] + p[k])
    assert np.float32(unfused[0] + unfused[1]) != np.float32(halves[0] + halves[1])  # the data tells them apart
    lanes = [np.float32(0)] * 16
    for k in range(32):
        lanes[k % 16] = np.float32(lanes[k % 16] + p[k])
    total = lanes[0]
    for lane in lanes[1:]:
        total = np.float32(total + lane)
    assert sg.numpy_nk(x, w.T)[0, 0] == total


def test_threads_do_not_change_the_bits(kernel, bits):
    kn, nk = kernel[:2]
    x, w, b = _arrays((6, 512), (512, 1040), (1040,), seed=9)
    X, W, B = (paddle.to_tensor(a) for a in (x, w, b))
    Wt = paddle.to_tensor(np.ascontiguousarray(w.T))
    outs = []
    for threads in (1, 2, 3, 4):
        y, tmp, z = (paddle.empty(s) for s in ([6, 1040], [6, 1040], [6, 1040]))
        kn(X.data_ptr(), W.data_ptr(), B.data_ptr(), y.data_ptr(), tmp.data_ptr(), 6, 512, 1040, threads)
        nk(X.data_ptr(), Wt.data_ptr(), z.data_ptr(), 6, 512, 1040, threads)
        outs.append((bits(y).copy(), bits(z).copy()))
    for got in outs[1:]:
        np.testing.assert_array_equal(got[0], outs[0][0])
        np.testing.assert_array_equal(got[1], outs[0][1])


def test_only_gradient_free_float32_calls_of_a_few_rows_take_the_kernel(kernel):
    w = paddle.randn([512, 512])
    x = paddle.randn([1, 2, 512])
    with paddle.no_grad():
        assert sg.takes_kn(x, w, None) and sg.takes_nk(x, w)
        assert not sg.takes_kn(paddle.randn([2, 4, 512]), w, None)  # 8 rows > KN_ROWS
        assert not sg.takes_nk(paddle.randn([9, 512]), w)
        assert not sg.takes_kn(x, paddle.randn([512, 64]), None)  # 128 KiB: under KN_MIN_BYTES
        assert not sg.takes_kn(x.astype("float64"), w.astype("float64"), None)
        assert not sg.takes_kn(paddle.randn([1, 520]), paddle.randn([520, 512]), None)  # K % 16
        assert not sg.takes_kn(paddle.randn([1, 0, 512]), w, None)
    # with gradients on, a tensor that wants one keeps Paddle's op (autograd records it)
    trainable = paddle.create_parameter([512, 512], "float32")
    assert not sg.takes_kn(x, trainable, None) and not sg.takes_nk(x, trainable)
    assert sg.takes_kn(x, w, None)  # nothing here wants a gradient


def test_a_build_without_fused_multiply_add_instructions_is_left_to_paddle(monkeypatch):
    """The kernels' sums are fused multiply-adds: a build where those are libm calls (15-20x slower)
    is not used, and says why; a build for a CPU with FMA is (not the `kernel` fixture: it would skip
    this test where the check wrongly says no)."""
    if native.load("small_gemm") is None:
        pytest.skip(f"no C kernel here: {native.why_not}")
    flags = native._cpu_flags().split()
    if "fma" in flags or "avx512f" in flags:
        assert sg._lookup() is not None, native.why_not
    real = native.functions
    no_fma = lambda *a: (*real(*a)[:6], lambda: 0)  # noqa: E731
    monkeypatch.setattr(native, "functions", no_fma)
    monkeypatch.setattr(native, "why_not", {})
    assert sg._lookup() is None
    assert "fused multiply-add" in native.why_not["small_gemm"]


def test_nothing_takes_it_without_the_build(monkeypatch):
    monkeypatch.setattr(sg, "_cached", [None])
    with paddle.no_grad():
        x, w = paddle.randn([1, 512]), paddle.randn([512, 512])
        assert not sg.takes_kn(x, w, None) and not sg.takes_nk(x, w)
        np.testing.assert_allclose(lin.linear(x, w).numpy(), (x @ w).numpy(), rtol=1e-6, atol=1e-6)


def test_linear_routes_decode_calls_to_it_and_training_calls_to_paddle(kernel, bits, monkeypatch):
    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    layer = lin.Linear(64, 48)
    x = paddle.randn([1, 1, 64])
    with paddle.no_grad():
        y = layer(x)
    want = sg.numpy_kn(x.numpy(), layer.weight.numpy(), layer.bias.numpy()).reshape(1, 1, 48)
    np.testing.assert_array_equal(bits(y), bits(want))
    xg = x.clone()
    xg.stop_gradient = False
    y = layer(xg)  # a training forward: Paddle's op, with its gradient
    y.sum().backward()
    np.testing.assert_allclose(layer.weight.grad.numpy(), np.repeat(xg.numpy().reshape(64, 1), 48, 1), rtol=1e-6)


def test_a_model_decodes_the_same_with_and_without_it(kernel, monkeypatch):
    from erniekit.infer.generate import generate
    from erniekit.infer.sampling import SamplingParams
    from erniekit.models.ernie4_5 import decode_step

    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    # the layers' own routing: the decode step (tests/unit/models/test_decode_step.py) calls the kernels directly
    monkeypatch.setattr(decode_step, "run", lambda *a: None)
    model = _tiny_lm(512, 2, seed=0)
    model.eval()
    prompts = np.random.default_rng(1).integers(0, 512, (3, 7)).tolist()
    calls = []
    kn, nk = sg.matmul_kn, sg.matmul_nk
    monkeypatch.setattr(sg, "matmul_kn", lambda *a: calls.append("kn") or kn(*a))
    monkeypatch.setattr(sg, "matmul_nk", lambda *a: calls.append("nk") or nk(*a))
    with_it = generate(model, prompts, SamplingParams(max_new_tokens=12))
    assert calls.count("nk") >= 11 and calls.count("kn") >= 11 * 2 * 7  # every decode step
    calls.clear()
    monkeypatch.setattr(sg, "KN_ROWS", 0)
    monkeypatch.setattr(sg, "NK_ROWS", 0)
    assert generate(model, prompts, SamplingParams(max_new_tokens=12)) == with_it and not calls
    ids = paddle.to_tensor(prompts)
    with paddle.no_grad():
        full = model(ids).logits[:, -1].numpy()  # Paddle's GEMMs: 21 rows
        monkeypatch.setattr(sg, "KN_ROWS", 8)
        monkeypatch.setattr(sg, "NK_ROWS", 8)
        one = model(ids[:1]).logits[:, -1].numpy()  # 7 rows: the kernels
    np.testing.assert_allclose(one, full[:1], rtol=1e-4, atol=1e-5)


def _packable(k: int, n: int, seed: int):
    from erniekit.nn.linear import Linear

    paddle.seed(seed)
    holder = paddle.nn.Layer()
    holder.proj = Linear(k, n)
    return holder


@pytest.mark.parametrize(
    "rows,k",
    [(1, 256), (5, 256), (8, 256), (16, 256), (32, 256), (1, 400), (7, 400), (12, 400), (18, 400), (19, 400)]
    + [(37, 400), (64, 400), (8, 528), (20, 528), (25, 528)],
)
def test_packed_weights_give_the_same_bits_up_to_packed_rows(kernel, bits, rows, k, monkeypatch):
    """k 400 / 528: halves of 200 / 264, so the streamed chunks (kernels/small_gemm.c, STREAM_LINES
    128, or with AVX-512 32, and 16 for up to 24 rows at k >= 512) end inside a half; 1-18 rows
    stream chunk by chunk, 19-64 too with AVX-512 (11 tiles at 64 rows), tile by tile without."""
    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    holder = _packable(k, 192, seed=rows)
    w, b = holder.proj.weight, holder.proj.bias
    x = paddle.to_tensor(_arrays((rows, k), seed=rows)[0])
    with paddle.no_grad():
        assert sg.takes_kn(x, w, b) == (rows <= sg.KN_ROWS)
        assert sg.pack_weights(holder) == 4 * k * 192
        assert sg.takes_kn(x, w, b)  # packed: up to PACKED_ROWS
        y = holder.proj(x)
    np.testing.assert_array_equal(bits(y), bits(sg.numpy_kn(x.numpy(), w.numpy(), b.numpy())))
    sg.unpack_weights(holder)
    assert sg._packed_of(w) is None


@pytest.mark.parametrize("n", [64, 128, 192, 512, 576, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_packed_row_gives_kns_bits_at_any_panel_count_and_thread_count(kernel, bits, n, with_bias):
    """One row (a batch-1 decode step) reads its panels in pairs or one by one, by how many panels
    each thread gets (kernels/small_gemm.c, packed_one_row with AVX-512): 1-16 panels of 64, odd
    counts leaving a single panel after the pairs, 1-4 threads, a k whose halves are not a multiple
    of 16."""
    pack, packed = kernel[2], kernel[3]
    k = 400
    x, w, b = _arrays((1, k), (k, n), (n,), seed=n)
    X, W, B, P = (paddle.to_tensor(a) for a in (x, w, b, np.zeros(k * n, np.float32)))
    pack(W.data_ptr(), P.data_ptr(), k, n)
    want = bits(sg.numpy_kn(x, w, b if with_bias else None))
    for threads in (1, 2, 3, 4):
        y = paddle.to_tensor(np.full((1, n), np.nan, np.float32))
        packed(X.data_ptr(), P.data_ptr(), B.data_ptr() if with_bias else None, y.data_ptr(), 1, k, n, threads)
        np.testing.assert_array_equal(bits(y), want, err_msg=f"{threads} threads")


def test_a_weight_changed_in_place_drops_its_packed_copy(kernel, monkeypatch):
    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    holder = _packable(64, 64, seed=1)
    w = holder.proj.weight
    sg.pack_weights(holder)
    assert sg._packed_of(w) is not None
    with paddle.no_grad():
        w.scale_(2.0)  # what an optimizer's in-place update does to the version
        x = paddle.randn([12, 64])
        assert sg._packed_of(w) is None and not sg.takes_kn(x, w, None)  # 12 rows: MKL again
        np.testing.assert_allclose(holder.proj(x).numpy(), (x @ w + holder.proj.bias).numpy(), rtol=1e-5, atol=1e-5)


def test_the_engine_packs_on_request_and_decodes_the_same(kernel, monkeypatch):
    """One request at a time through the engine against `generate` on the same packed weights: the
    same kernels on the same rows, so the same tokens."""
    from erniekit.infer.engine import Engine, complete
    from erniekit.infer.generate import generate
    from erniekit.infer.sampling import SamplingParams
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    model = _tiny_lm(1024, 2, seed=0)
    prompts = np.random.default_rng(2).integers(3, 1024, (3, 6)).tolist()
    params = SamplingParams(max_new_tokens=6)
    up, head = model.model.layers[0].mlp.up_proj.weight, model.model.embed_tokens.weight
    engine = Engine(model, default_tokenizer(), max_batch=4, pack_weights=True)
    try:
        assert engine.packed_bytes == 4 * (2 * 3 * 64 * 128 + 2 * 2 * 64 * 64 + 1024 * 64)  # MLPs, q/o, head
        assert sg._packed_of(up) is not None and sg._packed_of(head) is not None
        want = [generate(model, [p], params)[0] for p in prompts]  # the packed kernels, one row at a time
        got = [complete(engine, p, params)[1] for p in prompts]
    finally:
        engine.close()
    assert sg._packed_of(up) is None and sg._packed_of(head) is None  # close() drops the copies
    assert got == want


def test_a_packed_tied_head_sums_as_kn_does(kernel, bits):

    model = _tiny_lm(640, 1, seed=1)
    e = model.model.embed_tokens.weight
    h = paddle.to_tensor(_arrays((1, 20, 64), seed=4)[0])
    with paddle.no_grad():
        sg.pack_weights(model)
        try:
            assert sg.takes_nk(h, e)  # 20 rows: beyond NK_ROWS, within PACKED_ROWS
            got = model.head(h)
        finally:
            sg.unpack_weights(model)
        unpacked = model.head(h)
    np.testing.assert_array_equal(bits(got), bits(sg.numpy_kn(h.numpy(), e.numpy().T).reshape(1, 20, 640)))
    np.testing.assert_allclose(got.numpy(), unpacked.numpy(), rtol=1e-5, atol=1e-5)


def test_the_server_flag_is_auto_unless_told():
    from erniekit.cli import _server_parser

    parse = _server_parser().parse_args
    assert parse(["ckpt"]).packed_weights == "auto"
    assert parse(["ckpt", "--packed-weights"]).packed_weights == "on"  # the flag alone, as before
    assert parse(["ckpt", "--packed-weights", "off"]).packed_weights == "off"


def test_auto_packs_when_the_copy_is_small_against_the_memory_available(kernel, monkeypatch):
    from erniekit.errors import ErniekitError
    from erniekit.infer.weight_packing import available_memory, packing_choice

    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    model = _tiny_lm(1024, 2, seed=0)
    need = sg.packable_bytes(model)
    assert need == 4 * (2 * 3 * 64 * 128 + 2 * 2 * 64 * 64 + 1024 * 64)  # what the engine test packs
    avx2 = {"avx2", "fma"}
    pack, why = packing_choice(model, "auto", available=4 * need, cpu_flags=avx2)  # exactly a quarter
    assert pack and why.startswith("packed weights on (+0.5 MiB") and "--packed-weights off saves it" in why
    pack, why = packing_choice(model, "auto", available=4 * need - 1, cpu_flags=avx2)
    assert not pack and "over a quarter" in why and "--packed-weights on" in why
    assert packing_choice(model, "auto", available=1 << 40, cpu_flags={"avx512f", "avx512bw", "avx512dq", "avx512vl"})[
        0
    ]
    # no AVX2 (an SSE-only x86, an ARM machine, no /proc/cpuinfo): the tiles' registers are not there
    pack, why = packing_choice(model, "auto", available=1 << 40, cpu_flags={"sse4_2", "avx"})
    assert not pack and why == (
        "packed weights off: measured only on x86 CPUs with AVX2 or AVX-512, which this one is not "
        "(+0.5 MiB with --packed-weights on)"
    )
    assert packing_choice(model, "on", available=1 << 40, cpu_flags=set())[0] is True
    assert packing_choice(model, "on", available=1)[0] is True
    assert packing_choice(model, "off")[0] is False
    assert sg.packable_bytes(model) == need  # deciding packs nothing
    with pytest.raises(ErniekitError, match="--packed-weights maybe: choose one of auto, on, off"):
        packing_choice(model, "maybe")
    avail = available_memory()
    assert avail is None or avail > 0
    monkeypatch.setattr(sg, "_kernels", lambda: None)  # a build without the kernels: nothing to pack
    assert packing_choice(model, "on") == (
        False,
        "packed weights: none to pack, no float32 CPU projection of 256 KiB or more",
    )


def test_chat_packs_its_model_as_the_server_does(kernel, monkeypatch):
    from erniekit.cli import _chat_parser
    from erniekit.infer.chat import pack_for_chat

    assert _chat_parser().parse_args(["ckpt"]).packed_weights == "auto"
    monkeypatch.setattr(sg, "KN_MIN_BYTES", 0)
    model = _tiny_lm(1024, 1, seed=0)
    up = model.model.layers[0].mlp.up_proj.weight
    assert pack_for_chat(model, "off") == "packed weights off (--packed-weights off)"
    assert sg._packed_of(up) is None
    try:
        assert pack_for_chat(model, "on").startswith("packed weights on (+")
        assert sg._packed_of(up) is not None
    finally:
        sg.unpack_weights(model)


def test_kn_groups_gives_kns_bits_per_group_and_skips_an_empty_one(kernel, bits):
    """The grouped entry (a MoE block's expert groups): each group's rows are numpy_kn's bits; a
    group of 0 rows writes nothing (its chunk width would divide by zero)."""
    k, n = 96, 160
    rows = [2, 0, 3]
    xs = _arrays(*[(max(r, 1), k) for r in rows], seed=7)
    ws = _arrays(*[(k, n)] * 3, seed=8)
    X = [paddle.to_tensor(a) for a in xs]
    W = [paddle.to_tensor(a) for a in ws]
    Y = [paddle.to_tensor(np.full((max(r, 1), n), np.nan, np.float32)) for r in rows]
    sg.kn_groups([(x.data_ptr(), w.data_ptr(), y.data_ptr(), r) for x, w, y, r in zip(X, W, Y, rows)], k, n)
    for x, w, y, r in zip(xs, ws, Y, rows):
        if r:
            np.testing.assert_array_equal(bits(y), bits(sg.numpy_kn(x, w)))
        else:
            assert np.isnan(y.numpy()).all()
