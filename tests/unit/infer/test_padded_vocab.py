"""A checkpoint whose vocabulary is padded past its tokenizer (to a multiple that shards evenly,
or with rows kept for tokens added later): every decoder chooses among the ids the tokenizer can
write, so a reply never holds an id that decodes to nothing (the engine used to fail such a
request with an error, an RL rollout's reward could not decode it). The reference: the same
weights with the padding rows cut off.

The padded model's padding columns of the head are 20x the others, so without the cut every choice
would be a padding id: each test fails if the decoder it covers looks past the tokenizer."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from engine_requests import submit_and_wait

from erniekit.infer.engine import Engine, Request, complete
from erniekit.infer.generate import choice_width, generate, generate_stream
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.speculative import speculative_generate
from erniekit.infer.stops import decodable_vocab
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.rl.rollout import greedy_completions, rollout

PAD = 96  # padding rows past the tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _config(vocab: int):
    return get_preset("tiny-dense").replace(
        vocab_size=vocab,
        initializer_range=0.5,  # peaked logits: greedy choices not decided by rounding
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    )


@pytest.fixture(scope="module")
def models(tok):
    """(padded, cut): the padded model and the same weights without its padding rows."""
    V = len(tok)
    paddle.seed(0)
    padded = Ernie4_5ForCausalLM(_config(V + PAD))
    with paddle.no_grad():
        w = padded.lm_head.weight.numpy()  # [hidden, vocab]
        w[:, V:] *= 20.0
        padded.lm_head.weight.set_value(paddle.to_tensor(w))
    cut = Ernie4_5ForCausalLM(_config(V))
    state = padded.state_dict()
    rows = {"model.embed_tokens.weight": lambda w: w[:V], "lm_head.weight": lambda w: w[:, :V]}
    cut.set_state_dict({k: rows.get(k, lambda w: w)(v) for k, v in state.items()})
    padded.eval()
    cut.eval()
    return padded, cut


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(5, 1000, size=int(rng.integers(3, 12))))) for _ in range(n)]


def test_the_fixture_prefers_padding_ids_when_nothing_cuts_them(models, tok):
    padded, _ = models
    out = generate(padded, _prompts(2), SamplingParams(max_new_tokens=4))
    assert all(t >= len(tok) for o in out for t in o)


def test_decodable_vocab_is_the_smaller_of_tokenizer_and_model(models, tok):
    padded, cut = models
    assert decodable_vocab(padded, tok) == len(tok) == decodable_vocab(cut, tok)
    assert choice_width(padded, None) == len(tok) + PAD
    assert choice_width(padded, 10**9) == len(tok) + PAD
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="vocab="):
            choice_width(padded, bad)


def test_greedy_generation_cut_to_the_tokenizer_equals_the_model_without_padding(models, tok):
    padded, cut = models
    prompts, params = _prompts(3, seed=1), SamplingParams(max_new_tokens=10)
    assert generate(padded, prompts, params, vocab=len(tok)) == generate(cut, prompts, params)


def test_sampled_generation_and_rollouts_hold_only_decodable_ids(models, tok):
    padded, cut = models
    V = len(tok)
    params = SamplingParams(max_new_tokens=12, temperature=1.5, seed=3)
    steps = np.stack(list(generate_stream(padded, _prompts(4, seed=2), params, vocab=V)))
    assert steps.max() < V and (steps >= 0).all()
    ro = rollout(padded, _prompts(4, seed=4), params, pad_id=0, vocab=V)
    assert ro.completion_ids.max() < V
    tok.decode([t for c in ro.completions() for t in c])  # raised for a padding id before
    prompts = _prompts(3, seed=5)
    assert greedy_completions(padded, prompts, 8, [], 0, 2, vocab=V) == generate(cut, prompts, SamplingParams(8))


def test_speculative_decoding_cut_to_the_tokenizer_equals_plain_greedy(models, tok):
    padded, cut = models
    prompt, params = _prompts(1, seed=6)[0], SamplingParams(max_new_tokens=12)
    assert speculative_generate(padded, prompt, params, vocab=len(tok)) == generate(cut, [prompt], params)[0]


def test_the_engine_never_fails_a_request_on_a_padding_id_and_scores_as_the_cut_model(models, tok):
    """Sampled and greedy requests with log-probabilities (prompt and generated) on the padded
    model: every request ends normally with decodable ids, and greedy ids and every
    log-probability equal the cut model's."""
    padded, cut = models
    V = len(tok)

    def batch():
        prompts = _prompts(4, seed=7)
        sampled = [
            Request(p, SamplingParams(max_new_tokens=10, temperature=1.0, seed=i), None) for i, p in enumerate(prompts)
        ]
        greedy = [Request(p, SamplingParams(max_new_tokens=6), None, logprobs=3, prompt_logprobs=2) for p in prompts]
        return sampled, greedy

    got, ref = {}, {}
    for model, out in ((padded, got), (cut, ref)):
        e = Engine(model, tok, max_batch=4, max_model_len=64)
        try:
            assert e.vocab == V
            sampled, greedy = batch()
            out["sampled"], out["greedy"] = submit_and_wait(e, sampled), submit_and_wait(e, greedy)
        finally:
            e.close()
    for r in got["sampled"] + got["greedy"]:
        assert r.error is None and max(r.completion) < V
    for g, c in zip(got["greedy"], ref["greedy"]):
        assert g.completion == c.completion
        for a, b in ((g.token_logprobs, c.token_logprobs), (g.prompt_token_logprobs, c.prompt_token_logprobs)):
            assert [x.id for x in a] == [x.id for x in b]
            assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]
            np.testing.assert_allclose([x.logprob for x in a], [x.logprob for x in b], rtol=1e-5, atol=1e-5)


