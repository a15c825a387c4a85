"""LoRA adapters of a pipeline stage (a model that holds some decoder layers only): the stages'
tensors together are the whole model's adapter, written with the whole model's adapter_config.json;
a stage whose layers no target selects still writes and reloads an adapter; stages agree on the
activations' dtype when the adapted base is held in bfloat16. The multi-process runs are
tests/e2e/test_pipeline_lora.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

from erniekit.distributed.collective.pipeline import StageElsewhere
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.nn.lora import (
    LoraConfig,
    adapter_tensors,
    apply_lora,
    has_lora,
    load_adapter_weights,
    lora_layers,
    save_adapter,
)
from erniekit.train.checkpointing import save_model_or_adapter
from erniekit.train.pipeline_schedule import PipelineStep
from erniekit.train.runners.base import StepRunner

LATER = r"model\.layers\.[23]\..*_proj"  # the second stage's layers of a 4-layer model split 2 + 2


def _model(preset: str, layers: range | None = None, **lora) -> Ernie4_5ForCausalLM:
    """A 4-layer model with adapters whose values depend on their names only (B nonzero), holding
    `layers` of it as a pipeline stage does (None: every layer)."""
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset(preset).replace(num_hidden_layers=4))
    apply_lora(model, LoraConfig(r=2, **lora))
    for name, p in model.named_parameters():
        if not p.stop_gradient:
            rng = np.random.default_rng(sum(map(ord, name)))
            p.set_value(rng.standard_normal(p.shape).astype("float32"))
    for i in range(4):
        if layers is not None and i not in layers:
            model.model.layers[i] = StageElsewhere(0 if i < 2 else 1)
    return model


def _stages(preset: str, **lora) -> list[Ernie4_5ForCausalLM]:
    return [_model(preset, range(0, 2), **lora), _model(preset, range(2, 4), **lora)]


def _gathered(stages) -> dict[str, paddle.Tensor]:
    out: dict[str, paddle.Tensor] = {}
    for s in stages:
        out.update(adapter_tensors(s))
    return out


@pytest.mark.parametrize(
    "preset, lora",
    [
        ("tiny-dense", {"use_dora": True}),
        ("tiny-moe", {"peft_layout": "fused"}),  # routed experts as PEFT's target_parameters
        ("tiny-moe", {"peft_layout": "per_expert"}),
        # targets on the second stage's layers only: that stage alone would call them "every q_proj ..."
        ("tiny-dense", {"target_modules": [LATER]}),
    ],
)
def test_the_stages_adapters_together_save_as_the_whole_models(tmp_path, preset, lora):
    whole, stages = _model(preset, **lora), _stages(preset, **lora)
    gathered = _gathered(stages)
    want = adapter_tensors(whole)
    assert sorted(gathered) == sorted(want) and len(want) > 0
    for k, t in want.items():
        np.testing.assert_array_equal(gathered[k].numpy(), t.numpy(), err_msg=k)
    save_adapter(whole, str(tmp_path / "whole"), base_model_name_or_path="base")
    save_adapter(stages[0], str(tmp_path / "pp"), base_model_name_or_path="base", tensors=gathered)
    config = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("whole", "pp")]
    assert config[1] == config[0]
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("whole", "pp"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


class _TwoStages(StepRunner):
    """Stage 0's runner in a 2-stage pipeline, its gather to rank 0 done in process: stage 1's
    tensors are added to the ones stage 0 gives (PipelineTopology.gather_to_main's union)."""

    partial = True

    def __init__(self, other: dict[str, paddle.Tensor]):
        self.other = other

    def full_tensors(self, tensors):
        return {**tensors, **self.other}

    def sync(self) -> None:
        pass


def test_a_stage_without_adapters_still_writes_and_reloads_the_adapter(tmp_path):
    """Targets on the second stage's layers only: the first stage holds no adapted layer, but the run
    is LoRA: it writes the adapter (not its base weights as a whole model) and resumes from it."""
    first, second = _stages("tiny-dense", target_modules=[LATER])
    assert not lora_layers(first) and has_lora(first)
    out = tmp_path / "adapter"
    save_model_or_adapter(first, str(out), default_tokenizer(), "base", runner=_TwoStages(adapter_tensors(second)))
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    save_adapter(_model("tiny-dense", target_modules=[LATER]), str(tmp_path / "whole"))
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "whole", out))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)

    fresh_first, fresh_second = _stages("tiny-dense", target_modules=[LATER])
    for _, p in fresh_second.named_parameters():
        if not p.stop_gradient:
            p.set_value(paddle.zeros_like(p))
    load_adapter_weights(fresh_first, str(out))  # nothing of it is this stage's
    load_adapter_weights(fresh_second, str(out))
    for (n, p), (_, q) in zip(second.named_parameters(), fresh_second.named_parameters()):
        np.testing.assert_array_equal(q.numpy(), p.numpy(), err_msg=n)


def test_stages_send_activations_in_the_models_dtype_with_a_bfloat16_base():
    """lora_base_dtype=bfloat16 holds the adapted base weights in bfloat16: on an untied model that is
    the last stage's first parameter, while the first stage embeds in float32."""
    paddle.seed(0)
    model = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=4, tie_word_embeddings=False))
    apply_lora(model, LoraConfig(r=2, base_dtype="bfloat16"))
    for i in range(2):
        model.model.layers[i] = StageElsewhere(0)
    model.model.embed_tokens = StageElsewhere(0)
    assert model.parameters()[0].dtype == paddle.bfloat16  # what the stage took before
    assert PipelineStep(SimpleNamespace(layers=range(2, 4)), model).dtype == paddle.float32
