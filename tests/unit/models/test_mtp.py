"""Multi-token prediction heads (erniekit/nn/mtp.py): the sequential formula, the MTP loss against a
loop reference, checkpoints, training, and greedy self-speculative decoding (== plain greedy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors import safe_open

from erniekit.errors import CheckpointError, ErniekitError
from erniekit.infer.generate import SamplingParams, generate
from erniekit.infer.speculative import SpeculativeStats, _Speculator, speculative_generate
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, from_pretrained, get_preset, save_pretrained
from erniekit.models.ernie4_5.modeling import KVCache
from erniekit.nn.attention import additive_mask, rope_cos_sin
from erniekit.train.losses import IGNORE_INDEX, causal_lm_loss_sum, token_balanced_loss_sum
from erniekit.train.mtp_loss import depth_labels, mtp_loss_sums
from erniekit.train.stage import lm_loss

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 900, 11, 12, 250, 33, 64, 100, 3, 77], [3]]


def _model(depth: int, preset: str = "tiny-dense", seed: int = 0, **kw) -> Ernie4_5ForCausalLM:
    # initializer_range 0.2: a random tiny model then continues each prompt differently
    paddle.seed(seed)
    kw = {"initializer_range": 0.2, **kw}
    m = Ernie4_5ForCausalLM(get_preset(preset).replace(num_nextn_predict_layers=depth, **kw))
    m.eval()
    return m


def _rms(x, w, eps):
    return w * x / paddle.sqrt((x * x).mean(-1, keepdim=True) + eps)


# ---- the heads --------------------------------------------------------------------------------
def test_mtp_logits_follow_the_sequential_formula():
    """h_j = Block_j(W_j [RMSNorm(Emb(t[i+j])); RMSNorm(h_{j-1})]), logits_j = Head(FinalNorm(h_j)),
    recomputed here by hand from the same weights (the block itself is a plain decoder layer)."""
    m = _model(2)
    c = m.config
    x = paddle.to_tensor(np.random.RandomState(0).randint(3, c.vocab_size, (2, 9)))
    out = m(x, return_mtp=True)
    assert len(out.mtp_logits) == 2 and all(lg.shape == [2, 9, c.vocab_size] for lg in out.mtp_logits)
    assert m(x).mtp_logits is None  # inference never computes them unless asked
    np.testing.assert_allclose(m(x).logits.numpy(), out.logits.numpy(), atol=1e-6)

    E = m.model.embed_tokens.weight
    pos = paddle.arange(9, dtype="int64").unsqueeze(0).expand([2, 9])
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta)
    mask = ("bias", additive_mask(None, 9, 9, E.dtype))
    h = m.model(x)
    ids = x.numpy()
    for j in range(2):
        shifted = np.zeros_like(ids)  # t[i+j+1]; past the end: pad id 0
        shifted[:, : 9 - (j + 1)] = ids[:, j + 1 :]
        e = paddle.gather(E, paddle.to_tensor(shifted.reshape(-1))).reshape([2, 9, -1])
        u = paddle.concat(
            [
                _rms(e, m.mtp.mtp_emb_norm[j].weight, c.rms_norm_eps),
                _rms(h, m.mtp.mtp_hidden_norm[j].weight, c.rms_norm_eps),
            ],
            axis=-1,
        )
        u = paddle.matmul(u, m.mtp.mtp_linear_proj[j].weight)  # Paddle Linear: [in, out]
        h = m.mtp.mtp_block[j](u, cos, sin, mask, None)
        want = paddle.matmul(_rms(h, m.model.norm.weight, c.rms_norm_eps), E, transpose_y=True)
        np.testing.assert_allclose(out.mtp_logits[j].numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def test_mtp_logits_are_causal():
    """Depth j at position i sees tokens up to t[i+j+1]: changing a later token leaves it unchanged."""
    m = _model(2)
    ids = np.random.RandomState(1).randint(3, 1000, (1, 10))
    a = m(paddle.to_tensor(ids), return_mtp=True).mtp_logits
    ids2 = ids.copy()
    ids2[0, 7] = (ids2[0, 7] + 1) % 1000
    b = m(paddle.to_tensor(ids2), return_mtp=True).mtp_logits
    for j in range(2):
        keep = 7 - (j + 1)  # positions i with i + j + 1 < 7
        np.testing.assert_allclose(a[j][:, :keep].numpy(), b[j][:, :keep].numpy(), atol=1e-5)
        assert not np.allclose(a[j][:, keep].numpy(), b[j][:, keep].numpy(), atol=1e-5)


def test_return_mtp_without_heads_is_a_one_line_error():
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        _model(0)(paddle.to_tensor([[1, 2, 3]]), return_mtp=True)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        get_preset("tiny-dense").replace(num_nextn_predict_layers=-1)
    for bad in (-0.5, float("inf"), True, "0.3", None, [0.3]):  # "0.3" was a TypeError naming no key
        with pytest.raises(CheckpointError, match="multi_token_pred_lambda=.* must be a finite number"):
            get_preset("tiny-dense").replace(multi_token_pred_lambda=bad)


# ---- the loss ---------------------------------------------------------------------------------
def _packed_batch(rs: np.random.RandomState, V: int) -> dict[str, np.ndarray]:
    ids = rs.randint(3, V, (2, 12))
    labels = ids.copy()
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, 8] = IGNORE_INDEX
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12])  # row 0: two documents then padding
    labels[0, 10:] = IGNORE_INDEX
    pos = np.concatenate([np.arange(5), np.arange(5), [0, 0]])[None].repeat(2, 0)
    return {"input_ids": ids, "labels": labels, "segment_ids": seg, "position_ids": pos}


def _loop_reference(logits: np.ndarray, b: dict[str, np.ndarray], depth: int, balanced: bool) -> float:
    """Depth `depth` (1-based): sum over positions i of -log p(labels[i+depth+1]), target trained and in
    i's document; balanced: each (row, document)'s terms divided by their count."""
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    terms: dict[tuple[int, int], list[float]] = {}
    B, S = b["labels"].shape
    for r in range(B):
        for i in range(S):
            t = i + depth + 1
            if t < S and b["labels"][r, t] != IGNORE_INDEX and b["segment_ids"][r, t] == b["segment_ids"][r, i]:
                terms.setdefault((r, b["segment_ids"][r, i]), []).append(-logp[r, i, b["labels"][r, t]])
    if balanced:
        return sum(sum(v) / len(v) for v in terms.values())
    return sum(sum(v) for v in terms.values())


@pytest.mark.parametrize("balanced", [False, True])
def test_mtp_loss_matches_a_loop_reference(balanced):
    rs = np.random.RandomState(2)
    b = _packed_batch(rs, 50)
    logits = [paddle.to_tensor(rs.randn(2, 12, 50).astype("float32")) for _ in range(3)]
    fn = token_balanced_loss_sum if balanced else causal_lm_loss_sum
    got = mtp_loss_sums(logits, b, fn)
    for j in range(3):
        np.testing.assert_allclose(float(got[j]), _loop_reference(logits[j].numpy(), b, j + 1, balanced), rtol=1e-5)
    assert (depth_labels(b["labels"], b["segment_ids"], 20) == IGNORE_INDEX).all()  # depth past the row


def test_lm_loss_adds_lambda_times_the_mean_depth_loss_and_logs_it():
    m = _model(2)
    m.config.multi_token_pred_lambda = 0.25
    b = _packed_batch(np.random.RandomState(3), m.config.vocab_size)
    m.eval()
    main = float(lm_loss(m, b).loss_sum)  # eval: no MTP term
    m.train()
    out = lm_loss(m, b)
    mtp = m(
        **{k: paddle.to_tensor(b[k]) for k in ("input_ids", "position_ids", "segment_ids")}, return_mtp=True
    ).mtp_logits
    depth = [_loop_reference(lg.numpy(), b, j + 1, False) for j, lg in enumerate(mtp)]
    np.testing.assert_allclose(out.metrics["mtp_loss"], np.mean(depth), rtol=1e-5)
    np.testing.assert_allclose(float(out.loss_sum), main + 0.25 * np.mean(depth), rtol=1e-5)


def _pattern_batch(n: int = 8, seq: int = 16) -> dict[str, np.ndarray]:
    """Rows of one cyclic pattern at random offsets: every next token is predictable."""
    pattern = np.array([11, 23, 35, 47, 59, 71, 83])
    starts = np.random.RandomState(0).randint(0, len(pattern), n)
    ids = np.stack([pattern[(s + np.arange(seq)) % len(pattern)] for s in starts]).astype(np.int64)
    return {
        "input_ids": ids,
        "labels": ids.copy(),
        "segment_ids": np.ones_like(ids),
        "position_ids": np.arange(seq)[None].repeat(n, 0),
    }


def _train(m: Ernie4_5ForCausalLM, steps: int, lr: float = 3e-3) -> list[float]:
    b = _pattern_batch()
    opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=m.parameters())
    m.train()
    n = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
    hist = []
    for _ in range(steps):
        out = lm_loss(m, b)
        (out.loss_sum / n).backward()
        opt.step()
        opt.clear_grad()
        hist.append(out.metrics["mtp_loss"] / n)
    m.eval()
    return hist


@pytest.fixture(scope="module")
def trained() -> Ernie4_5ForCausalLM:
    m = _model(2, initializer_range=0.02)
    _train(m, 30)
    return m


def test_training_with_mtp_lowers_the_mtp_loss():
    m = _model(1, initializer_range=0.02)
    hist = _train(m, 12)
    assert hist[-1] < 0.5 * hist[0], hist


# ---- checkpoints ------------------------------------------------------------------------------
def test_checkpoint_round_trip_uses_ernie_names(tmp_path):
    m = _model(2, preset="tiny-moe")
    save_pretrained(m, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["multi_token_pred_lambda"] == 0.3
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        H = m.config.hidden_size
        assert f.get_slice("model.mtp_linear_proj.1.weight").get_shape() == [H, 2 * H]  # HF [out, in]
        q = m.mtp.mtp_block[0].self_attn.q_proj.weight.numpy()
        np.testing.assert_array_equal(f.get_tensor("model.mtp_block.0.self_attn.q_proj.weight"), q.T)
    assert {
        "model.mtp_emb_norm.0.weight",
        "model.mtp_hidden_norm.1.weight",
        "model.mtp_block.1.mlp.down_proj.weight",
    } <= names
    back = from_pretrained(str(tmp_path))
    mine = dict(m.named_parameters())
    for n, p in back.named_parameters():
        np.testing.assert_array_equal(p.numpy(), mine[n].numpy(), err_msg=n)
    # the same checkpoint loads without the heads, and a model asking for heads the files lack fails clearly
    assert from_pretrained(str(tmp_path), config_overrides={"num_nextn_predict_layers": 0}).mtp is None
    save_pretrained(_model(0, preset="tiny-moe"), str(tmp_path / "plain"))
    with pytest.raises(
        CheckpointError, match=r"with model_overrides: num_nextn_predict_layers=1 but the weights hold 0 MTP"
    ):
        from_pretrained(str(tmp_path / "plain"), config_overrides={"num_nextn_predict_layers": 1})
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "plain" / "config.json").read_text())


# ---- speculative decoding ---------------------------------------------------------------------
@pytest.mark.parametrize("depth,preset", [(1, "tiny-moe"), (2, "tiny-dense"), (3, "tiny-dense")])
def test_speculative_equals_greedy_with_random_heads(depth, preset):
    m = _model(depth, preset)
    params = SamplingParams(max_new_tokens=12)
    for p in PROMPTS:
        stats = SpeculativeStats()
        assert speculative_generate(m, p, params, stats) == generate(m, [p], params)[0]
        assert stats.emitted == 12


def test_speculative_equals_greedy_with_trained_heads(trained):
    params = SamplingParams(max_new_tokens=20)
    stats = SpeculativeStats()
    for p in ([11, 23, 35], [59, 71], [47, 59, 71, 83, 11]):  # the trained pattern
        assert speculative_generate(trained, p, params, stats) == generate(trained, [p], params)[0]
    assert stats.acceptance > 1.5, stats  # the heads learned it: nearly both drafts accepted per round
    assert stats.verify_steps <= 3 * 8
    off = [5, 900, 3]  # a prompt never trained on: drafts may miss, the output must not change
    assert speculative_generate(trained, off, params) == generate(trained, [off], params)[0]


def test_speculative_stops_at_a_stop_token(trained):
    ref = generate(trained, [[11, 23, 35]], SamplingParams(max_new_tokens=12))[0]
    stop = ref[5]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=[stop])
    want = generate(trained, [[11, 23, 35]], params)[0]
    assert speculative_generate(trained, [11, 23, 35], params) == want == ref[: ref.index(stop)]


def test_verify_with_oracle_drafts_accepts_the_right_prefix(monkeypatch):
    """Drafts that are the true greedy continuation up to a planted error: exactly the correct prefix is
    accepted each round, the trunk cache is rolled back, and the output still equals greedy."""
    m = _model(3)
    prompt, params = PROMPTS[1], SamplingParams(max_new_tokens=15)
    ref = generate(m, [prompt], params)[0]
    full = prompt + ref
    plan = iter([3, 0, 2, 1, 3, 3, 2, 0, 1, 3, 3, 3, 3, 3])

    def oracle(self, tokens):
        good = next(plan)
        d = [full[len(tokens) + i] if len(tokens) + i < len(full) else 0 for i in range(3)]
        if good < 3:
            d[good] = (d[good] + 1) % m.config.vocab_size
        return d

    monkeypatch.setattr(_Speculator, "draft", oracle)
    stats = SpeculativeStats()
    assert speculative_generate(m, prompt, params, stats) == ref
    assert stats.accepted == 3 + 0 + 2 + 1 + 3  # + one trunk token per round: 1 + 4+1+3+2+4 = 15 tokens
    assert stats.verify_steps == 5


@pytest.mark.parametrize("which", ["random", "trained"])
def test_incremental_drafts_equal_a_full_mtp_forward(which, request, monkeypatch):
    """The MTP caches' catch-up and rollback are invisible: every round's drafts equal the argmax of a
    no-cache forward over the whole sequence (certain tokens + the drafts before), at its last position."""
    m = _model(3) if which == "random" else request.getfixturevalue("trained")
    rounds = []
    real = _Speculator.draft

    def recording(self, tokens):
        d = real(self, tokens)
        rounds.append((list(tokens), d))
        return d

    monkeypatch.setattr(_Speculator, "draft", recording)
    stats = SpeculativeStats()
    for p in ([5, 17, 300, 42, 9], [59, 71, 83]):
        speculative_generate(m, p, SamplingParams(max_new_tokens=14), stats)
    assert rounds
    with paddle.no_grad():
        for tokens, drafts in rounds:
            mtp = m(paddle.to_tensor([tokens + drafts[:-1]]), return_mtp=True).mtp_logits
            want = [int(paddle.argmax(lg[0, len(tokens) - 2])) for lg in mtp]
            assert drafts == want, (tokens, drafts, want)
    if which == "trained":
        assert 0 < stats.accepted < stats.drafted  # full and partial acceptance both exercised


def test_kv_cache_rollback_equals_a_fresh_forward():
    m = _model(0)
    prompt, junk, real = [5, 17, 300, 42], [9, 9, 9], [77, 3, 64]
    cache = KVCache(m.config, 1, 16)
    with paddle.no_grad():
        m(paddle.to_tensor([prompt]), cache=cache)
        m(paddle.to_tensor([junk]), cache=cache)
        cache.length = len(prompt)  # reject the junk
        got = m(paddle.to_tensor([real]), cache=cache).logits
        want = m(paddle.to_tensor([prompt + real])).logits[:, len(prompt) :]
    assert cache.length == len(prompt + real)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def test_speculative_errors():
    from erniekit.infer.speculative import speculative_stream

    with pytest.raises(ErniekitError, match="num_nextn_predict_layers"):
        next(speculative_stream(_model(0), [[1, 2]], SamplingParams(max_new_tokens=2)))
    with pytest.raises(ErniekitError, match="--temperature 0"):
        next(speculative_stream(_model(1), [[1, 2]], SamplingParams(max_new_tokens=2, temperature=0.7)))
    with pytest.raises(ErniekitError, match="one prompt"):
        next(speculative_stream(_model(1), [[1, 2], [3]], SamplingParams(max_new_tokens=2)))


# ---- chat ---------------------------------------------------------------------------------------
def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "erniekit", "chat", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chat_speculative_cli_prints_the_greedy_reply(tmp_path):
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    spec, plain = str(tmp_path / "mtp"), str(tmp_path / "plain")
    model, tok = _model(2, preset="tiny-moe"), default_tokenizer()
    save_pretrained(model, spec, tokenizer=tok)
    save_pretrained(_model(0), plain, tokenizer=tok)
    a = _cli([spec, "--prompt", "1+2=", "--max-new-tokens", "10", "--speculative"])
    assert a.returncode == 0, a.stderr
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True))
    stops = [tok.sep_token_id, tok.eos_token_id, *model.config.eos_token_ids]
    want = generate(model, [ids], SamplingParams(max_new_tokens=10, stop_token_ids=stops), pad_id=tok.pad_token_id)[0]
    assert want and a.stdout == tok.decode(want) + "\n"
    no_heads = _cli([plain, "--prompt", "1+2=", "--speculative"])
    assert no_heads.returncode == 2 and "num_nextn_predict_layers" in no_heads.stderr
    assert len(no_heads.stderr.strip().splitlines()) == 1
    hot = _cli([spec, "--prompt", "1+2=", "--speculative", "--temperature", "0.8"])
    assert hot.returncode == 2 and "--temperature 0" in hot.stderr and len(hot.stderr.strip().splitlines()) == 1
