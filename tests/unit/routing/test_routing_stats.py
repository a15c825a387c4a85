"""MoE routing statistics (against hand and loop computations), routing pictures, the training
monitor on a tiny MoE model, and `erniekit eval --routing`."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from erniekit.routing.stats import (
    RoutingAccumulator,
    expert_counts,
    expert_load,
    load_cv,
    load_imbalance,
    modality_usage,
    routing_entropy,
    token_entropy,
)

# 4 tokens, top-2 of 4 experts: expert 0 gets 4 of 8 assignments, expert 1 two, experts 2 and 3 one each
TOPK = np.array([[0, 1], [0, 2], [0, 1], [3, 0]], np.int64)


def _loop_load(topk, E, valid=None):
    counts = [0] * E
    for t, row in enumerate(topk):
        if valid is None or valid[t]:
            for e in row:
                counts[e] += 1
    return np.array(counts, float) / sum(counts)


def _loop_entropy(probs, valid=None):
    hs = [-sum(p * math.log(p) for p in row if p > 0) for t, row in enumerate(probs) if valid is None or valid[t]]
    return sum(hs) / len(hs)


def _probs(T, E, seed=0, sharp=3.0):
    z = np.random.default_rng(seed).normal(size=(T, E)) * sharp
    p = np.exp(z - z.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)).astype(np.float32)


# ---- statistics ---------------------------------------------------------------------------------
def test_expert_load_imbalance_and_cv_by_hand():
    load = expert_load(TOPK, 4)
    np.testing.assert_allclose(load, [0.5, 0.25, 0.125, 0.125])
    np.testing.assert_allclose(load, _loop_load(TOPK, 4))
    assert load_imbalance(load) == pytest.approx(2.0)  # 0.5 / mean 0.25
    # population std of [.5, .25, .125, .125] is sqrt(0.0234375); mean .25
    assert load_cv(load) == pytest.approx(math.sqrt(0.0234375) / 0.25)
    assert load_imbalance(np.full(8, 1 / 8)) == pytest.approx(1.0) and load_cv(np.full(8, 1 / 8)) == pytest.approx(0.0)
    one_hot = np.eye(8)[3]
    assert load_imbalance(one_hot) == pytest.approx(8.0) and load_cv(one_hot) == pytest.approx(math.sqrt(7))
    assert math.isnan(load_imbalance(np.zeros(4))) and math.isnan(load_cv(np.zeros(4)))


def test_valid_mask_excludes_padding_in_any_shape():
    valid = np.array([True, True, False, True])
    np.testing.assert_allclose(expert_load(TOPK, 4, valid), [0.5, 1 / 6, 1 / 6, 1 / 6])
    np.testing.assert_allclose(expert_load(TOPK, 4, valid.reshape(2, 2)), _loop_load(TOPK, 4, valid))
    assert expert_counts(TOPK, 6, valid).tolist() == [3, 1, 1, 1, 0, 0]
    np.testing.assert_array_equal(expert_load(TOPK, 4, np.zeros(4, bool)), np.zeros(4))
    with pytest.raises(ValueError, match="3 entries"):
        expert_load(TOPK, 4, np.ones(3, bool))


def test_routing_entropy_against_loop():
    probs = np.concatenate([_probs(5, 4), np.full((1, 4), 0.25, np.float32), np.eye(4, dtype=np.float32)[:1]])
    valid = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    assert routing_entropy(probs) == pytest.approx(_loop_entropy(probs), rel=1e-6)
    assert routing_entropy(probs, valid) == pytest.approx(_loop_entropy(probs, valid), rel=1e-6)
    assert routing_entropy(probs, valid, normalized=True) == pytest.approx(
        _loop_entropy(probs, valid) / math.log(4), rel=1e-6
    )
    h = token_entropy(probs)
    assert h[5] == pytest.approx(math.log(4)) and h[6] == 0.0  # uniform row, one-hot row
    assert math.isnan(routing_entropy(probs, np.zeros(7, bool)))


def test_modality_usage_two_modalities_and_isolated_experts():
    rng = np.random.default_rng(1)
    topk = rng.integers(0, 6, size=(40, 2))
    modality = rng.integers(0, 2, size=40)
    valid = rng.random(40) > 0.2
    usage = modality_usage(topk, modality, 6, 2, valid)
    for m in range(2):
        np.testing.assert_allclose(usage[m], _loop_load(topk, 6, valid & (modality == m)))
    # modality-isolated routing with global expert ids: text uses experts 0-3, image 4-7
    topk_iso = np.array([[0, 1], [2, 3], [4, 5], [6, 4], [1, 0]])
    mod_iso = np.array([0, 0, 1, 1, 0])
    usage = modality_usage(topk_iso, mod_iso, 8, 2)
    np.testing.assert_allclose(usage[0], [2 / 6, 2 / 6, 1 / 6, 1 / 6, 0, 0, 0, 0])
    np.testing.assert_allclose(usage[1], [0, 0, 0, 0, 2 / 4, 1 / 4, 1 / 4, 0])
    np.testing.assert_allclose(modality_usage(TOPK, None, 4, 1), [expert_load(TOPK, 4)])  # None = modality 0
    np.testing.assert_array_equal(modality_usage(TOPK, np.zeros(4), 4, 3)[1:], 0)  # unseen modality: zero row
    with pytest.raises(ValueError, match="modality ids"):
        modality_usage(TOPK, np.array([0, 1, 2, 0]), 4, 2)


def _batch(seed, T, E=6, k=2, with_modality=True):
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    return topk, _probs(T, E, seed), (rng.integers(0, 2, size=T) if with_modality else None), rng.random(T) > 0.25


def test_accumulator_two_batches_equals_one_concatenated_batch():
    (t1, p1, m1, v1), (t2, p2, m2, v2) = _batch(2, 30), _batch(3, 50)
    split, whole = RoutingAccumulator(), RoutingAccumulator()
    for layer, shift in ((1, 0), (3, 1)):  # two layers, routing differs per layer
        split.add(layer, (t1 + shift) % 6, p1, m1, v1)
        split.add(layer, (t2 + shift) % 6, p2, m2, v2)
        whole.add(
            layer,
            (np.concatenate([t1, t2]) + shift) % 6,
            np.concatenate([p1, p2]),
            np.concatenate([m1, m2]),
            np.concatenate([v1, v2]),
        )
    assert split.layer_ids == whole.layer_ids == [1, 3]
    np.testing.assert_allclose(split.load_matrix(), whole.load_matrix())
    np.testing.assert_allclose(split.entropy(), whole.entropy())
    np.testing.assert_allclose(split.modality_matrix(), whole.modality_matrix())
    np.testing.assert_allclose(split.modality_matrix(layer=3), whole.modality_matrix(layer=3))
    s, w = split.scalars(), whole.scalars()
    assert s.keys() == w.keys()
    for k in s:
        assert s[k] == pytest.approx(w[k]), k
    # and the whole equals the per-batch functions on the concatenation
    t, p, m, v = (np.concatenate(x) for x in ((t1, t2), (p1, p2), (m1, m2), (v1, v2)))
    np.testing.assert_allclose(whole.load_matrix()[0], expert_load(t, 6, v))
    assert whole.entropy()[0] == pytest.approx(routing_entropy(p, v))
    np.testing.assert_allclose(whole.modality_matrix(layer=1), modality_usage(t, m, 6, 2, v))
    assert w["routing/layer01/load_imbalance"] == pytest.approx(load_imbalance(expert_load(t, 6, v)))
    assert w["routing/layer03/entropy_norm"] == pytest.approx(routing_entropy(p, v, normalized=True))
    assert w["routing/modality1/entropy"] == pytest.approx(routing_entropy(p, v & (m == 1)))
    assert w["routing/load_imbalance_max"] == max(
        w["routing/layer01/load_imbalance"], w["routing/layer03/load_imbalance"]
    )


def test_accumulator_memory_is_counts_only_and_reset():
    acc = RoutingAccumulator()
    for seed in range(5):
        t, p, _, v = _batch(seed, 200, with_modality=False)
        acc.add(1, t, p, None, v)
    arrays = [a for a in vars(acc).values() if isinstance(a, np.ndarray)]
    assert sum(a.size for a in arrays) < 50  # [L, M, E] counts and [L, M] sums, no per-token data
    assert acc.num_modalities == 1 and not any("modality" in k for k in acc.scalars())
    acc.reset()
    assert acc.empty and acc.scalars() == {} and acc.layer_ids == []


def test_accumulator_per_modality_imbalance_over_own_experts():
    topk = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    mod = np.array([0, 0, 1, 1])
    acc = RoutingAccumulator(modality_experts=[range(0, 4), range(4, 8)])
    acc.add(1, topk, None, mod)
    s = acc.scalars()
    assert s["routing/modality0/load_imbalance"] == pytest.approx(1.0)  # balanced over its own 4 experts
    plain = RoutingAccumulator()
    plain.add(1, topk, None, mod)
    assert plain.scalars()["routing/modality0/load_imbalance"] == pytest.approx(2.0)  # over all 8
    assert "routing/entropy" not in s  # no probabilities given


# ---- pictures -----------------------------------------------------------------------------------
def test_heatmap_png_is_valid_and_readable(tmp_path):
    import matplotlib.image as mpimg

    from erniekit.routing.plots import log_images_to_visualdl, png_to_uint8, save_load_heatmap, save_modality_usage

    load = np.random.default_rng(0).dirichlet(np.ones(8), size=3)
    path = save_load_heatmap(load, str(tmp_path / "sub" / "load.png"), "test load", [1, 2, 3])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 250 and img.shape[1] >= 500 and img.shape[2] in (3, 4)
    assert img[..., :3].std() > 0.05  # not a blank canvas
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["load.png"]  # no temporary left behind
    u8 = png_to_uint8(path)
    assert u8.dtype == np.uint8 and u8.shape == img.shape[:2] + (3,)
    mod_path = save_modality_usage(load[:2], str(tmp_path / "mod.png"), "test usage", ["text", "image"])
    assert mpimg.imread(mod_path).shape[1] >= 500

    calls = []

    class Writer:
        def add_image(self, **kw):
            calls.append(kw)

    log_images_to_visualdl(Writer(), "routing/expert_load", path, 7)
    assert calls[0]["tag"] == "routing/expert_load" and calls[0]["step"] == 7
    assert calls[0]["img"].dtype == np.uint8 and calls[0]["img"].shape[2] == 3
    with pytest.raises(ValueError, match="layer ids"):
        save_load_heatmap(load, str(tmp_path / "x.png"), "t", [1, 2])


# ---- training monitor ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_moe():
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset

    paddle.seed(0)
    return Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(num_hidden_layers=3))


def _forward(model, seed, B=3, S=12):
    import paddle

    rng = np.random.default_rng(seed)
    lens = rng.integers(4, S + 1, size=B)
    valid = np.arange(S)[None, :] < lens[:, None]
    model(paddle.to_tensor(rng.integers(3, 1000, size=(B, S)).astype(np.int64)))
    return valid


def test_monitor_scalars_pictures_and_visualdl(tiny_moe, tmp_path):
    import paddle
    from visualdl import LogWriter

    from erniekit.routing.monitor import RoutingMonitor

    mon = RoutingMonitor(tiny_moe, str(tmp_path), every_steps=2)
    assert [layer for layer, _ in mon.blocks] == [1, 2]
    expected = RoutingAccumulator()
    for seed in range(2):
        valid = _forward(tiny_moe, seed)
        mon.after_forward(paddle.to_tensor(valid))  # a paddle mask works like a numpy one
        for layer, block in mon.blocks:
            expected.add(layer, block.last_topk_idx.numpy(), block.last_probs.numpy(), None, valid)
    s = mon.scalars()
    assert s and all(math.isfinite(v) for v in s.values())
    for key in (
        "routing/entropy",
        "routing/entropy_norm",
        "routing/load_imbalance",
        "routing/load_cv",
        "routing/layer01/entropy",
        "routing/layer02/load_imbalance",
    ):
        assert key in s
    assert 0 < s["routing/entropy_norm"] <= 1 and 1 <= s["routing/load_imbalance"] <= 8
    for k, v in expected.scalars().items():
        assert s[k] == pytest.approx(v), k
    assert mon.scalars() == {}  # the logging window restarted

    logdir = tmp_path / "vdl"
    writer = LogWriter(logdir=str(logdir))
    assert mon.maybe_write_pictures(1, writer) == []  # not due
    paths = mon.maybe_write_pictures(2, writer)
    assert [os.path.basename(p) for p in paths] == ["step-000002-load.png"]
    assert os.path.isfile(paths[0]) and os.path.dirname(paths[0]) == str(tmp_path / "routing")
    assert mon.maybe_write_pictures(3, writer, final=True) == []  # nothing routed since step 2

    # a second modality (as modality-isolated routing will report it) adds the usage picture
    valid = _forward(tiny_moe, 5)
    for _, block in mon.blocks:
        block.last_modality = paddle.to_tensor(np.arange(valid.size) % 2)
    mon.after_forward(valid)
    s = mon.scalars()
    assert "routing/modality1/entropy" in s and "routing/modality0/load_imbalance" in s
    paths = mon.maybe_write_pictures(3, writer, final=True)
    assert [os.path.basename(p) for p in paths] == [
        "step-000003-load.png",
        "step-000003-modality.png",
        "step-000003-load-modality0.png",  # each modality's own load, layer by layer
        "step-000003-load-modality1.png",
    ]
    writer.close()
    for _, block in mon.blocks:
        block.last_modality = None
    assert any(f.startswith("vdlrecords") for f in os.listdir(logdir))
    from visualdl import LogReader

    reader = LogReader(file_path=str(logdir / next(f for f in os.listdir(logdir) if f.startswith("vdlrecords"))))
    assert {"routing/expert_load", "routing/modality_usage", "routing/expert_load_modality1"} <= set(
        reader.get_tags()["image"]
    )


def test_modality_load_is_each_modalitys_share_over_its_own_experts():
    acc = RoutingAccumulator([[0, 1, 2], [3, 4]])
    acc.add(1, np.array([[0, 1], [2, 0], [3, 4], [4, 4]]), modality=np.array([0, 0, 1, 1]))
    acc.add(2, np.array([[1, 1], [2, 2], [3, 3], [4, 3]]), modality=np.array([0, 0, 1, 1]))
    text, ids = acc.modality_load_matrix(0)
    assert ids == [0, 1, 2] and np.allclose(text, [[0.5, 0.25, 0.25], [0, 0.5, 0.5]])
    vision, ids = acc.modality_load_matrix(1)
    assert ids == [3, 4] and np.allclose(vision, [[0.25, 0.75], [0.75, 0.25]])


def test_monitor_is_a_noop_for_dense_models(tmp_path):
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
    from erniekit.routing.monitor import RoutingMonitor

    model = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1))
    mon = RoutingMonitor(model, str(tmp_path), every_steps=1)
    model(paddle.to_tensor(np.full((1, 4), 5, np.int64)))
    mon.after_forward(np.ones((1, 4), bool))
    assert not mon.enabled and mon.scalars() == {}
    assert mon.maybe_write_pictures(1, final=True) == []
    assert not (tmp_path / "routing").exists()


# ---- erniekit eval --routing --------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    root = tmp_path_factory.mktemp("routing_ckpt")
    paddle.seed(0)
    save_pretrained(
        Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(num_hidden_layers=2)),
        str(root / "moe"),
        tokenizer=default_tokenizer(),
    )
    save_pretrained(
        Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=1)),
        str(root / "dense"),
        tokenizer=default_tokenizer(),
    )
    return root


def test_cli_eval_routing_writes_pictures_and_json(ckpts, tmp_path, capsys):
    from erniekit.cli import main

    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"src": [f"{i}+{i}="], "tgt": [str(2 * i)]}) + "\n" for i in range(7)))
    out = tmp_path / "report"
    assert (
        main(["eval", str(ckpts / "moe"), "--routing", "--data", str(sft), "--out", str(out), "--batch-size", "3"]) == 0
    )
    text = capsys.readouterr().out
    assert "layer  entropy" in text and str(out / "routing-load.png") in text and "routing_stats.json" in text
    assert {p.name for p in out.iterdir()} == {"routing-load.png", "routing_stats.json"}
    stats = json.loads((out / "routing_stats.json").read_text())
    assert stats["sequences"] == 7 and stats["num_experts"] == 8 and stats["moe_k"] == 2
    assert [row["layer"] for row in stats["layers"]] == [1]
    row = stats["layers"][0]
    assert sum(row["load"]) == pytest.approx(1.0) and row["assignments"] == 2 * stats["tokens"]  # padding excluded
    assert math.isfinite(stats["summary"]["entropy"]) and stats["summary"]["load_imbalance"] >= 1

    text_data = tmp_path / "pt.jsonl"
    text_data.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}. " * 3}) + "\n" for i in range(5)))
    assert (
        main(
            [
                "eval",
                str(ckpts / "moe"),
                "--routing",
                "--data",
                str(text_data),
                "--out",
                str(out),
                "--max-seq-len",
                "16",
            ]
        )
        == 0
    )
    stats = json.loads((out / "routing_stats.json").read_text())
    assert stats["sequences"] > 5  # long documents were cut into 16-token pieces


def test_cli_eval_routing_default_data_and_errors(ckpts, tmp_path, capsys):
    from erniekit.cli import main

    assert main(["eval", str(ckpts / "moe"), "--routing", "--out", str(tmp_path / "r"), "--batch-size", "64"]) == 0
    assert json.loads((tmp_path / "r" / "routing_stats.json").read_text())["data"].endswith("eval.jsonl")
    capsys.readouterr()
    assert main(["eval", str(ckpts / "dense"), "--routing", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {ckpts / 'dense'} has no MoE layers: routing report needs an MoE model"
    assert main(["eval", str(ckpts / "moe")]) == 2  # no report kind chosen
    assert "--routing" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "missing"), "--routing"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    assert main(["help", "eval"]) == 0 and "--max-seq-len" in capsys.readouterr().out
    # --out and the lm-eval asks are checked before any forward pass (were tracebacks after it)
    (tmp_path / "afile").write_text("x")
    for args, said in (
        (["--routing", "--out", str(tmp_path / "afile")], "is a file, not a directory; choose another --out"),
        (["--elastic", "--out", str(tmp_path / "afile" / "x")], "is a file, not a directory"),
        (["--lm-eval", ","], "eval --lm-eval: no task named"),
        (["--lm-eval", "erniekit_arith", "--limit", "0"], "--limit 0 must be >= 1"),
    ):
        assert main(["eval", str(ckpts / "moe"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def _count_batches(monkeypatch) -> list[int]:
    """Sizes of the batches the report pads (one per forward pass)."""
    from erniekit.data import encode

    sizes, pad_batch = [], encode.pad_batch
    monkeypatch.setattr(encode, "pad_batch", lambda seqs, **kw: sizes.append(len(seqs)) or pad_batch(seqs, **kw))
    return sizes


def test_cli_eval_routing_max_samples_bounds_the_examples_read_and_routed(ckpts, tmp_path, capsys, monkeypatch):
    from erniekit.cli import main

    sft = tmp_path / "sft.jsonl"
    rows = [json.dumps({"src": [f"{i}+{i}="], "tgt": [str(2 * i)]}) for i in range(7)]
    sft.write_text("\n".join(rows[:5] + ["{not json"] + rows[5:]) + "\n")  # line 6 is never read with N = 5
    sizes = _count_batches(monkeypatch)
    args = ["eval", str(ckpts / "moe"), "--routing", "--data", str(sft), "--out", str(tmp_path / "r")]
    assert main([*args, "--max-samples", "5", "--batch-size", "2"]) == 0
    assert sizes == [2, 2, 1]
    assert "(5 sequences from 5 examples; --max-samples 5 reached)" in capsys.readouterr().out
    stats = json.loads((tmp_path / "r" / "routing_stats.json").read_text())
    assert (stats["examples"], stats["sequences"], stats["max_samples"]) == (5, 5, 5)
    assert stats["layers"][0]["assignments"] == 2 * stats["tokens"]
    assert main([*args, "--max-samples", "6"]) == 2
    assert f"{sft}:6: invalid JSON" in capsys.readouterr().err
    assert main([*args, "--max-samples", "0"]) == 2
    assert "--max-samples 0 must all be >= 1" in capsys.readouterr().err
    assert main(["help", "eval"]) == 0
    assert "--routing, --elastic, --credibility: the first N" in " ".join(capsys.readouterr().out.split())


def test_routing_reads_sequences_a_window_at_a_time(ckpts, monkeypatch):
    from erniekit.data import encode
    from erniekit.routing.report import WINDOW_BATCHES, accumulate_routing, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(ckpts / "moe"))
    pulled, pulled_at_forward, pad_batch = [0], [], encode.pad_batch
    monkeypatch.setattr(
        encode, "pad_batch", lambda seqs, **kw: pulled_at_forward.append(pulled[0]) or pad_batch(seqs, **kw)
    )

    def sequences():
        for i in range(100):
            pulled[0] += 1
            yield [5 + i % 7] * (3 + i % 5)

    acc = accumulate_routing(model, sequences(), batch_size=2, pad_id=0)
    assert pulled_at_forward[0] == 2 * WINDOW_BATCHES < 100  # the first forward ran before the rest was read
    assert pulled[0] == 100 and len(pulled_at_forward) == acc.batches == 50
    assert int(acc.counts.sum()) == 2 * sum(3 + i % 5 for i in range(100))  # top-2, padding excluded


def test_cli_eval_routing_refuses_data_whose_texts_are_all_empty(ckpts, tmp_path, capsys):
    from erniekit.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    assert main(["eval", str(ckpts / "moe"), "--routing", "--data", str(empty), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {empty}: all 2 documents are empty (only their end tokens would be routed); check the text field"
    ]
    assert not (tmp_path / "r" / "routing_stats.json").exists()