def test_the_engine_refuses_a_logit_bias_past_the_tokenizer(models, tok):
    padded, _ = models
    e = Engine(padded, tok, max_batch=1, max_model_len=32)
    try:
        with pytest.raises(ValueError, match=rf"logit_bias key {len(tok)} is outside the vocabulary \[0, {len(tok)}\)"):
            e.submit(Request([5, 6], SamplingParams(max_new_tokens=2, logit_bias={len(tok): 5.0}), None))
        with pytest.raises(ValueError, match="prompt token id"):  # a prompt may hold any id the model embeds
            e.submit(Request([5, len(tok) + PAD], SamplingParams(max_new_tokens=2), None))
        assert complete(e, [5, 6, 7], SamplingParams(max_new_tokens=3))[2] == "length"
    finally:
        e.close()


def test_vision_language_generation_chooses_below_the_tokenizer(tok):
    """The tiny VL model's ids past the tokenizer (its image / video placeholders) made the most
    likely: a text prompt's greedy reply still holds only the tokenizer's ids."""
    from erniekit.infer.vl_generate import generate_vl
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.registry import model_config

    V = len(tok)
    paddle.seed(0)
    m = Ernie4_5_VLForConditionalGeneration(
        model_config("tiny-vl").replace(initializer_range=0.5, tie_word_embeddings=False)
    )
    m.eval()
    assert m.config.vocab_size > V
    with paddle.no_grad():
        w = m.lm_head.weight.numpy()
        w[:, V:] *= 20.0
        m.lm_head.weight.set_value(paddle.to_tensor(w))
    prompt = _prompts(1, seed=8)[0]
    assert min(generate_vl(m, prompt, None, 4, [])) >= V  # the fixture: padding ids win uncut
    out = generate_vl(m, prompt, None, 8, [], vocab=decodable_vocab(m, tok))
    assert len(out) == 8 and max(out) < V


