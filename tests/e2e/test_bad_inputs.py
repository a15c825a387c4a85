"""Bad-input corpus (issue #23): bad config, data, checkpoints and CLI flags each end in exit code
2 with exactly one line on stderr that names the file or key, and no traceback anywhere.

Most cases call `erniekit.cli.main` in this process (capfd sees the file descriptors, so Paddle's
own C++ output would count too); a handful run `python -m erniekit` to prove the same holds for a
real process, where Python warnings are not swallowed by pytest. The server's HTTP cases live in
tests/e2e/test_server.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from erniekit.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOOD_SFT = [{"src": ["1+1="], "tgt": ["2"]}, {"src": ["2+2="], "tgt": ["4"]}]
GOOD_DPO = {"src": ["1+1="], "tgt": [], "response": [["2"], ["3"]], "sort": [1, 0]}


def _assert_one_line_error(rc: int, out: str, err: str, must: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit {rc}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in out + err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert must in lines[0], lines[0]


@pytest.fixture
def run_cli(capfd):
    """main(args) in-process; asserts the one-line error naming `must`; returns the line."""

    def run(args: list[str], must: str) -> str:
        capfd.readouterr()
        rc = main([str(a) for a in args])
        out, err = capfd.readouterr()
        _assert_one_line_error(rc, out, err, must)
        return err.strip()

    return run


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _train_args(tmp_path: Path, *extra: str, data: Path | None = None) -> list[str]:
    """A 1-step run of a tiny model, so a case reaches exactly as far as its bad input allows."""
    data = data or _jsonl(tmp_path / "good.jsonl", GOOD_SFT)
    return [
        "train",
        f"output_dir={tmp_path / 'out'}",
        "model_name_or_path=tiny-dense",
        f"train_dataset_path={data}",
        "max_steps=1",
        "do_eval=false",
        "disable_tqdm=true",
        "max_seq_len=64",
        "per_device_train_batch_size=2",
        "learning_rate=1e-3",
        "warmup_steps=0",
        "logging_steps=1",
        *extra,
    ]


# ------------------------------------------------------------------------------------------ config
CONFIG_CASES = [
    ("lerning_rate=1e-3", "unknown config key 'lerning_rate'"),
    ("max_steps=abc", "max_steps must be an integer"),
    ("learning_rate=fast", "learning_rate must be a number"),
    ("packing=maybe", "packing must be true or false"),
    ("model_overrides=5", "model_overrides must be a mapping"),
    ("learning_rate=1e6", "learning_rate=1000000.0 is invalid"),
    ("learning_rate=1.5", "learning_rate=1.5 is invalid"),
    ("learning_rate=0", "learning_rate=0.0 is invalid"),
    ("learning_rate=-1e-3", "learning_rate=-0.001 is invalid"),
    ("max_steps=0", "max_steps=0 is invalid"),
    ("max_steps=-2", "max_steps=-2 is invalid"),
    ("max_steps=-1 num_train_epochs=-1", "num_train_epochs=-1.0 is invalid"),
    ("max_steps=-1 num_train_epochs=0", "max_steps=-1 and num_train_epochs=0.0"),
    ("per_device_train_batch_size=-4", "per_device_train_batch_size=-4"),
    ("per_device_eval_batch_size=0", "per_device_eval_batch_size=0"),
    ("gradient_accumulation_steps=0", "gradient_accumulation_steps=0"),
    ("max_seq_len=-1", "max_seq_len=-1"),
    ("warmup_ratio=1.5", "warmup_ratio=1.5"),
    ("warmup_ratio=-0.1", "warmup_ratio=-0.1"),
    ("decay_ratio=2", "decay_ratio=2.0"),
    ("adam_beta1=1.0", "adam_beta1=1.0"),
    ("adam_epsilon=0", "adam_epsilon=0.0"),
    ("weight_decay=-0.1", "weight_decay=-0.1"),
    ("weight_decay=2000", "weight_decay=2000.0"),
    ("max_grad_norm=-1", "max_grad_norm=-1.0"),
    ("lora_rank=0", "lora_rank=0"),
    ("lora_dropout=1.0", "lora_dropout=1.0"),
    ("lora_alpha=-1", "lora_alpha=-1.0"),
    ("seed=-1", "seed=-1"),
    ("seed=99999999999", "seed=99999999999"),
    ("stage=KTO", "stage='KTO'"),
    ("fine_tuning=QLoRA", "fine_tuning='QLoRA'"),
    ("lr_scheduler_type=exp", "lr_scheduler_type='exp'"),
    ("save_steps=0", "save_steps=0"),
    ("logging_steps=-1", "logging_steps=-1"),
    ("save_total_limit=-1", "save_total_limit=-1"),
    ("ema_decay=1.0", "ema_decay=1.0"),
    ("label_smoothing=0.7", "label_smoothing=0.7"),
    ("stop_token_ids=[-1]", "stop_token_ids=[-1]"),
    ("stage=GRPO temperature=0", "temperature=0.0"),
    ("stage=GRPO reward_weights=[1,abc]", "reward_weights="),
    ("model_name_or_path=/no/such/model", "model_name_or_path"),
    ("resume_from_checkpoint=/no/such/ckpt", "resume_from_checkpoint"),
    ("output_dir=/proc/erniekit-out", "output_dir=/proc/erniekit-out"),
    ("logging_dir=/proc/erniekit-logs", "logging_dir=/proc/erniekit-logs"),
    ("model_overrides.hidden_size=-4", "model_overrides: hidden_size=-4"),
    ("model_overrides.num_key_value_heads=0", "model_overrides: num_key_value_heads=0"),
]


@pytest.mark.parametrize("override, must", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_setting(run_cli, tmp_path, override, must):
    run_cli(_train_args(tmp_path, *override.split()), must)


def test_output_dir_under_a_regular_file(run_cli, tmp_path):
    (tmp_path / "afile").write_text("x")
    run_cli(_train_args(tmp_path, f"output_dir={tmp_path / 'afile' / 'run'}"), f"{tmp_path / 'afile'} is a file")


def test_output_dir_in_a_read_only_directory(run_cli, tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root writes into a 0555 directory; nobody creates files in /proc
        if not os.path.isdir("/proc"):
            pytest.skip("running as root without /proc: no directory root cannot write into")
        run_cli(_train_args(tmp_path, "output_dir=/proc/erniekit-run"), "cannot create files in /proc")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        run_cli(_train_args(tmp_path, f"output_dir={ro / 'run'}"), f"cannot create files in {ro}")
    finally:
        ro.chmod(0o755)


def test_missing_dataset_file(run_cli, tmp_path):
    run_cli(
        _train_args(tmp_path, f"train_dataset_path={tmp_path / 'nope.jsonl'}"), "train_dataset_path: file not found"
    )


YAML_CASES = [
    ("adam_epsilon: .nan\n", "adam_epsilon=nan is invalid: it must be a finite number"),
    ("weight_decay: .inf\n", "weight_decay=inf is invalid"),
    ("max_steps: [1, 2\n", "cfg.yaml:2:1: invalid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("max_steps: 3\nmax_steps: 4\n", "key 'max_steps' is set twice"),
    ("max_stpes: 3\n", "did you mean 'max_steps'"),
]


@pytest.mark.parametrize("text, must", YAML_CASES, ids=["nan", "inf", "syntax", "list", "twice", "typo"])
def test_bad_yaml(run_cli, tmp_path, text, must):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    args = _train_args(tmp_path)
    run_cli([args[0], cfg, *args[1:]], must)


def test_yaml_not_utf8(run_cli, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(b"learning_rate: 1e-3\n# caf\xe9\n")
    run_cli(["train", cfg], f"cannot read config file {cfg}")


def test_missing_config_file(run_cli, tmp_path):
    run_cli(["train", tmp_path / "missing.yaml"], "config file not found")


# -------------------------------------------------------------------------------------------- data
DATA_CASES = [
    ("bad-json", ['{"src": ["a"], "tgt": ["b"]}', '{"src": ["a"], "tgt": '], ":2: invalid JSON"),
    ("missing-tgt", [{"src": ["a"]}], ":1: field 'tgt' missing"),
    ("src-not-text", [{"src": 5, "tgt": ["b"]}], ":1: field 'src' must be a non-empty list of strings"),
    ("turns-mismatch", [{"src": ["a", "b"], "tgt": ["c"]}], ":1: 'src' has 2 turns but 'tgt' has 1"),
    ("bad-label", [{"src": ["a"], "tgt": ["b"], "label": [2]}], ":1: field 'label'"),
    ("not-object", ["[1, 2]"], ":1: cannot tell the data format from keys int"),
    ("string-record", ['"just text"'], ":1: cannot tell the data format from keys str"),
    ("unknown-keys", [{"question": "a", "answer": "b"}], ":1: cannot tell the data format"),
    ("messages-roles", [{"messages": [{"role": "assistant", "content": "x"}]}], ":1: field 'messages' roles"),
    ("messages-role-name", [{"messages": [{"role": "bot", "content": "x"}]}], ":1: field 'messages[0]'"),
    ("alpaca-history", [{"instruction": "a", "output": "b", "history": [["q"]]}], ":1: field 'history'"),
    ("alpaca-output-type", [{"instruction": "a", "output": 3}], ":1: field 'output' must be a string"),
    ("blank-only", ["", "   "], "no examples; the file is empty"),
]


@pytest.mark.parametrize("name, rows, must", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_sft_data(run_cli, tmp_path, name, rows, must):
    data = _jsonl(tmp_path / f"{name}.jsonl", rows)
    run_cli(_train_args(tmp_path, data=data), f"{data}{must}" if must.startswith(":") else must)


def test_empty_data_file(run_cli, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    run_cli(_train_args(tmp_path, data=data), f"{data}: no examples")


def test_data_path_is_a_directory(run_cli, tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    run_cli(_train_args(tmp_path, data=tmp_path / "dir.jsonl"), "is a directory, not a file")


def test_non_utf8_sft_data_names_line_and_byte(run_cli, tmp_path):
    data = tmp_path / "latin1.jsonl"
    good = json.dumps(GOOD_SFT[0]).encode() + b"\n"
    data.write_bytes(good + b'{"src": ["caf\xe9"], "tgt": ["b"]}\n')
    line = run_cli(_train_args(tmp_path, data=data), f"{data}:2: not UTF-8")
    assert f"byte 0xe9 at byte offset {len(good) + 13}" in line


def test_non_utf8_pretrain_text(run_cli, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"one document\n\xff\xfe two\n")
    run_cli(_train_args(tmp_path, "stage=pretrain", data=data), f"{data}:2: not UTF-8")


def test_pretrain_jsonl_without_text(run_cli, tmp_path):
    data = _jsonl(tmp_path / "pt.jsonl", [{"content": "x"}])
    run_cli(_train_args(tmp_path, "stage=pretrain", data=data), f"{data}:1: field 'text' missing")


DPO_CASES = [
    ("no-response", {"src": ["a"], "tgt": [], "sort": [1, 0]}, ":1: field 'response'"),
    ("one-response", {**GOOD_DPO, "response": [["2"]]}, ":1: field 'response'"),
    ("bad-sort", {**GOOD_DPO, "sort": [1, 1]}, ":1:"),
    ("no-rejected", {"prompt": "a", "chosen": "b"}, ":1: field 'rejected' missing"),
]


@pytest.mark.parametrize("name, row, must", DPO_CASES, ids=[c[0] for c in DPO_CASES])
def test_bad_dpo_data(run_cli, tmp_path, name, row, must):
    data = _jsonl(tmp_path / f"{name}.jsonl", [row])
    run_cli(_train_args(tmp_path, "stage=DPO", data=data), f"{data}{must}")


# ------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> Path:
    """A real tiny-dense checkpoint (config, weights, tokenizer) for the cases to damage."""
    from erniekit.cli import _import_paddle

    _import_paddle()
    from erniekit.models.ernie4_5.checkpoint import save_pretrained
    from erniekit.models.ernie4_5.configuration import PRESETS
    from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    path = tmp_path_factory.mktemp("ckpt") / "good"
    save_pretrained(Ernie4_5ForCausalLM(PRESETS["tiny-dense"]), str(path), tokenizer=default_tokenizer())
    return path


def _damaged(good: Path, tmp_path: Path, how) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    how(path)
    return path


def _edit_config(**changes):
    def how(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))

    return how


def _edit_tensors(edit):
    def how(path: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors, next(k for k in tensors if k.endswith("q_proj.weight")))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    return how


def _write(name: str, data: bytes | str):
    def how(path: Path) -> None:
        (path / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return how


def _truncate(path: Path) -> None:
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _to_shards(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(path / "model-00001-of-00002.safetensors"), "numpy") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"  # a shard that is not there
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CKPT_CASES = [
    ("no-config", lambda p: (p / "config.json").unlink(), "has no config.json"),
    ("config-bad-json", _write("config.json", '{"hidden_size": 64,'), "config.json:1: invalid JSON"),
    ("config-list", _write("config.json", "[1, 2]"), "config.json: expected a JSON object"),
    ("config-negative-size", _edit_config(hidden_size=-4), "config.json: hidden_size=-4 is invalid"),
    ("config-text-size", _edit_config(intermediate_size="big"), "config.json: intermediate_size='big'"),
    ("config-zero-kv-heads", _edit_config(num_key_value_heads=0), "config.json: num_key_value_heads=0"),
    ("config-other-model", _edit_config(model_type="llama"), "model_type='llama'"),
    ("config-activation", _edit_config(hidden_act="gelu"), "hidden_act='gelu'"),
    ("config-rope", _edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type='yarn'"),
    ("no-weights", lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    ("pickle-only", lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin"), "convert it to safetensors"),
    ("truncated", _truncate, "model.safetensors: not a readable safetensors file"),
    ("random-bytes", _write("model.safetensors", os.urandom(4096)), "model.safetensors: not a readable safetensors"),
    ("empty-file", _write("model.safetensors", b""), "model.safetensors: not a readable safetensors file"),
    ("wrong-shape", _edit_tensors(lambda t, k: t.__setitem__(k, t[k][:, :3].copy())), "has shape [128, 3]"),
    ("wrong-dtype", _edit_tensors(lambda t, k: t.__setitem__(k, t[k].astype("int32"))), "is stored as I32"),
    ("missing-tensor", _edit_tensors(lambda t, k: t.pop(k)), "is missing from the checkpoint"),
    ("index-bad-json", _write("model.safetensors.index.json", "{"), "model.safetensors.index.json:1: invalid JSON"),
    ("index-missing-shard", _to_shards, "model-00002-of-00002.safetensors: shard listed"),
]


@pytest.mark.parametrize("name, how, must", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_bad_checkpoint_for_training(run_cli, tmp_path, good_ckpt, name, how, must):
    ckpt = _damaged(good_ckpt, tmp_path, how)
    run_cli(_train_args(tmp_path, f"model_name_or_path={ckpt}"), must)


@pytest.mark.parametrize("verb", ["chat", "export"])
def test_truncated_checkpoint_for_chat_and_export(run_cli, tmp_path, good_ckpt, verb):
    ckpt = _damaged(good_ckpt, tmp_path, _truncate)
    args = [ckpt, "--prompt", "hi"] if verb == "chat" else [ckpt, "-o", tmp_path / "exported"]
    run_cli([verb, *args], "model.safetensors: not a readable safetensors file")
    assert not (tmp_path / "exported").exists()


def test_resume_from_a_checkpoint_without_trainer_state(run_cli, tmp_path, good_ckpt):
    run_cli(_train_args(tmp_path, f"resume_from_checkpoint={good_ckpt}"), "no trainer_state.json")


def _training_checkpoint(good: Path, tmp_path: Path, state: str, optimizer: bytes | None) -> Path:
    ckpt = _damaged(good, tmp_path, _write("trainer_state.json", state))
    if optimizer is not None:
        (ckpt / "optimizer.safetensors").write_bytes(optimizer)
    return ckpt


@pytest.mark.parametrize(
    "state, optimizer, must",
    [
        ('{"global_step": 1', None, "trainer_state.json:1: invalid JSON"),
        ('{"global_step": 1, "consumed_micro_batches": 1}', os.urandom(512), "optimizer.safetensors: not a readable"),
        ('{"global_step": 1}', None, "consumed_micro_batches is None, not a step count"),
    ],
    ids=["bad-trainer-state", "random-optimizer-state", "another-trainers-state"],
)
def test_resume_from_a_damaged_training_checkpoint(run_cli, tmp_path, good_ckpt, state, optimizer, must):
    ckpt = _training_checkpoint(good_ckpt, tmp_path, state, optimizer)
    run_cli(_train_args(tmp_path, f"model_name_or_path={good_ckpt}", f"resume_from_checkpoint={ckpt}"), must)


def test_chat_on_a_directory_without_tokenizer(run_cli, tmp_path, good_ckpt):
    ckpt = _damaged(good_ckpt, tmp_path, lambda p: (p / "tokenizer.model").unlink())
    run_cli(["chat", ckpt, "--prompt", "hi"], "no tokenizer files (tokenizer.model)")


@pytest.mark.parametrize(
    "adapter, weights, must",
    [
        ({"base_model_name_or_path": "/no/such/base"}, b"", "base_model_name_or_path='/no/such/base'"),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
            os.urandom(256),
            "adapter_model.safetensors: not a readable safetensors file",
        ),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}, b"", "peft_type='IA3'"),
    ],
    ids=["missing-base", "random-adapter-weights", "other-peft-type"],
)
def test_bad_lora_adapter_for_chat(run_cli, tmp_path, good_ckpt, adapter, weights, must):
    path = tmp_path / "adapter"
    path.mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):  # as save_adapter does
        shutil.copy(good_ckpt / name, path / name)
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(good_ckpt), **adapter}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    run_cli(["chat", path, "--prompt", "hi"], must)


# --------------------------------------------------------------------------------------- CLI flags
def _cli_cases(tmp: Path, good: Path) -> list[tuple[str, list, str]]:
    full = tmp / "full"
    return [
        ("unknown-verb", ["trian"], "unknown command 'trian'; did you mean 'train'?"),
        ("export-no-output", ["export", good], "export needs SRC and --output OUT"),
        ("export-nonempty", ["export", good, "-o", full], f"--output {full} is not empty"),
        ("export-into-file", ["export", good, "-o", tmp / "afile"], "is a file, not a directory"),
        ("export-missing-src", ["export", tmp / "nope", "-o", tmp / "o"], f"source {tmp / 'nope'} is not a directory"),
        ("export-own-source", ["export", good, "-o", good], "is the source directory"),
        ("export-format", ["export", good, "-o", tmp / "o", "--format", "ggml"], "argument --format: invalid choice"),
        (
            "export-group-size",
            ["export", good, "-o", tmp / "o", "--format", "wint4", "--group-size", "3"],
            "--group-size 3",
        ),
        ("export-unknown-flag", ["export", good, "-o", tmp / "o", "--fast"], "unrecognized arguments: --fast"),
        ("export-elastic", ["export", good, "-o", tmp / "o", "elastic.width=2"], "elastic.width"),
        ("export-verify", ["export", "--verify", good], "no export_info.json"),
        ("chat-no-dir", ["chat"], "the following arguments are required: model_dir"),
        ("chat-temperature", ["chat", good, "--temperature", "-1"], "temperature"),
        ("chat-top-p", ["chat", good, "--top-p", "2"], "top_p"),
        ("chat-not-a-number", ["chat", good, "--max-new-tokens", "many"], "argument --max-new-tokens"),
        ("chat-unknown-flag", ["chat", good, "--beam", "4"], "unrecognized arguments: --beam 4"),
        (
            "eval-no-report",
            ["eval", good],
            "one of the arguments --routing --elastic --lm-eval --credibility is required",
        ),
        ("eval-depths", ["eval", good, "--elastic", "--depths", "a,b"], "argument --depths"),
        ("eval-batch", ["eval", good, "--routing", "--batch-size", "0"], "--batch-size 0"),
        ("plan-no-cluster", ["plan", "max_steps=1"], "plan needs cluster=FILE"),
        ("plan-top", ["plan", "--top", "x"], "argument --top: invalid int value"),
        ("plan-mode", ["plan", "--mode", "mesh"], "argument --mode: invalid choice"),
        ("train-override", ["train", "max_steps=1", "oops"], "override 'oops' (command line) is not key=value"),
        ("train-no-args", ["train"], "train needs a config file"),
        (
            "train-dash-flag",
            ["train", "--max-steps", "5"],
            "train: --max-steps is not an option; settings are key=value, e.g. max_steps=VALUE",
        ),
        ("server-port", ["server", good, "--port", "99999"], "--port 99999"),
        ("webui-port", ["webui", "--port", "x"], "argument --port: invalid int value"),
        ("help-unknown", ["help", "trainn"], "unknown command 'trainn'"),
    ]


CLI_IDS = [c[0] for c in _cli_cases(Path("/nonexistent"), Path("/nonexistent"))]


@pytest.mark.parametrize("case", CLI_IDS)
def test_bad_cli_flags(run_cli, tmp_path, good_ckpt, case):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("not mine")
    (tmp_path / "afile").write_text("x")
    ((_, args, must),) = [c for c in _cli_cases(tmp_path, good_ckpt) if c[0] == case]
    run_cli(args, must)
    assert (tmp_path / "full" / "keep.txt").read_text() == "not mine" and len(os.listdir(tmp_path / "full")) == 1


# ----------------------------------------------------------------------- the same, as real processes
def _subprocess(args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "erniekit", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_real_processes_print_one_line_too(tmp_path, good_ckpt):
    """Python warnings and Paddle's own output reach stderr here; still exactly one line each."""
    bad_data = tmp_path / "latin1.jsonl"
    bad_data.write_bytes(b'{"src": ["caf\xe9"], "tgt": ["b"]}\n')
    truncated = _damaged(good_ckpt, tmp_path, _truncate)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    cases = [
        (["trian"], "unknown command 'trian'"),
        (_train_args(tmp_path, "learning_rate=1e6"), "learning_rate=1000000.0 is invalid"),
        (_train_args(tmp_path, data=bad_data), f"{bad_data}:1: not UTF-8"),
        (_train_args(tmp_path, f"model_name_or_path={truncated}"), "model.safetensors: not a readable safetensors"),
        (["chat", truncated, "--prompt", "hi"], "model.safetensors: not a readable safetensors"),
        (["export", good_ckpt, "-o", full], f"--output {full} is not empty"),
        (["chat", good_ckpt, "--bogus"], "unrecognized arguments: --bogus"),
    ]
    for args, must in cases:
        r = _subprocess(args, tmp_path)
        _assert_one_line_error(r.returncode, r.stdout, r.stderr, must)
