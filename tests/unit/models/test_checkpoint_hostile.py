"""Checkpoint directories that lie: config.json values no model can be built from, a config that
disagrees with its weights, an index pointing outside the directory, a scaled rope, a malformed
adapter config. Each is one CheckpointError naming the file and the key or tensor, before a model
is built (an absurd config would otherwise allocate gigabytes first)."""

import json
import math
import os

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file, save_file

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import Ernie4_5Config, Ernie4_5ForCausalLM, from_pretrained, modeling, save_pretrained
from erniekit.models.registry import load_model

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
TINY_MOE = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1)


def _checkpoint(path, moe: bool = False, **over) -> str:
    paddle.seed(0)
    save_pretrained(Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, **(TINY_MOE if moe else {}), **over)), str(path))
    return str(path)


def _edit_json(file, **changes) -> None:
    d = json.loads(open(file).read())
    d.update(changes)
    with open(file, "w") as f:
        json.dump(d, f)


def _edit_config(path, **changes) -> None:
    _edit_json(os.path.join(path, "config.json"), **changes)


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def _forbid_building(monkeypatch) -> None:
    """From now on building a model fails the test: the refusal must come before any allocation."""

    def refuse(self, config):
        raise AssertionError(f"model built from {config}")

    monkeypatch.setattr(modeling.Ernie4_5ForCausalLM, "__init__", refuse)


# ---- I1: rope_scaling ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope_scaling,refused",
    [
        (None, False),
        ({"rope_type": "default"}, False),
        ({"type": "default"}, False),
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
        ({"type": "linear", "factor": 2.0}, "rope_type='linear'"),  # transformers 4.x spelling
        ("linear", "must be an object or null"),
    ],
)
def test_a_scaled_rope_scaling_is_refused_not_ignored(tmp_path, rope_scaling, refused):
    path = _checkpoint(tmp_path)
    _edit_config(path, rope_scaling=rope_scaling)
    if not refused:
        assert Ernie4_5Config.from_pretrained(path).rope_theta == Ernie4_5Config(**TINY).rope_theta
        return
    with pytest.raises(CheckpointError, match=rf"config\.json: rope_scaling.*{refused}") as e:
        load_model(path)
    _one_line(e)


def test_the_vl_config_refuses_a_scaled_text_rope():
    from erniekit.models.ernie4_5_vl.configuration import PRESETS, Ernie4_5_VLConfig

    d = PRESETS["tiny-vl"].to_dict()
    assert Ernie4_5_VLConfig.from_dict(d) == PRESETS["tiny-vl"]
    d["text_config"]["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(CheckpointError, match=r"text_config\.rope_scaling: rope_type='linear' is not supported"):
        Ernie4_5_VLConfig.from_dict(d)


# ---- I2: sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers=1000000000000 is invalid: it must be an integer in"),
        ({"vocab_size": 10**10}, r"vocab_size=10000000000 is invalid"),
        ({"intermediate_size": 10**10}, r"intermediate_size=10000000000 is invalid"),
        ({"head_dim": 10**9}, r"num_attention_heads=4 x head_dim=1000000000 = 4000000000 exceeds 2147483647"),
        ({"num_nextn_predict_layers": 10**12}, r"num_nextn_predict_layers=1000000000000 must be an integer in"),
        (
            {"moe_num_experts": 10**9, "moe_k": 1, "moe_intermediate_size": 1024},
            r"describes about 1\.97e\+14 parameters, more than the 4\.4e\+12",
        ),
        ({"max_position_embeddings": 10**12}, r"max_position_embeddings=1000000000000 is invalid"),
    ],
)
def test_absurd_sizes_are_refused_by_the_config_checks(changes, message):
    with pytest.raises(CheckpointError, match=message):
        Ernie4_5Config.from_dict({**TINY, **TINY_MOE, "model_type": "ernie4_5_moe", **changes})


@pytest.mark.parametrize("moe", [False, True])
def test_the_parameter_estimate_counts_the_built_model(moe):
    """What the size limit and the comparison with the headers are measured in."""
    c = Ernie4_5Config(**TINY, **(TINY_MOE if moe else {}), tie_word_embeddings=False)
    model = Ernie4_5ForCausalLM(c)
    built = sum(math.prod(p.shape) for p in model.parameters())
    assert abs(c.num_parameters_estimate() - built) <= 0.02 * built