def test_chat_evaluation_and_sampled_reports_decode_the_padded_models_replies(models, tok):
    """What decodes generated ids (chat, with and without speculative decoding; exact match, the
    control and tool evaluations; the credibility report's samples) raised a DataError on the
    padded model's first reply before."""
    from pathlib import Path

    from erniekit.data.formats import load_sft_examples
    from erniekit.infer.chat import ChatSession
    from erniekit.infer.credibility import sample_replies
    from erniekit.train.control_eval import control_generation_eval
    from erniekit.train.evaluation import exact_match_eval
    from erniekit.train.tool_eval import tool_eval

    padded, cut = models
    data = Path(__file__).resolve().parents[3] / "examples" / "data"
    params = SamplingParams(max_new_tokens=6)
    for speculative in (False, True):
        reply = ChatSession(padded, tok, params, speculative=speculative).reply("1+2=")
        assert reply == ChatSession(cut, tok, params).reply("1+2=")
    convs = load_sft_examples(str(data / "arithmetic" / "eval.jsonl"))[:3]
    assert 0.0 <= exact_match_eval(padded, tok, convs, batch_size=3, max_new_tokens=4) <= 1.0
    controls = load_sft_examples(str(data / "control" / "eval.jsonl"))[:3]
    assert "exact_match" in control_generation_eval(padded, tok, controls, batch_size=3, max_new_tokens=4)
    thinking = default_tokenizer().with_thinking_template()
    tools = load_sft_examples(str(data / "tools" / "eval.jsonl"))[:2]
    assert tool_eval(padded, thinking, tools, batch_size=2, max_new_tokens=4)
    replies = sample_replies(padded, tok, [[5, 6, 7], [8, 9]], temperature=1.0, max_new_tokens=5, batch_size=2, seed=0)
    assert len(replies) == 2


def test_the_server_answers_sampled_requests_with_their_logprobs_on_the_padded_model(models, tok):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from erniekit.infer.server import OpenAIServer, build_app

    padded, _ = models
    e = Engine(padded, tok, max_batch=2, max_model_len=64)
    try:
        with TestClient(build_app(OpenAIServer(e, tok, "m"))) as http:
            body = {"model": "m", "prompt": "1+2=", "max_tokens": 6, "temperature": 1.0, "seed": 1, "logprobs": 3}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == 6 and all(len(top) == 3 for top in lp["top_logprobs"])
            bad = http.post("/v1/completions", json={**body, "logit_bias": {str(len(tok)): 1}})
            assert bad.status_code == 400 and "outside the vocabulary" in bad.text
    finally:
        e.close()


def test_a_prompt_id_past_the_cut_scores_minus_infinity_and_the_request_goes_on(tok):
    """A VL prompt's image placeholders lie past the tokenizer (the model embeds them): scored
    under the cut distribution they have probability 0; the request still answers (it failed
    with an IndexError when the cut row was indexed by them)."""
    from PIL import Image

    from erniekit.infer.engine import token_logprobs
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.ernie4_5_vl.processor import ImageSettings, image_tokens, preprocess_image
    from erniekit.models.registry import model_config

    rows = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    got = token_logprobs(rows, np.array([2, 8, 11]), 2)
    assert got[1].logprob == got[2].logprob == -np.inf and np.isfinite(got[0].logprob)
    assert all(t < 8 for e in got for t, _ in e.top)

    paddle.seed(0)
    m = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl"))
    m.eval()
    rng = np.random.default_rng(0)
    pixels = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    patches, grid = preprocess_image(pixels, ImageSettings(min_pixels=56 * 56, max_pixels=56 * 56))
    ids = [5, 6, 7] + image_tokens(grid, m.config) + [8, 9]
    e = Engine(m, tok, max_batch=1, max_model_len=128)
    try:
        (r,) = submit_and_wait(
            e, [Request(ids, SamplingParams(max_new_tokens=2), None, images=(patches, grid), prompt_logprobs=1)]
        )
    finally:
        e.close()
    assert r.error is None and len(r.prompt_token_logprobs) == len(ids) - 1
    for t, lp in zip(ids[1:], r.prompt_token_logprobs):
        assert (lp.logprob == -np.inf) == (t >= len(tok)) and lp.id == t
