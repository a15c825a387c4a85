"""Self-speculative decoding (erniekit/infer/speculative.py) refuses what it would get wrong with
one line: an empty prompt (an IndexError before), logit adjustments (silently ignored before)."""

from __future__ import annotations

import paddle
import pytest

from erniekit.errors import ErniekitError
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.speculative import speculative_generate
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset


@pytest.fixture(scope="module")
def mtp_model():
    paddle.seed(0)
    m = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_nextn_predict_layers=1))
    m.eval()
    return m


def test_empty_prompt_is_a_one_line_error(mtp_model):
    with pytest.raises(ErniekitError, match="at least one token"):
        speculative_generate(mtp_model, [], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize("kw", [{"logit_bias": {5: 10.0}}, {"presence_penalty": 1.0}, {"frequency_penalty": -1.0}])
def test_logit_adjustments_are_refused_not_ignored(mtp_model, kw):
    with pytest.raises(ErniekitError, match="plain argmax"):
        speculative_generate(mtp_model, [5, 6], SamplingParams(max_new_tokens=3, **kw))
