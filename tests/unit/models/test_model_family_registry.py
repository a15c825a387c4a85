"""Adding a model family is its own package whose family.py registers a `ModelFamily`
(CONTRIBUTING.md): this file follows that recipe with a toy family, an ERNIE 4.5 whose MLP uses
GELU, and checks that training, saving, LoRA, export + verify and chat pick its code by the
checkpoint's config.json `model_type`, with no edit anywhere else."""

import dataclasses
import json
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from erniekit.errors import CheckpointError
from erniekit.models import registry
from erniekit.models.ernie4_5 import Ernie4_5Config, Ernie4_5ForCausalLM, get_preset
from erniekit.models.ernie4_5.checkpoint import hf_state_dict, load_state_into, save_pretrained
from erniekit.models.ernie4_5.modeling import MLP
from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer, default_tokenizer
from erniekit.utils.io import read_json_object

TOY_TYPE = "toy_gelu_lm"


class ToyConfig(Ernie4_5Config):
    @property
    def model_type(self) -> str:
        return TOY_TYPE


class GeluMLP(MLP):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class ToyForCausalLM(Ernie4_5ForCausalLM):
    def __init__(self, config: ToyConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = GeluMLP(config)


def _read_config(path: str) -> ToyConfig:
    d = read_json_object(os.path.join(path, "config.json"), "fix config.json")
    if d.get("model_type") != TOY_TYPE:
        raise CheckpointError(f"{path}: not a {TOY_TYPE} checkpoint")
    return ToyConfig.from_dict({k: v for k, v in d.items() if k not in ("model_type", "architectures")})


def _toy_preset() -> ToyConfig:
    base = get_preset("tiny-dense")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return ToyConfig(**{**fields, "num_hidden_layers": 2})


TOY = registry.ModelFamily(
    name="toy_gelu",
    model_types=(TOY_TYPE,),
    presets=lambda: {"toy-gelu": _toy_preset()},
    read_config=_read_config,
    build=ToyForCausalLM,
    load_weights=load_state_into,  # ERNIE 4.5 tensor names: the family reuses that checkpoint io
    state_dict=hf_state_dict,
    save=save_pretrained,
    load_tokenizer=ErnieTokenizer.from_pretrained,
    default_tokenizer=default_tokenizer,
)


@pytest.fixture
def toy_family():
    registry.register_model_family(TOY)
    yield TOY
    registry.unregister_model_family(TOY.name)


@pytest.fixture
def toy_dir(toy_family, tmp_path):
    paddle.seed(0)
    model = registry.load_model("toy-gelu")
    path = str(tmp_path / "toy")
    registry.save_model(model, path, tokenizer=default_tokenizer())
    return path


def _logits(model, ids=(1, 5, 9, 12, 30)):
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor([list(ids)], dtype="int64")).logits.numpy()


def test_a_checkpoint_names_its_family_and_loads_with_that_familys_code(toy_dir):
    assert json.load(open(os.path.join(toy_dir, "config.json")))["model_type"] == TOY_TYPE
    assert registry.family_of(toy_dir) is TOY and registry.family_of("toy-gelu") is TOY
    assert registry.family_of("tiny-dense").name == "ernie4_5"
    model = registry.load_model_or_adapter(toy_dir)
    assert type(model) is ToyForCausalLM and isinstance(model.model.layers[0].mlp, GeluMLP)
    # the same weights under ERNIE 4.5's SwiGLU give other logits: the toy family's code ran
    plain = Ernie4_5ForCausalLM(get_preset("tiny-dense").replace(num_hidden_layers=2))
    load_state_into(plain, toy_dir)
    a, b = _logits(model), _logits(plain)
    assert np.abs(a - b).max() > 1e-3
    np.testing.assert_allclose(_logits(registry.load_model(toy_dir)), a, rtol=0, atol=1e-6)


def test_training_saving_and_lora_go_through_the_family(toy_dir, tmp_path):
    from erniekit.config import load_config, validate
    from erniekit.train.run import run_train

    base = registry.load_model(toy_dir)
    out = tmp_path / "out"
    common = [
        f"model_name_or_path={toy_dir}",
        "stage=SFT",
        "train_dataset_path=examples/data/arithmetic/train.jsonl",
        "max_seq_len=32",
        "learning_rate=1e-3",
        "max_steps=3",
        "per_device_train_batch_size=8",
        "eval_steps=100",
        "save_steps=100",
        "logging_steps=1",
        "disable_tqdm=true",
    ]
    cfg = validate(load_config(None, [*common, f"output_dir={out}"]))
    run_train(cfg, log=lambda s: None)
    trained = registry.load_model_or_adapter(str(out))
    assert type(trained) is ToyForCausalLM
    assert json.load(open(out / "config.json"))["model_type"] == TOY_TYPE
    assert np.abs(_logits(trained) - _logits(base)).max() > 0  # it trained

    lora_out = tmp_path / "lora"
    cfg = validate(load_config(None, [*common, "fine_tuning=LoRA", f"output_dir={lora_out}"]))
    run_train(cfg, log=lambda s: None)
    assert os.path.isfile(lora_out / "adapter_config.json")
    merged = registry.load_model_or_adapter(str(lora_out))  # the adapter's base picks the family
    assert type(merged) is ToyForCausalLM


def test_export_verify_and_chat_load_the_family(toy_dir, tmp_path):
    from erniekit.export.hf import export_hf, verify
    from erniekit.infer.chat import load_chat_model

    out = export_hf(toy_dir, str(tmp_path / "export"))
    report = verify(out)
    assert report["ok"] and report["max_abs_diff"] < 1e-5, report
    model, tokenizer = load_chat_model(out)
    assert type(model) is ToyForCausalLM and tokenizer.vocab_size <= model.config.vocab_size


def test_an_unknown_model_type_is_one_line_naming_the_known_ones(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError) as e:
        registry.family_of(str(d))
    msg = str(e.value)
    assert "\n" not in msg and "model_type='llama'" in msg and "ernie4_5_moe" in msg and "config.json" in msg


def test_presets_of_every_family_are_valid_model_names(toy_family, tmp_path):
    from erniekit.config import load_config, validate
    from erniekit.errors import ConfigError

    cfg = validate(load_config(None, ["model_name_or_path=toy-gelu"]))
    assert cfg.model_name_or_path == "toy-gelu"
    registry.unregister_model_family(TOY.name)
    with pytest.raises(ConfigError, match="toy-gelu"):
        validate(load_config(None, ["model_name_or_path=toy-gelu"]))
