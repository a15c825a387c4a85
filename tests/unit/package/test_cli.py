"""CLI: verb dispatch, one-line errors, and help/version surviving a broken install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from erniekit import __version__
from erniekit.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _run(args: list[str], blocked_dir: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m erniekit ARGS` in a fresh interpreter; blocked_dir shadows installed packages."""
    path = [str(blocked_dir)] if blocked_dir else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "erniekit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def broken_install(tmp_path) -> Path:
    """A directory whose `paddle` and `yaml` packages fail to import, as if not installed."""
    for name in ("paddle", "yaml"):
        pkg = tmp_path / "blocked" / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
    return tmp_path / "blocked"


@pytest.mark.parametrize("verb", ["version", "help", "--help"])
def test_version_and_help_in_subprocess(verb):
    proc = _run([verb])
    assert proc.returncode == 0, proc.stderr
    if verb == "version":
        assert proc.stdout.strip().startswith(f"erniekit {__version__}, paddlepaddle ")
        assert "not installed" not in proc.stdout
    else:
        assert "train" in proc.stdout and "chat" in proc.stdout


def test_help_and_version_without_paddle_or_yaml(broken_install):
    proc = _run(["version"], broken_install)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"erniekit {__version__}, paddlepaddle not installed"
    for args, expected in (
        (["help"], "commands:"),
        (["help", "train"], "learning_rate="),
        (["help", "chat"], "--max-new-tokens"),
        # every verb's own options (export, plan, server and webui printed only their summary line)
        (["help", "export"], "--max-shard-size"),
        (["help", "plan"], "--top"),
        (["help", "server"], "--max-model-len"),
        (["help", "webui"], "--workdir"),
    ):
        proc = _run(args, broken_install)
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout


def test_help_train_lists_keys_with_help():
    proc = _run(["help", "train"])
    assert proc.returncode == 0
    assert "learning_rate=0.0003" in proc.stdout and "peak learning rate" in proc.stdout


def test_train_without_yaml_is_a_one_line_error(broken_install, tmp_path):
    (tmp_path / "cfg.yaml").write_text("max_steps: 1\n")
    proc = _run(["train", "cfg.yaml"], broken_install, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: 'erniekit train' needs the Python package 'pyyaml', which is not installed; "
        "install it (pip install -r requirements.txt)"
    )


def test_train_missing_config_exits_2_one_line(tmp_path):
    proc = _run(["train", "missing.yaml"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config file not found: missing.yaml; check the path"
    assert "Traceback" not in proc.stderr


def test_train_bad_key_exits_2(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("max_step: 1\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'max_step'") and "did you mean 'max_steps'?" in err
    assert err.count("\n") == 1


def test_unknown_verb_suggests(capsys):
    assert main(["trian"]) == 2
    assert "did you mean 'train'?" in capsys.readouterr().err


def test_version_refuses_arguments_and_a_non_checkpoint_is_named_as_such(tmp_path, capsys):
    assert main(["version", "--bogus"]) == 2
    assert "erniekit version takes no arguments" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err  # not 'model_name_or_path', a train key


def test_train_without_config_exits_2(capsys):
    assert main(["train"]) == 2
    assert "usage: erniekit train CONFIG.yaml" in capsys.readouterr().err


@pytest.fixture
def fake_runner(monkeypatch):
    """Stand-in for erniekit.train.run that records the config it is given."""
    seen = []
    module = types.ModuleType("erniekit.train.run")
    module.run_train = seen.append
    module.StoppedBeforeFirstStep = type("StoppedBeforeFirstStep", (Exception,), {})  # what start.py catches
    monkeypatch.setitem(sys.modules, "erniekit.train.run", module)
    return seen


def test_train_passes_validated_config_and_sets_threads(tmp_path, monkeypatch, fake_runner):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"src": ["1+1="], "tgt": ["2"]}) + "\n")
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"stage: sft\nmax_steps: 100\ntrain_dataset_path: {data}\nmodel_name_or_path: {model}\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    assert main(["train", str(cfg), "max_steps=10", f"output_dir={tmp_path / 'out'}"]) == 0
    (run_cfg,) = fake_runner
    assert run_cfg.max_steps == 10 and run_cfg.stage == "SFT"  # override applied, stage normalised
    assert run_cfg.logging_dir == os.path.join(str(tmp_path / "out"), "vdl_log")
    assert os.environ["OMP_NUM_THREADS"] == str(os.cpu_count())


def test_train_validation_error_does_not_reach_runner(tmp_path, capsys, fake_runner):
    assert main(["train", "max_steps=1", f"train_dataset_path={tmp_path / 'none.jsonl'}"]) == 2
    assert "train_dataset_path: file not found" in capsys.readouterr().err
    assert fake_runner == []


@pytest.fixture
def fake_chat(monkeypatch):
    seen = []
    module = types.ModuleType("erniekit.infer.chat")
    module.run_chat = seen.append
    monkeypatch.setitem(sys.modules, "erniekit.infer.chat", module)
    return seen


def test_chat_arguments(fake_chat):
    assert main(["chat", "ckpt", "--prompt", "1+1=", "--top-p", "0.9"]) == 0
    (args,) = fake_chat
    assert (args.model_dir, args.prompt, args.top_p) == ("ckpt", "1+1=", 0.9)
    assert (args.max_new_tokens, args.temperature, args.system, args.seed) == (256, 0.0, None, None)


def test_chat_rejects_bad_sampling(fake_chat, capsys):
    assert main(["chat", "ckpt", "--top-p", "1.5"]) == 2
    assert "top_p=1.5 must be in (0, 1]" in capsys.readouterr().err
    assert main(["chat"]) == 2  # argparse: model_dir missing
    assert fake_chat == []


def test_erniekit_warnings_print_as_one_line_and_other_packages_keep_pythons_format(monkeypatch, capsys):
    """A data note (a rebuilt token store, truncated conversations) printed `file:line: UserWarning:`
    and then the source line that raised it."""
    import os
    import warnings

    import erniekit.cli as cli

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    cli.main(["version"])
    capsys.readouterr()
    ours = os.path.join(os.sep, "x", "erniekit", "data", "encode.py")
    got = warnings.formatwarning("3 of 9 conversations truncated", UserWarning, ours, 5, "warnings.warn(...)")
    assert got == "WARNING: 3 of 9 conversations truncated\n"
    theirs = warnings.formatwarning("old API", DeprecationWarning, "/x/paddle/a.py", 5, "code")
    assert "DeprecationWarning: old API" in theirs and theirs.count("\n") == 2


def test_paddles_ccache_warning_is_dropped_and_other_warnings_still_show(tmp_path):
    """Paddle warns "No ccache found" on every import when ccache is not on PATH (here: PATH is an
    empty directory, so it would); the CLI drops that one warning, not the others."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=str(tmp_path))
    run = lambda code: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    bare = run("import paddle")
    assert "No ccache found" in bare.stderr, bare.stderr[-2000:]  # the warning the CLI must drop
    cli = run(
        "import sys, warnings\n"
        "from erniekit.cli import main\n"
        "rc = main(['help', 'train'])\n"
        "assert 'paddle' in sys.modules, 'help train no longer imports paddle: pick a verb that does'\n"
        "warnings.warn('No ccache found. (not paddle: still shown)')\n"
        "sys.exit(rc)\n"
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "No ccache found. Please" not in cli.stderr, cli.stderr[-2000:]
    assert "UserWarning: No ccache found. (not paddle: still shown)" in cli.stderr, cli.stderr[-2000:]
