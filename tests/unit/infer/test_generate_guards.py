"""Library generation refuses what it would get wrong with one line: logits that turned NaN or inf
(greedy argmax picked a token, sampling raised a multi-line framework error) in `generate`,
`speculative_generate` and `generate_vl`, and prompt ids outside the vocabulary (an embedding error
from inside the forward)."""

from __future__ import annotations

import paddle
import pytest

from erniekit.errors import NonFiniteError, RequestError
from erniekit.infer.generate import generate, generate_stream, non_finite_error
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.speculative import speculative_generate
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset

PROMPT = [5, 17, 300, 42, 9]


def _model(mtp: bool = False) -> Ernie4_5ForCausalLM:
    paddle.seed(0)  # initializer_range 0.2: the model continues a prompt with varied tokens
    cfg = get_preset("tiny-dense").replace(num_hidden_layers=1, initializer_range=0.2)
    m = Ernie4_5ForCausalLM(cfg.replace(num_nextn_predict_layers=1) if mtp else cfg)
    m.eval()
    return m


def _poison(param: paddle.Tensor, value: float = float("nan")) -> None:
    param.set_value(paddle.full_like(param, value))


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_weights_stop_generate_at_the_first_step(temperature):
    model = _model()
    _poison(model.model.layers[0].self_attn.o_proj.weight)
    params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=1)
    with pytest.raises(NonFiniteError) as e:
        generate(model, [PROMPT, PROMPT[:3]], params)
    text = _one_line(e)
    assert "non-finite logits (NaN or inf) at generation step 1 of 4 of prompt 0" in text
    assert "check the checkpoint's weights" in text


def test_the_error_names_the_step_and_prompt_where_logits_turn_non_finite():
    paddle.seed(0)  # untied: an inf embedding row then poisons the rows fed that token, not every logit row
    cfg = get_preset("tiny-dense").replace(num_hidden_layers=1, initializer_range=0.2, tie_word_embeddings=False)
    model = Ernie4_5ForCausalLM(cfg)
    clean = generate(model, [PROMPT, [64, 100, 3, 77]], SamplingParams(max_new_tokens=6))
    t3 = clean[1][2]  # fed at step 4 of prompt 1 only: its embedding row poisons that row from then on
    assert t3 not in PROMPT + [64, 100, 3, 77] + clean[0] + clean[1][:2]
    emb = model.model.embed_tokens.weight
    rows = emb.numpy()
    rows[t3] = float("inf")
    emb.set_value(paddle.to_tensor(rows))
    steps = []
    with pytest.raises(NonFiniteError) as e:
        for step in generate_stream(model, [PROMPT, [64, 100, 3, 77]], SamplingParams(max_new_tokens=6)):
            steps.append(step.tolist())
    assert "at generation step 4 of 6 of prompt 1;" in _one_line(e)
    assert steps == [[clean[0][i], clean[1][i]] for i in range(3)]  # the finite steps came out unchanged


def test_nan_trunk_or_mtp_weights_stop_speculative_decoding():
    model = _model(mtp=True)
    _poison(model.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(NonFiniteError) as e:
        speculative_generate(model, PROMPT, SamplingParams(max_new_tokens=5))
    assert "at generation step 1 of 5;" in _one_line(e)

    model = _model(mtp=True)
    want = generate(model, [PROMPT], SamplingParams(max_new_tokens=5))[0]
    assert speculative_generate(model, PROMPT, SamplingParams(max_new_tokens=5)) == want
    _poison(model.mtp.mtp_linear_proj[0].weight)
    with pytest.raises(NonFiniteError) as e:
        speculative_generate(model, PROMPT, SamplingParams(max_new_tokens=5))
    assert "in MTP head 1's draft of generation step 2 (decoding without --speculative skips it)" in _one_line(e)
    assert generate(model, [PROMPT], SamplingParams(max_new_tokens=5))[0] == want  # the trunk is intact


def test_nan_weights_and_foreign_prompt_ids_stop_vision_language_generation():
    from erniekit.infer.vl_generate import generate_vl
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.registry import model_config

    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(num_hidden_layers=1))
    assert len(generate_vl(model, PROMPT, None, 3, [])) == 3
    _poison(model.model.layers[0].self_attn.o_proj.weight)
    with pytest.raises(RequestError) as e:  # ids from another model's processor: one line, before the forward
        generate_vl(model, [5, -1, 9], None, 3, [])
    assert "prompt token id -1 at position 1 is outside the vocabulary" in _one_line(e)
    _poison(model.model.layers[0].self_attn.o_proj.weight)
    with pytest.raises(NonFiniteError) as e:
        generate_vl(model, PROMPT, None, 3, [])
    assert "at generation step 1 of 3;" in _one_line(e)


def test_the_hint_names_float16_overflow_only_in_float16():
    assert "load the model in bfloat16 or float32" in str(non_finite_error("at generation step 1", paddle.float16))
    assert "float16" not in str(non_finite_error("at generation step 1", paddle.bfloat16))
    assert "float16" not in str(non_finite_error("at generation step 1", paddle.float32))


@pytest.mark.parametrize(
    "prompts, said",
    [
        ([[5, 1024, 3]], "prompt token id 1024 at position 1 is outside the vocabulary [0, 1024)"),
        ([[5, 6], [7, 8, -1]], "prompt token id -1 at position 2 of prompt 1 is outside the vocabulary [0, 1024)"),
    ],
)
def test_prompt_ids_outside_the_vocabulary_are_one_line(prompts, said):
    model = _model(mtp=True)
    with pytest.raises(RequestError) as e:
        generate(model, prompts, SamplingParams(max_new_tokens=2))
    assert said in _one_line(e)
    if len(prompts) == 1:
        with pytest.raises(RequestError) as e:
            speculative_generate(model, prompts[0], SamplingParams(max_new_tokens=2))
        assert said in _one_line(e)


def test_a_pad_id_outside_the_vocabulary_is_refused_for_a_padded_batch():
    model = _model()
    with pytest.raises(RequestError, match=r"pad_id 5000 is outside the vocabulary \[0, 1024\)"):
        generate(model, [[5, 6], [7]], SamplingParams(max_new_tokens=2), pad_id=5000)
    assert len(generate(model, [[5, 6]], SamplingParams(max_new_tokens=2), pad_id=5000)[0]) == 2  # never fed


def test_erniekit_chat_prints_the_non_finite_error_in_one_line(tmp_path, capsys):
    from erniekit.cli import main
    from erniekit.models.ernie4_5 import save_pretrained
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    model = _model(mtp=True)
    _poison(model.model.layers[0].self_attn.o_proj.weight)
    save_pretrained(model, str(tmp_path / "nan"), tokenizer=default_tokenizer())
    for extra in ([], ["--speculative"], ["--temperature", "0.7"]):
        assert main(["chat", str(tmp_path / "nan"), "--prompt", "hello", "--max-new-tokens", "4", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: the model produced non-finite logits"), err
        assert "at generation step 1 of 4;" in err[0]