@pytest.mark.parametrize(
    "moe,changes,message",
    [
        (False, {"num_hidden_layers": 10**6}, r"num_hidden_layers=1000000 but the weights hold 3 decoder layers"),
        (False, {"num_hidden_layers": 4}, r"num_hidden_layers=4 but the weights hold 3 decoder layers"),
        (
            False,
            {"hidden_size": 10**7, "head_dim": 8},
            r"vocab_size=64, hidden_size=10000000 but tensor model\.embed_tokens\.weight in .*model\.safetensors "
            r"has shape \[64, 32\]",
        ),
        (False, {"vocab_size": 10**8}, r"vocab_size=100000000, hidden_size=32 but tensor model\.embed_tokens"),
        (False, {"intermediate_size": 10**9}, r"the config describes about .* parameters but the weights hold"),
        (True, {"moe_num_experts": 10**6}, r"moe_num_experts=1000000 but the weights hold 4 routed experts"),
        (True, {"moe_intermediate_size": 10**8}, r"the config describes about .* parameters but the weights hold"),
        (False, {"num_nextn_predict_layers": 10**6}, r"num_nextn_predict_layers=1000000 but the weights hold 0"),
    ],
)
@pytest.mark.parametrize("loader", ["load_model", "from_pretrained"])
def test_a_config_that_disagrees_with_its_weights_is_refused_before_building(
    tmp_path, monkeypatch, moe, changes, message, loader
):
    """Compared with the safetensors headers: no model is built."""
    path = _checkpoint(tmp_path, moe=moe)
    _edit_config(path, **changes)
    _forbid_building(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}") as e:
        (load_model if loader == "load_model" else from_pretrained)(path)
    _one_line(e)


def test_the_header_check_reads_the_paddle_layout_names(tmp_path, monkeypatch):
    from erniekit.models.ernie4_5.paddle_layout import paddle_state_dict

    paddle.seed(0)
    model = Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, **TINY_MOE))
    save_file({k: v.numpy() for k, v in paddle_state_dict(model).items()}, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(str(tmp_path))
    _edit_config(tmp_path, num_hidden_layers=10**6)
    _forbid_building(monkeypatch)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1000000 but the weights hold 3 decoder layers"):
        load_model(str(tmp_path))


def test_the_weights_may_hold_more_than_the_config_takes_and_overrides_count(tmp_path):
    """Fewer layers than the weights (config.json or an override: an elastic cut) load, with the
    unused tensors named; an override that fixes a config.json the weights disagree with is
    what the check compares, and one that breaks it names model_overrides."""
    path = _checkpoint(tmp_path, moe=True)
    with pytest.warns(UserWarning, match="not used"):
        model = load_model(path, {"num_hidden_layers": 2})
    assert len(model.model.layers) == 2
    _edit_config(path, num_nextn_predict_layers=1)  # the weights hold no MTP block
    with pytest.raises(CheckpointError, match=r"config\.json: num_nextn_predict_layers=1 but the weights hold 0"):
        load_model(path)
    assert load_model(path, {"num_nextn_predict_layers": 0}).mtp is None
    assert from_pretrained(path, config_overrides={"num_nextn_predict_layers": 0}).mtp is None
    with pytest.raises(
        CheckpointError, match=r"config\.json with model_overrides: num_hidden_layers=5 but the weights hold 3"
    ):
        load_model(path, {"num_nextn_predict_layers": 0, "num_hidden_layers": 5})


def test_the_header_check_opens_no_tensor(tmp_path, monkeypatch):
    """Headers only: a checkpoint's tensors are not read by the check."""
    from safetensors import safe_open

    from erniekit.models.ernie4_5.checkpoint import check_config_against_weights

    path = _checkpoint(tmp_path, moe=True)
    read = []
    real = safe_open

    class Counting:
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_slice(self, name):
            return self.h.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.h.get_tensor(name)

    monkeypatch.setattr("safetensors.safe_open", Counting)
    check_config_against_weights(Ernie4_5Config.from_pretrained(path), path)
    assert read == []


# ---- I4: token ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value",
    [("eos_token_id", "x"), ("eos_token_id", [2, "x"]), ("eos_token_id", []), ("eos_token_id", -1)]
    + [("bos_token_id", "x"), ("pad_token_id", -5), ("pad_token_id", 1.5), ("bos_token_id", 2**40)],
)
def test_bad_token_ids_are_refused_at_load_naming_the_key(tmp_path, key, value):
    path = _checkpoint(tmp_path)
    _edit_config(path, **{key: value})
    with pytest.raises(CheckpointError, match=rf"config\.json: {key}=.* is invalid: it must be a token id") as e:
        load_model(path)
    _one_line(e)


def test_good_token_ids_load_and_save(tmp_path):
    path = _checkpoint(tmp_path / "a")
    _edit_config(path, eos_token_id=[2, 5], pad_token_id=None)
    from erniekit.models.registry import save_model

    save_model(load_model(path), str(tmp_path / "b"))
    saved = json.loads((tmp_path / "b" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, 5]


# ---- I6: the index stays inside the directory ----------------------------------------------


def _sharded(path) -> str:
    paddle.seed(0)
    save_pretrained(Ernie4_5ForCausalLM(Ernie4_5Config(**TINY)), str(path), max_shard_size=4096)
    return str(path)


@pytest.mark.parametrize("entry", ["abs", "../outside/{f}", "sub/../../{f}"])
def test_an_index_entry_leaving_the_directory_is_refused(tmp_path, entry):
    path = _sharded(tmp_path / "ckpt")
    os.makedirs(tmp_path / "outside")
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_file).read())
    name, f = next(iter(index["weight_map"].items()))
    os.link(os.path.join(path, f), tmp_path / "outside" / f)  # the file it points at is a real shard
    index["weight_map"][name] = str(tmp_path / "outside" / f) if entry == "abs" else entry.format(f=f)
    with open(index_file, "w") as out:
        json.dump(index, out)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors\.index\.json: weight_map\[.*\] = .* is not a file"
    ) as e:
        load_model(path)
    assert name in _one_line(e)


