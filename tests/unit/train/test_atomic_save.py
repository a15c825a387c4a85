"""Saves survive crashes and full disks (issue #23): killing the process at any point of a save
leaves a model that loads as the old one or the new one, and a disk that fills up during a
checkpoint leaves the last complete checkpoint as it was, no partial one that
`resume_from_checkpoint=auto` would pick, and one line that says how much was to be written where.

The kill test forks a child per filesystem step of the save (every rename, link, unlink, rmdir and
directory swap is counted) and SIGKILLs it just before step k, for k = 1, 2, ... until a save
finishes; after each kill the directory is loaded the way erniekit does and the way transformers
does (model.safetensors before the index).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

from erniekit.cli import _import_paddle, main

_import_paddle()
import paddle  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from erniekit.models.ernie4_5.checkpoint import (  # noqa: E402
    INDEX_NAME,
    WEIGHTS_NAME,
    from_pretrained,
    hf_state_dict,
    save_pretrained,
)
from erniekit.models.ernie4_5.configuration import PRESETS  # noqa: E402
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM  # noqa: E402
from erniekit.models.ernie4_5.tokenizer import default_tokenizer  # noqa: E402
from erniekit.train import checkpointing  # noqa: E402
from erniekit.utils import io as eio  # noqa: E402

# every call that changes what a directory holds; the child dies just before the k-th of them
_MUTATORS = [
    (os, "replace"),
    (os, "rename"),
    (os, "remove"),
    (os, "unlink"),
    (os, "link"),
    (os, "rmdir"),
    (eio, "_exchange"),
]


def _model(seed: int) -> Ernie4_5ForCausalLM:
    paddle.seed(seed)
    return Ernie4_5ForCausalLM(PRESETS["tiny-dense"])


def _numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in hf_state_dict(model).items()}


def _killed_at(k: int, save) -> bool:
    """Run save() in a forked child that SIGKILLs itself before its k-th filesystem step; True if it was killed."""
    pid = os.fork()
    if pid == 0:  # child: count steps, die at the k-th; never return into pytest
        count = [0]
        try:
            for mod, name in _MUTATORS:
                orig = getattr(mod, name)

                def step(*a, _orig=orig, **kw):
                    count[0] += 1
                    if count[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _orig(*a, **kw)

                setattr(mod, name, step)
            save()
        finally:
            os._exit(0 if count[0] < k else 3)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the save failed in the child (status {status})"
    return False


def _hf_rule_state(path: str) -> dict[str, np.ndarray]:
    """What transformers loads: model.safetensors if present, else the shards the index names."""
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(single):
        return load_file(single)
    index = json.load(open(os.path.join(path, INDEX_NAME)))["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        out.update(load_file(os.path.join(path, f)))
    return {k: out[k] for k in index}


def _which(state: dict[str, np.ndarray], old: dict, new: dict) -> str:
    for name, ref in (("old", old), ("new", new)):
        if state.keys() == ref.keys() and all(np.array_equal(state[k], ref[k]) for k in ref):
            return name
    return "neither"


@pytest.mark.parametrize(
    "old_shard, new_shard",
    [("5GB", "5GB"), (1_500_000, 1_500_000), ("5GB", 1_500_000), (1_500_000, "5GB")],
    ids=["single-over-single", "shards-over-same-shards", "shards-over-single", "single-over-shards"],
)
def test_kill_at_every_step_of_a_final_save_leaves_old_or_new(tmp_path, old_shard, new_shard):
    old_model, new_model = _model(1), _model(2)
    old, new = _numpy_state(old_model), _numpy_state(new_model)
    tok = default_tokenizer()
    pristine = tmp_path / "pristine"
    save_pretrained(old_model, str(pristine), tokenizer=tok, max_shard_size=old_shard)
    target = str(tmp_path / "out")
    seen, k = [], 1
    while True:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(pristine, target)
        killed = _killed_at(k, lambda: save_pretrained(new_model, target, tokenizer=tok, max_shard_size=new_shard))
        ours = _which(_numpy_state(from_pretrained(target)), old, new)
        theirs = _which(_hf_rule_state(target), old, new)
        assert ours != "neither" and theirs != "neither", f"killed before step {k}: {sorted(os.listdir(target))}"
        seen.append(ours)
        if not killed:
            break
        k += 1
    assert seen[0] == "old" and seen[-1] == "new" and k > 5  # the kills did land inside the save
    names = set(os.listdir(target))
    assert not any(n.startswith(".") for n in names), names  # no staging directory, no .prev- links
    shards = {n for n in names if n.startswith("model-")}
    if new_shard == "5GB":
        assert WEIGHTS_NAME in names and INDEX_NAME not in names and not shards, names
    else:
        assert (
            WEIGHTS_NAME not in names
            and set(json.load(open(os.path.join(target, INDEX_NAME)))["weight_map"].values()) == shards
        )


def test_kill_at_every_step_of_a_lora_final_save_leaves_old_or_new_adapter(tmp_path):
    """A LoRA run's final save over the previous run's adapter in the same output_dir."""
    from erniekit.models.registry import load_model_or_adapter
    from erniekit.nn.lora import LoraConfig, apply_lora

    tok = default_tokenizer()
    base = tmp_path / "base"
    save_pretrained(_model(0), str(base), tokenizer=tok)
    adapters = []
    for seed in (1, 2):
        m = _model(0)
        apply_lora(m, LoraConfig(r=2, lora_alpha=4.0))
        paddle.seed(seed)
        for p in m.parameters():
            if not p.stop_gradient:
                p.set_value(paddle.randn(p.shape, dtype=p.dtype) * 0.1)  # B != 0: the adapters change the model
        adapters.append(m)
    pristine = tmp_path / "pristine"
    checkpointing.save_model_or_adapter(adapters[0], str(pristine), tok, str(base))
    old, new = (_numpy_state(_merged(m)) for m in adapters)
    target = tmp_path / "out"
    k = 1
    while True:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(pristine, target)
        killed = _killed_at(k, lambda: checkpointing.save_model_or_adapter(adapters[1], str(target), tok, str(base)))
        got = _which(_numpy_state(load_model_or_adapter(str(target))), old, new)
        assert got != "neither", (k, sorted(os.listdir(target)))
        if not killed:
            break
        k += 1
    assert k > 3 and got == "new"


def _merged(model):
    """The model a LoRA directory loads as: a copy with the adapters merged."""
    import copy

    from erniekit.nn.lora import merge_and_unload

    return merge_and_unload(copy.deepcopy(model))


class _Opt:
    """The part of the optimizer a checkpoint save uses."""

    def __init__(self, step: int):
        self.step = step

    def state_dict(self):
        return {"__step__": paddle.to_tensor([self.step], dtype="int64")}


def test_kill_at_every_step_of_a_checkpoint_save_leaves_a_complete_checkpoint(tmp_path):
    """Re-saving checkpoint-4 over an older checkpoint-4 (a run resumed from before it) and a
    checkpoint-2 beside it: after any kill, `auto` resumes from a complete checkpoint that loads."""
    tok = default_tokenizer()
    old_model, new_model = _model(1), _model(2)
    old, new = _numpy_state(old_model), _numpy_state(new_model)
    pristine = tmp_path / "pristine"
    checkpointing.save_checkpoint(str(pristine / "checkpoint-2"), old_model, tok, _Opt(2), {"global_step": 2})
    checkpointing.save_checkpoint(str(pristine / "checkpoint-4"), old_model, tok, _Opt(4), {"global_step": 4})
    out = tmp_path / "out"
    k = 1
    while True:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)
        killed = _killed_at(
            k,
            lambda: checkpointing.save_checkpoint(
                str(out / "checkpoint-4"), new_model, tok, _Opt(4), {"global_step": 4, "new": True}
            ),
        )
        path = checkpointing.resolve_resume("auto", str(out))
        assert path == str(out / "checkpoint-4"), (k, sorted(os.listdir(out)))  # never missing, never partial
        state = json.load(open(os.path.join(path, checkpointing.STATE_NAME)))
        got = _which(_numpy_state(from_pretrained(path)), old, new)
        assert got == ("new" if state.get("new") else "old"), k  # weights and trainer state from one save
        if not killed:
            break
        k += 1
    assert k > 5 and got == "new"
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]


# ------------------------------------------------------------------------------------- full disk
def _train(tmp_path, out, *extra) -> tuple[int, str]:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"src": [f"{i}+1="], "tgt": [str(i + 1)]}) + "\n" for i in range(8)))
    rc = main(
        [
            "train",
            f"output_dir={out}",
            "model_name_or_path=tiny-dense",
            f"train_dataset_path={data}",
            "max_steps=4",
            "save_steps=2",
            "do_eval=false",
            "disable_tqdm=true",
            "max_seq_len=32",
            "per_device_train_batch_size=2",
            "learning_rate=1e-3",
            "warmup_steps=0",
            "logging_steps=1",
            *extra,
        ]
    )
    return rc


def _assert_disk_full_outcome(out, err: str, rc: int) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert f"checkpoint checkpoint-4 in {out}" in line and "MiB free" in line, line
    assert f"{out / 'checkpoint-2'} (the last complete checkpoint) is intact" in line, line
    assert [p for p in os.listdir(out) if p.startswith("checkpoint-")] == ["checkpoint-2"]  # no -4, no -4.tmp
    assert checkpointing.resolve_resume("auto", str(out)) == str(out / "checkpoint-2")
    from_pretrained(str(out / "checkpoint-2"))  # loads
    assert json.load(open(out / "checkpoint-2" / checkpointing.STATE_NAME))["global_step"] == 2
    return line


def test_disk_full_while_writing_a_checkpoint(tmp_path, capfd, monkeypatch):
    """The write of checkpoint-4's optimizer state fails with ENOSPC (a patched write)."""
    import safetensors.paddle

    real = safetensors.paddle.save_file

    def save_file(tensors, filename, metadata=None):
        if "checkpoint-4" in filename and filename.endswith(checkpointing.OPTIMIZER_NAME):
            with open(filename, "wb") as f:
                f.write(b"\0" * 1000)  # a partial file, as a real full disk leaves one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.paddle, "save_file", save_file)
    out = tmp_path / "out"
    rc = _train(tmp_path, out)
    line = _assert_disk_full_outcome(out, capfd.readouterr().err, rc)
    assert "No space left on device" in line
    needed = int(line.split(" bytes) to write")[0].rsplit("(", 1)[1])
    params = sum(int(p.numel()) for p in _model(0).parameters())
    assert params * 4 * 3 <= needed < params * 4 * 3 + 4096  # weights + AdamW's two moments, float32


