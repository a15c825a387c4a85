"""Config: YAML + overrides, type checks, validation and dump/load round trip."""

from __future__ import annotations

import json

import pytest

from erniekit.config import TrainConfig, dump_config, load_config, validate
from erniekit.errors import ConfigError


def _yaml(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def valid(tmp_path):
    """Overrides that make a config pass validation on a laptop: real data file and model dir."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"src": ["1+1="], "tgt": ["2"]}) + "\n")
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return [f"train_dataset_path={data}", f"model_name_or_path={model}", f"output_dir={tmp_path / 'out'}"]


def test_defaults_without_file():
    cfg = load_config(None, [])
    assert cfg == TrainConfig()
    assert cfg.stage == "SFT" and cfg.max_steps == -1 and cfg.model_overrides == {}


def test_yaml_then_overrides_precedence(tmp_path):
    path = _yaml(tmp_path, "### run\nmax_steps: 5\nseed: 7\nlearning_rate: 1.0e-3\n")
    cfg = load_config(path, ["max_steps=9", "max_steps=11"])
    assert cfg.max_steps == 11  # last override wins over the file
    assert cfg.seed == 7  # file wins over the default
    assert cfg.learning_rate == pytest.approx(1e-3)
    assert cfg.per_device_train_batch_size == 8  # untouched default


def test_scientific_notation_is_a_number(tmp_path):
    # PyYAML reads "3e-4" as a string, both from the command line and from a file.
    cfg = load_config(None, ["learning_rate=3e-4", "max_steps=1e3"])
    assert isinstance(cfg.learning_rate, float) and cfg.learning_rate == pytest.approx(3e-4)
    assert cfg.max_steps == 1000 and isinstance(cfg.max_steps, int)
    cfg = load_config(_yaml(tmp_path, "min_lr: 5e-6\nmodel_overrides: {rope_theta: 5e5}\n"), [])
    assert cfg.min_lr == pytest.approx(5e-6)
    assert cfg.model_overrides == {"rope_theta": 500000.0}


def test_nested_sections_are_flattened(tmp_path):
    path = _yaml(
        tmp_path,
        "data:\n  max_seq_len: 64\n  packing: true\ntrain:\n  max_steps: 3\nmodel_overrides:\n  num_hidden_layers: 2\n",
    )
    cfg = load_config(path, [])
    assert cfg.max_seq_len == 64 and cfg.packing is True and cfg.max_steps == 3
    assert cfg.model_overrides == {"num_hidden_layers": 2}  # a dict field is not a section


def test_key_set_twice_across_sections(tmp_path):
    path = _yaml(tmp_path, "max_steps: 5\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml:3: key 'max_steps' is set twice.*cfg.yaml:1"):
        load_config(path, [])


def test_unknown_key_in_file_suggests_and_names_file_line(tmp_path):
    path = _yaml(tmp_path, "max_steps: 5\nlearnig_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [])
    msg = str(e.value)
    assert "did you mean 'learning_rate'?" in msg and f"{path}:2" in msg and "\n" not in msg


def test_unknown_key_on_command_line_suggests(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["per_device_train_batchsize=4"])
    assert "did you mean 'per_device_train_batch_size'?" in str(e.value)
    assert "command line" in str(e.value)


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="'max_steps' .* is not key=value"):
        load_config(None, ["max_steps"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("max_steps=ten", "max_steps must be an integer"),
        ("max_steps=1.5", "max_steps must be an integer"),
        ("learning_rate=fast", "learning_rate must be a number"),
        ("packing=yes", "packing must be true or false"),
        ("output_dir=null", "output_dir must be a string"),
        ("model_overrides=3", "model_overrides must be a mapping"),
        ("max_seq_len.x=1", "max_seq_len is not a mapping"),
    ],
)
def test_wrong_type_names_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_wrong_type_in_file_names_file_line(tmp_path):
    path = _yaml(tmp_path, "seed: 1\nbf16: maybe\n")
    with pytest.raises(ConfigError, match=rf"bf16 must be true or false \({path}:2\)"):
        load_config(path, [])


def test_lenient_spellings():
    cfg = load_config(None, ["packing=TRUE", "bf16=0", "resume_from_checkpoint=null", "output_dir=123"])
    assert cfg.packing is True and cfg.bf16 is False
    assert cfg.resume_from_checkpoint is None
    assert cfg.output_dir == "123"  # str fields keep the command-line text verbatim


def test_malformed_yaml_names_file_line_column(tmp_path):
    path = _yaml(tmp_path, "max_steps: 5\nlearning_rate: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [])
    assert str(e.value).startswith(f"{path}:3:5: invalid YAML")


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_yaml(tmp_path, "- max_steps\n- 5\n"), [])


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(_yaml(tmp_path, "# nothing yet\n"), []) == TrainConfig()


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"), [])


def test_dotted_dict_override_merges_with_file(tmp_path):
    path = _yaml(tmp_path, "model_overrides:\n  hidden_size: 64\n  rope: {theta: 1}\n")
    cfg = load_config(path, ["model_overrides.num_hidden_layers=2", "model_overrides.rope.theta=1e4"])
    assert cfg.model_overrides == {"hidden_size": 64, "num_hidden_layers": 2, "rope": {"theta": 10000.0}}


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "learning_rate=3e-4",
            "adam_epsilon=1e-12",
            "stage=pretrain",
            "model_overrides.num_hidden_layers=2",
            "eval_dataset_path=a.jsonl,b.jsonl",
        ],
    )
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, str(out))
    assert load_config(str(out), []) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_validate_accepts_and_normalises(valid):
    cfg = validate(load_config(None, valid + ["stage=sft", "lr_scheduler_type=WSD", "fine_tuning=full"]))
    assert (cfg.stage, cfg.lr_scheduler_type, cfg.fine_tuning) == ("SFT", "wsd", "Full")
    assert cfg.logging_dir.endswith("vdl_log")
    assert validate(load_config(None, valid + ["stage=PT"])).stage == "pretrain"


@pytest.mark.parametrize(
    "override, key",
    [
        ("stage=KTO", "stage"),
        ("fine_tuning=QLoRA", "fine_tuning"),
        ("lora_peft_layout=sideways", "lora_peft_layout"),
        ("train_dataset_type=csv", "train_dataset_type"),
        ("truncation=drop", "truncation"),
        ("max_seq_len=4", "max_seq_len"),
        ("per_device_train_batch_size=0", "per_device_train_batch_size"),
        ("learning_rate=0", "learning_rate"),
        ("warmup_ratio=1.5", "warmup_ratio"),
        ("adam_beta2=1", "adam_beta2"),
        ("resume_from_checkpoint=/no/such/ckpt", "resume_from_checkpoint"),
        ("model_name_or_path=/no/such/model", "model_name_or_path"),
        ("eval_dataset_path=/no/such/eval.jsonl", "eval_dataset_path"),
    ],
)
def test_validate_rejects_naming_key(valid, override, key):
    with pytest.raises(ConfigError, match=key):
        validate(load_config(None, valid + [override]))


def test_missing_dataset_names_key_and_path(valid, tmp_path):
    extra = tmp_path / "missing.jsonl"
    cfg = load_config(None, valid + [f"train_dataset_path={valid[0].split('=')[1]},{extra}"])
    with pytest.raises(ConfigError, match=r"train_dataset_path: file not found: .*missing.jsonl"):
        validate(cfg)


def test_model_dir_needs_config_json(valid, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model_name_or_path: .* has no config.json"):
        validate(load_config(None, valid + [f"model_name_or_path={tmp_path / 'empty'}"]))


def test_no_training_length(valid):
    with pytest.raises(ConfigError, match="max_steps=-1 and num_train_epochs=0.0"):
        validate(load_config(None, valid + ["num_train_epochs=0"]))
    assert validate(load_config(None, valid + ["num_train_epochs=0", "max_steps=5"])).max_steps == 5


def test_bf16_and_fp16_together(valid):
    with pytest.raises(ConfigError, match="bf16=true and fp16=true"):
        validate(load_config(None, valid + ["bf16=true", "fp16=true"]))


def test_bf16_rejected_on_cpu_build(valid):
    pytest.importorskip("paddle")
    from erniekit.utils.device import cuda_visible

    if cuda_visible():
        pytest.skip("a GPU is present, bf16 is allowed")
    with pytest.raises(ConfigError, match="bf16=true needs a CUDA GPU.*float32.*set bf16=false"):
        validate(load_config(None, valid + ["bf16=true"]))


def test_builtin_preset_is_a_valid_model(valid):
    configuration = pytest.importorskip("erniekit.models.ernie4_5.configuration")
    name = next(iter(configuration.PRESETS))
    assert validate(load_config(None, valid + [f"model_name_or_path={name}"])).model_name_or_path == name
    with pytest.raises(ConfigError, match="neither a directory nor a preset"):
        validate(load_config(None, valid + ["model_name_or_path=no-such-preset"]))


@pytest.mark.parametrize(
    "override, key, want",
    [
        ("pipeline_stage_layers=3", "pipeline_stage_layers", [3]),  # a scalar is a list of one
        ("cross_cluster_sizes=2", "cross_cluster_sizes", [2]),
        ("reward_funcs=accuracy,format", "reward_funcs", ["accuracy", "format"]),
        ("reward_weights=[1, 0.5]", "reward_weights", [1.0, 0.5]),
    ],
)
def test_list_keys_take_a_list_a_scalar_or_commas(override, key, want):
    assert getattr(load_config(None, [override]), key) == want


@pytest.mark.parametrize("override", ["pipeline_stage_layers=[a,b]", "stop_token_ids=[1.5]", "elastic_depth=x"])
def test_a_list_key_of_the_wrong_kind_is_a_type_error_not_a_traceback(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} must be a list of integers such as \[2, 4\] \(command line\)"):
        load_config(None, [override])


def test_string_overrides_lose_their_quotes_and_blanks_the_rest_as_typed():
    cfg = load_config(None, ["output_dir='/tmp/a b'", 'stage= "SFT" ', "model_name_or_path= tiny-moe "])
    assert (cfg.output_dir, cfg.stage, cfg.model_name_or_path) == ("/tmp/a b", "SFT", "tiny-moe")
    cfg = load_config(None, ['lora_target_modules=".*\\.q_proj"', 'output_dir="C:\\new"'])  # no escapes read
    assert (cfg.lora_target_modules, cfg.output_dir) == (".*\\.q_proj", "C:\\new")


def test_a_misspelled_mapping_key_is_named_not_read_as_a_section(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown config key 'model_overides' \(.*cfg.yaml:2\); did you mean 'model_overrides'"
    ):
        load_config(_yaml(tmp_path, "max_steps: 3\nmodel_overides:\n  num_hidden_layers: 2\n"), [])
    with pytest.raises(ConfigError, match=r"unknown section 'dtaa' \(.*cfg.yaml:1\); did you mean 'data'\?"):
        load_config(_yaml(tmp_path, "dtaa:\n  max_seq_len: 64\n"), [])


@pytest.mark.parametrize(
    "key, hint",
    [
        ("cutoff_len", "erniekit's key is max_seq_len"),
        ("dataset", "erniekit's key is train_dataset_path"),
        ("gradient_checkpointing", "erniekit's key is recompute"),
        ("lora", "write fine_tuning=LoRA"),
        ("overwrite_output_dir", "erniekit never overwrites an earlier run"),
    ],
)
def test_other_toolkits_names_point_at_ours(key, hint):
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}' \(command line\); {hint}"):
        load_config(None, [f"{key}=1"])


def test_lora_settings_without_lora_are_refused(valid):
    for override in ("lora_rank=4", "use_dora=true", "rslora=true"):
        with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]}=.* is a LoRA setting, but fine_tuning=Full"):
            validate(load_config(None, [*valid, override]))
    validate(load_config(None, [*valid, "fine_tuning=LoRA", "lora_rank=4"]))


def test_lora_on_a_preset_warns_that_the_base_is_not_kept(valid, capsys, monkeypatch):
    from erniekit.config import checks

    monkeypatch.setattr(checks, "_warned", set())  # once per process: another test may have said it
    validate(load_config(None, [*valid, "fine_tuning=LoRA", "model_name_or_path=tiny-moe"]))
    err = capsys.readouterr().err
    assert "WARNING: fine_tuning=LoRA on the preset tiny-moe: the base weights are random and not saved" in err


def test_a_lora_adapter_as_the_model_or_the_teacher_says_to_merge_it(valid, tmp_path):
    """A LoRA run's output has a config.json but no whole model: it failed with "no model.safetensors"."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "config.json").write_text("{}")
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"model_name_or_path: .*adapter is a LoRA adapter .*merge it first \(erniekit export"
    ):
        validate(load_config(None, [*valid, f"model_name_or_path={adapter}"]))
    with pytest.raises(ConfigError, match=r"teacher_name_or_path: .*adapter is a LoRA adapter"):
        validate(load_config(None, [*valid, "stage=Distill", f"teacher_name_or_path={adapter}"]))


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["beta=0.5"], r"beta=0.5 applies to stage DPO, not stage SFT"),
        (["loss_type=ipo"], r"loss_type='ipo' applies to stage DPO"),
        (["num_generations=4"], r"num_generations=4 applies to the RL stages \(GRPO and PPO\), not stage SFT"),
        (["stage=DPO", "vf_coef=0.5"], r"vf_coef=0.5 applies to the RL stages .*not stage DPO"),
        (["distill_loss=jsd"], r"distill_loss='jsd' applies to stage Distill, not stage SFT"),
        (["stage=GRPO", "reward_funcs=[accuracy]", "vf_coef=0.5"], r"vf_coef=0.5 applies to stage PPO, not stage GRPO"),
        (["stage=PPO", "reward_funcs=[accuracy]", "scale_rewards=false"], r"scale_rewards=False applies to stage GRPO"),
        (["tokenized_path=/tmp/ids"], r"tokenized_path='/tmp/ids' applies to stage pretrain, not stage SFT"),
    ],
)
def test_another_stages_settings_are_refused_not_ignored(valid, overrides, said):
    """They changed nothing (an online-distillation run with distill_loss trained to the same digits)."""
    with pytest.raises(ConfigError, match=said):
        validate(load_config(None, [*valid, *overrides]))


def test_a_token_store_that_cannot_be_written_is_refused_before_the_model_loads(valid, tmp_path, monkeypatch):
    """tokenized_path's first run builds the store there: found out at validation, not after the
    model has loaded; a store already built there is only read, so it may sit on a read-only disk."""
    import tempfile

    pre = [*valid, "stage=pretrain", "train_dataset_type=text"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"tokenized_path=.*a-file is a file, not a directory"):
        validate(load_config(None, [*pre, f"tokenized_path={blocker / 'ids'}"]))
    store = tmp_path / "ids"
    (store / "train").mkdir(parents=True)
    (store / "train" / "store.json").write_text("{}")
    real = tempfile.mkdtemp

    def read_only(*args, dir=None, **kw):
        if dir is not None and str(dir).startswith(str(store)):
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    validate(load_config(None, [*pre, f"tokenized_path={store}"]))