def test_symlinked_shards_inside_the_directory_still_load(tmp_path):
    """The Hugging Face cache: snapshot files are symlinks to blobs elsewhere."""
    path = _sharded(tmp_path / "ckpt")
    blobs = tmp_path / "blobs"
    os.makedirs(blobs)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.rename(os.path.join(path, f), blobs / f)
            os.symlink(blobs / f, os.path.join(path, f))
    ref = from_pretrained(_sharded(tmp_path / "ref"))
    got = load_model(path)
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=n)


# ---- I5: adapter_config.json ---------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"lora_alpha": "x"}, r"lora_alpha='x' must be a finite number > 0"),
        ({"lora_alpha": float("nan")}, r"lora_alpha=nan must be a finite number > 0"),
        ({"rank_pattern": {"([": 2}}, r"rank_pattern key '\(\[' is not a valid regex"),
        ({"alpha_pattern": {"q_proj)": 2.0}}, r"alpha_pattern key 'q_proj\)' is not a valid regex"),
    ],
)
def test_a_malformed_adapter_config_is_one_line_naming_the_key(tmp_path, changes, message):
    from erniekit.nn.lora import LoraConfig, apply_lora, load_adapter, load_adapter_weights, save_adapter

    paddle.seed(0)
    model = Ernie4_5ForCausalLM(Ernie4_5Config(**TINY))
    apply_lora(model, LoraConfig(r=2, target_modules=[r".*\.q_proj"]))
    save_adapter(model, str(tmp_path))
    _edit_json(tmp_path / "adapter_config.json", **changes)
    fresh = Ernie4_5ForCausalLM(Ernie4_5Config(**TINY))
    for load in (lambda: load_adapter(fresh, str(tmp_path)), lambda: load_adapter_weights(model, str(tmp_path))):
        with pytest.raises(CheckpointError, match=rf"adapter_config\.json: {message}") as e:
            load()
        _one_line(e)


def test_lora_config_refuses_a_non_number_alpha():
    from erniekit.errors import ConfigError
    from erniekit.nn.lora import LoraConfig

    with pytest.raises(ConfigError, match=r"lora_alpha='x' must be a number > 0"):
        LoraConfig(lora_alpha="x")


# ---- I7: the MoE head's bias everywhere the head is applied ----------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_the_moe_head_bias_is_kept_by_the_decode_and_loss_paths(tmp_path, tied):
    """The bias comes back from the checkpoint, decoding (few rows: the small-GEMM / W h^T path)
    adds it as the full forward does, and the chunked loss is bypassed (it has no bias)."""
    from erniekit.models.ernie4_5 import KVCache
    from erniekit.train.losses import head_fusable

    paddle.seed(0)
    m = Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, **TINY_MOE, use_bias=True, tie_word_embeddings=tied))
    m.lm_head.bias.set_value(paddle.randn([64]))
    save_pretrained(m, str(tmp_path))
    assert "lm_head.bias" in load_file(str(tmp_path / "model.safetensors"))
    m = from_pretrained(str(tmp_path))
    m.eval()
    assert m.head_weight() is None and not head_fusable(m)
    ids = paddle.to_tensor([[3, 9, 27, 4, 11, 60, 2]])
    with paddle.no_grad():
        full = m(ids).logits.numpy()
        no_bias = m.head(m.model(ids)).numpy() - m.lm_head.bias.numpy()
        cache = KVCache(m.config, 1, 8)
        steps = [m(ids[:, :5], cache=cache).logits.numpy()]
        steps += [m(ids[:, t : t + 1], cache=cache).logits.numpy() for t in range(5, 7)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    assert np.abs(full - no_bias).max() > 0.5  # the bias is in the logits


def test_an_untied_override_of_a_tied_checkpoint_names_model_overrides(tmp_path, monkeypatch):
    """README's pretrain -> SFT chain once passed sft.yaml's model_overrides (an output head of its own)
    to a tied pretraining checkpoint: 'lm_head.weight is missing', with no word of the override."""
    path = _checkpoint(tmp_path, tie_word_embeddings=True)
    _forbid_building(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        load_model(path, {"tie_word_embeddings": False})
    assert "with model_overrides: tie_word_embeddings=false but the weights hold no lm_head.weight" in _one_line(e)
    assert "'model_overrides={}'" in str(e.value)
    _edit_config(path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"config\.json: tie_word_embeddings=false but the weights hold no"):
        load_model(path)
