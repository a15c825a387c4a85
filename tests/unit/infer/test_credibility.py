"""The credibility head and its numbers (docs/control.md): the head's logits and the training loss
against naive references, the rank-based AUC against a pairwise count, the head saved with a
checkpoint, the report and re-ranking on a tiny random model."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from erniekit.data.formats import Conversation
from erniekit.errors import CheckpointError
from erniekit.infer.credibility import credibility_report, prompt_sequence, reply_sequence, rerank, roc_auc
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, CredibilityHead, load_credibility_head, sequence_logits
from erniekit.train.credibility import bce_with_logits_mean


def _naive_auc(pos, neg) -> float:
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_auc_equals_the_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        pos = rng.integers(0, 6, size=rng.integers(1, 30)).astype(float)  # few values: many ties
        neg = rng.integers(0, 6, size=rng.integers(1, 30)).astype(float)
        assert roc_auc(pos, neg) == pytest.approx(_naive_auc(pos, neg), abs=1e-12)
    pos, neg = rng.normal(1, 1, 200), rng.normal(0, 1, 300)
    assert roc_auc(pos, neg) == pytest.approx(_naive_auc(pos, neg), abs=1e-12)
    assert roc_auc([3, 4], [1, 2]) == 1.0 and roc_auc([1, 2], [3, 4]) == 0.0 and roc_auc([1], [1]) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        roc_auc([1.0], [])


def test_bce_matches_the_textbook_formula():
    z = np.array([-30.0, -2.0, 0.0, 0.7, 25.0], np.float32)
    y = np.array([1, 0, 1, 1, 0], np.float32)
    sig = 1 / (1 + np.exp(-z.astype(np.float64)))
    ref = -np.mean(y * np.log(np.clip(sig, 1e-300, 1)) + (1 - y) * np.log(np.clip(1 - sig, 1e-300, 1)))
    got = float(bce_with_logits_mean(paddle.to_tensor(z), paddle.to_tensor(y)))
    assert got == pytest.approx(ref, rel=1e-5)


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)
    m = Ernie4_5ForCausalLM(get_preset("tiny-moe").replace(initializer_range=0.2))
    m.eval()
    return m


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _head(hidden: int, seed: int = 1) -> CredibilityHead:
    head = CredibilityHead(hidden)
    rng = np.random.default_rng(seed)
    head.set_state_dict(
        {"weight": paddle.to_tensor(rng.normal(0, 1, (hidden, 1)).astype("float32")), "bias": paddle.to_tensor([0.3])}
    )
    return head


def test_sequence_logits_read_each_sequences_last_token(model):
    head = _head(model.config.hidden_size)
    seqs = [[3, 17, 40, 4], [3, 9, 4], [3, 17, 40, 99, 120, 4]]
    got = sequence_logits(model, head, seqs, pad_id=0).numpy()
    w, b = head.weight.numpy()[:, 0].astype(np.float64), float(head.bias.numpy()[0])
    for i, s in enumerate(seqs):  # each sequence alone, no padding: its last hidden state . w + b
        h = model(paddle.to_tensor([s])).hidden_states[0, -1].numpy().astype(np.float64)
        assert got[i] == pytest.approx(h @ w + b, rel=1e-4, abs=1e-4)


def test_a_zero_head_scores_one_half(model):
    head = CredibilityHead(model.config.hidden_size)
    assert np.all(sequence_logits(model, head, [[3, 5, 4]], 0).numpy() == 0.0)


def test_the_head_file_round_trips_and_a_wrong_shape_is_one_line(model, tmp_path):
    from safetensors.paddle import save_file

    hidden = model.config.hidden_size
    head = _head(hidden)
    assert load_credibility_head(str(tmp_path), hidden) is None
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / CREDIBILITY_HEAD_NAME))
    back = load_credibility_head(str(tmp_path), hidden)
    np.testing.assert_array_equal(back.weight.numpy(), head.weight.numpy())
    with pytest.raises(CheckpointError, match=r"expected tensors weight \[32, 1\]"):
        load_credibility_head(str(tmp_path), 32)
    # a bias of another shape was skipped by set_state_dict with a warning: a head scoring without it
    bad = {"weight": head.weight.detach().contiguous(), "bias": paddle.to_tensor([0.5, 0.5, 0.5])}
    save_file(bad, str(tmp_path / CREDIBILITY_HEAD_NAME))
    with pytest.raises(CheckpointError, match=r"got weight \[\d+, 1\] and bias \[3\]") as e:
        load_credibility_head(str(tmp_path), hidden)
    assert "\n" not in str(e.value)


def test_reply_sequences_are_the_sft_encoding_with_the_reply_swapped(tok):
    conv = Conversation(None, [("12+3=", "15")], [True], control={"style": "digits"})
    prompt = prompt_sequence(conv, tok)
    real, other = reply_sequence(conv, "15", tok), reply_sequence(conv, "fifteen", tok)
    assert real[: len(prompt)] == prompt == other[: len(prompt)]
    assert tok.decode(real[len(prompt) :]).startswith("15") and real[-1] == tok.sep_token_id
    assert tok.decode(other[len(prompt) :]).startswith("fifteen") and other[-1] == tok.sep_token_id
    assert "<control>style=digits</control>" in tok.decode(prompt)


def test_report_counts_identical_samples_and_its_auc_is_the_scores(model, tok):
    convs = [Conversation(None, [(f"{a}+{a}=", str(2 * a))], [True]) for a in range(12)]
    head = _head(model.config.hidden_size)
    rep = credibility_report(model, head, tok, convs, batch_size=5, max_new_tokens=6, seed=3)
    assert rep["examples"] == 12 and rep["real"]["n"] == 12
    assert rep["generated"]["n"] == 12 - rep["identical"] > 0
    assert 0.0 <= rep["auc"] <= 1.0
    again = credibility_report(model, head, tok, convs, batch_size=5, max_new_tokens=6, seed=3)  # seeded: repeatable
    assert again["auc"] == pytest.approx(rep["auc"]) and again["generated"] == pytest.approx(rep["generated"])


def test_rerank_picks_the_highest_scoring_candidate(model, tok):
    head = _head(model.config.hidden_size)
    msgs = [{"role": "system", "content": "<control>style=words</control>"}, {"role": "user", "content": "2+2="}]
    cands = ["four", "4", "five", "22"]
    best, probs = rerank(model, head, tok, msgs, cands)
    conv = Conversation("<control>style=words</control>", [("2+2=", "")], [True])
    logits = sequence_logits(model, head, [reply_sequence(conv, c, tok) for c in cands], 0).numpy()
    assert best == int(np.argmax(logits)) and probs == pytest.approx(1 / (1 + np.exp(-logits)), rel=1e-5)


def test_rerank_passes_over_blank_candidates_unless_all_are_blank(model, tok):
    """A blank sample ('' or whitespace after the stop) the head scores highest is not the answer
    while a candidate with text exists (`chat --rerank` printed an empty reply)."""
    msgs = [{"role": "user", "content": "17+25="}]
    cands = ["", "42", "  ", "forty-two", "4"]
    conv = Conversation(None, [("17+25=", "")], [True])
    seqs = [reply_sequence(conv, c, tok) for c in cands]
    for seed in range(40):  # a head that prefers a blank: the case to handle
        head = _head(model.config.hidden_size, seed)
        logits = sequence_logits(model, head, seqs, 0).numpy()
        if int(np.argmax(logits)) in (0, 2):
            break
    else:
        pytest.fail("no head among 40 seeds scored a blank candidate highest")
    best, probs = rerank(model, head, tok, msgs, cands)
    assert best == max((1, 3, 4), key=lambda i: logits[i])
    assert probs == pytest.approx(1 / (1 + np.exp(-logits)), rel=1e-5)  # every candidate is still scored
    blanks = ["", " ", "\n"]  # all blank: the highest scored, and the caller says so (ChatSession._reranked)
    best, _ = rerank(model, head, tok, msgs, blanks)
    assert best == int(np.argmax(sequence_logits(model, head, [reply_sequence(conv, c, tok) for c in blanks], 0)))