def test_disk_full_during_the_final_save_keeps_the_previous_model(tmp_path, capfd, monkeypatch):
    """A first run's model is in output_dir; the second run's final save hits ENOSPC: the first
    run's weights still load from output_dir, unchanged."""
    out = tmp_path / "out"
    assert _train(tmp_path, out, "save_steps=100") == 0
    before = _numpy_state(from_pretrained(str(out)))
    import safetensors.paddle

    real = safetensors.paddle.save_file

    def save_file(tensors, filename, metadata=None):
        if filename == str(out / ".erniekit-save.tmp" / WEIGHTS_NAME):  # the final save's weights
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.paddle, "save_file", save_file)
    capfd.readouterr()
    for name in os.listdir(out):  # a new run into the first one's output_dir: its checkpoints go first
        if name.startswith("checkpoint-"):
            shutil.rmtree(out / name)
    rc = _train(tmp_path, out, "save_steps=100", "seed=7", "max_steps=2")
    err = capfd.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "No space left on device" in err, err[-3000:]
    assert f"the model weights in {out}" in err
    assert _which(_numpy_state(from_pretrained(str(out))), before, {}) == "old"
    assert ".erniekit-save.tmp" not in os.listdir(out)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (root with mount rights only): room for one tiny checkpoint, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights); the patched-write tests cover this")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)  # lazy: a failed run may still hold a log file


@pytest.mark.parametrize("when", ["before-writing", "mid-write"])
def test_disk_full_on_a_real_small_filesystem(small_disk, tmp_path, capfd, monkeypatch, when):
    """before-writing: the free space is checked against the bytes to write, nothing is written.
    mid-write: that check is bypassed, so the kernel's own ENOSPC arrives in the middle of the write."""
    if when == "mid-write":
        monkeypatch.setattr(eio, "free_bytes", lambda path: 1 << 40)
    out = small_disk / "out"
    rc = _train(tmp_path, out)
    line = _assert_disk_full_outcome(out, capfd.readouterr().err, rc)
    assert ("not enough space" if when == "before-writing" else "No space left on device") in line
    assert not any(".tmp" in p for p in os.listdir(out))
