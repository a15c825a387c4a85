"""`erniekit train` with several processes: the checks that need the model's config run in the
parent before any process starts (erniekit/train/model_checks.py), and a rank's configuration,
data or checkpoint error before its first step ends the job with that one line instead of a
restart and a resume hint (erniekit/distributed/launch.py); tiny `python -c` children stand in for
paddle's launcher."""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from erniekit.cli import main
from erniekit.config import load_config, validate
from erniekit.distributed import join as join_module
from erniekit.distributed import launch
from erniekit.distributed.join import Topology
from erniekit.errors import ConfigError, DataError

ROOT = str(Path(__file__).resolve().parents[3])
SFT = os.path.join(ROOT, "examples/configs/tiny/sft.yaml")
KV_ERROR = "tensor_parallel_degree 2 does not divide the model's num_key_value_heads 1; use a tensor_parallel_degree"


@pytest.fixture
def launches(monkeypatch):
    """relaunch replaced by a recorder: what reaches it would have started processes."""
    seen = []
    monkeypatch.setattr(launch, "relaunch", lambda cfg, args, user_threads=None: seen.append(cfg) or 0)
    monkeypatch.chdir(ROOT)  # the config's data paths are relative to the repository
    return seen


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["tensor_parallel_degree=2", "model_overrides.num_key_value_heads=1"], KV_ERROR),
        (["expert_parallel_degree=2", "model_name_or_path=tiny-dense"], "expert_parallel_degree 2: the model is dense"),
        (
            ["pipeline_parallel_degree=2", "gradient_accumulation_steps=4", "eval_generation=false"]
            + ["model_overrides.num_nextn_predict_layers=1"],
            "pipeline_parallel_degree 2 with MTP heads (num_nextn_predict_layers 1) is not supported",
        ),
        (
            ["distributed_mode=ps", "ps_servers=1", "do_eval=false", "model_overrides.num_nextn_predict_layers=1"],
            "distributed_mode=ps does not train MTP heads",
        ),
    ],
    ids=["tp-kv-heads", "ep-dense", "pp-mtp", "ps-mtp"],
)
def test_a_layout_the_model_cannot_take_stops_before_any_process_starts(tmp_path, capsys, launches, overrides, words):
    args = ["train", SFT, "fp8=false", "nproc_per_node=2", f"output_dir={tmp_path / 'o'}", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert launches == []  # no process was started
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_a_layout_the_model_takes_is_launched(tmp_path, launches):
    """The parent's checks see the model the ranks build: the config's 4 KV heads split over tp=2."""
    args = ["train", SFT, "fp8=false", "nproc_per_node=2", "tensor_parallel_degree=2", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 0
    assert [c.tensor_parallel_degree for c in launches] == [2]


def _fake_launch(monkeypatch, tmp_path, rank_code: str) -> tuple[Path, SimpleNamespace]:
    """launch_command -> a child that counts its starts in tmp_path/starts, then runs rank_code."""
    starts = tmp_path / "starts"
    code = f"import os, sys; open({str(starts)!r}, 'a').write('x'); os.environ['PADDLE_TRAINER_ID'] = '1'; " + rank_code
    monkeypatch.setattr(launch, "launch_command", lambda cfg, args: [sys.executable, "-c", code])
    return starts, SimpleNamespace(nproc_per_node=2, nnodes=1, output_dir=str(tmp_path / "o"), max_restart=2)


def test_a_ranks_configuration_error_before_its_first_step_ends_the_job_without_restart(tmp_path, monkeypatch, capsys):
    """Rank 1 notes its error and exits 2 (train/run.py): `erniekit train` prints that line as its
    last, exits 2, does not restart (max_restart=2) and does not suggest resuming."""
    note = (
        "from erniekit.distributed.launch import note_failure_before_first_step as note; "
        f"note({str(tmp_path / 'o')!r}, {KV_ERROR!r}); sys.exit(2)"
    )
    starts, cfg = _fake_launch(monkeypatch, tmp_path, note)
    assert launch.relaunch(cfg, []) == 2
    out, err = capsys.readouterr()
    assert starts.read_text() == "x"  # no restart
    assert err.strip().splitlines()[-1] == f"error: {KV_ERROR}"
    assert "resume_from_checkpoint" not in out + err and "restart" not in out
    # the note stays for the parents of a multi-node job's other nodes (a shared output_dir); the next
    # launch ignores and removes it as an earlier launch's (test_a_failure_without_a_fresh_note_...)
    assert [n for n in os.listdir(tmp_path / "o" / "launch_logs") if n.startswith("failed")]


def test_a_failure_without_a_fresh_note_is_restarted_as_before(tmp_path, monkeypatch, capsys):
    """Exit code 2 alone (an error after steps ran), with only an earlier launch's note beside it,
    is a failure: restarted max_restart times, then the resume hint."""
    starts, cfg = _fake_launch(monkeypatch, tmp_path, "sys.exit(2)")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    launch.note_failure_before_first_step(cfg.output_dir, "an earlier launch's error")
    old = time.time() - 3600
    stale = os.path.join(cfg.output_dir, "launch_logs", "failed-before-first-step.rank-0")
    os.utime(stale, (old, old))
    assert launch.relaunch(cfg, []) == 2
    out = capsys.readouterr().out
    assert starts.read_text() == "xxx"  # the first start and max_restart=2 restarts
    assert "restart 2 of 2" in out and "run it again with resume_from_checkpoint=auto" in out


def _rank_cfg(tmp_path, *overrides):
    data = os.path.join(ROOT, "examples/data/arithmetic/train.jsonl")
    base = ["model_name_or_path=tiny-dense", f"train_dataset_path={data}", "max_steps=1", "do_eval=false"]
    return validate(load_config(None, [*base, f"output_dir={tmp_path / 'o'}", *overrides]))


def _notes(tmp_path) -> list[str]:
    logs = tmp_path / "o" / "launch_logs"
    return sorted(p.read_text() for p in logs.glob("failed-before-first-step.rank-*")) if logs.is_dir() else []


def test_a_rank_notes_a_user_error_only_while_it_starts(tmp_path, monkeypatch):
    """Rank 1 of a launched job (joined as one process here): a ConfigError while building its model
    is noted for the parent; a DataError once training began is not (that failure may restart)."""
    import erniekit.train.run as run

    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setattr(join_module, "join", lambda cfg: Topology())
    with pytest.raises(ConfigError, match="model's vocab_size is 64") as e:
        run.run_train(_rank_cfg(tmp_path, "model_overrides.vocab_size=64"))
    assert _notes(tmp_path) == [str(e.value)]
    (tmp_path / "o" / "launch_logs" / "failed-before-first-step.rank-1").unlink()

    def fails_in_training(*args):
        raise DataError("train.jsonl line 7: bad record")

    monkeypatch.setattr(run, "_train_and_evaluate", fails_in_training)
    with pytest.raises(DataError):
        run.run_train(_rank_cfg(tmp_path))
    assert _notes(tmp_path) == []


def test_a_cross_cluster_process_notes_its_start_error_too(tmp_path, monkeypatch):
    """A cluster's process of a one-machine cross-cluster job (cross_cluster_id >= 0) is no launched
    rank when its cluster has one process: it notes its error for launch_clusters all the same."""
    import erniekit.train.run as run

    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    for in_cluster, noted in ((False, []), (True, ["train.jsonl:7: bad"])):
        with pytest.raises(DataError), run.noting_start_failure(str(tmp_path / "o"), in_cluster):
            raise DataError("train.jsonl:7: bad")
        assert _notes(tmp_path) == noted


def test_a_rank_notes_a_config_its_validation_refuses(tmp_path, monkeypatch, capsys):
    """A check the parent passed can fail in a rank (a data path another node cannot see): the rank's
    `erniekit train` notes its one line for the parent before any model or process group is built."""
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    missing = tmp_path / "only-on-node-0.jsonl"
    args = ["train", "model_name_or_path=tiny-dense", f"train_dataset_path={missing}", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and _notes(tmp_path) == [err.strip().removeprefix("error: ")]
    monkeypatch.delenv("PADDLE_TRAINER_ID")  # the parent itself: its error is printed, not noted
    (tmp_path / "o" / "launch_logs" / "failed-before-first-step.rank-1").unlink()
    assert main(args) == 2 and _notes(tmp_path) == []


def test_only_a_cluster_that_launch_clusters_started_notes_its_start_error(tmp_path, monkeypatch):
    """A cluster started by hand on its own site (a real multi-site run) prints its error to its user;
    a note would lie unread in its launch_logs. One that launch_clusters started leaves it for it."""
    import erniekit.train.run as run
    from erniekit.distributed.cross_cluster import launch as cluster_launch

    def refuses(cfg, log, start):
        raise DataError("train.jsonl:7: bad")

    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    monkeypatch.setattr(run, "_run_train", refuses)
    cfg = SimpleNamespace(output_dir=str(tmp_path / "o"), cross_cluster_id=1)
    for parent, noted in ((None, []), ("1", ["train.jsonl:7: bad"])):
        if parent:
            monkeypatch.setenv(cluster_launch.PARENT_ENV, parent)
        with pytest.raises(DataError):
            run.run_train(cfg)
        assert _notes(tmp_path) == noted


def test_a_rank_whose_output_dir_is_the_error_still_says_it_in_one_line(tmp_path, monkeypatch, capsys):
    """The note goes under output_dir: when output_dir is what the rank refused (a file where a
    directory should be, on that node), writing the note failed with a traceback instead."""
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    (tmp_path / "afile").write_text("x")
    data = os.path.join(ROOT, "examples/data/arithmetic/pretrain.jsonl")
    args = ["train", "model_name_or_path=tiny-dense", "stage=pretrain", f"train_dataset_path={data}"]
    assert main([*args, f"output_dir={tmp_path / 'afile' / 'out'}", "max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: output_dir=") and "is a file, not a directory" in err and err.count("\n") == 1
