"""The pretraining token store (`tokenized_path`, erniekit/data/token_store.py): built once, memory-mapped
after, rebuilt when its sources or tokenizer change, built by one of several processes that start
together, and not blocked by the lock of a process that died."""

import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest

import erniekit.data.token_store as ts
from erniekit.data.encode import PackedDocuments, encode_pretrain_array, pack
from erniekit.data.formats import iter_pretrain_texts
from erniekit.errors import DataError
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

ROOT = str(Path(__file__).resolve().parents[3])


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _corpus(tmp_path, n=40, name="c.txt") -> str:
    path = tmp_path / name
    path.write_text("".join(f"document {i}: {i}+{i}={2 * i} and some words\n" for i in range(n)))
    return str(path)


def _docs(path, tok, calls=None):
    def make():
        if calls is not None:
            calls.append(1)
        return (encode_pretrain_array(t, tok) for t in iter_pretrain_texts(path))

    return make


def _must_not_tokenize():
    raise AssertionError("tokenized again: the store was not reused")


def _open(directory, path, tok, docs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ts.open_or_build(str(directory), ts.corpus_fingerprint(path, tok), docs)
    return store, [str(w.message) for w in caught]


def test_the_store_is_built_once_then_memory_mapped(tmp_path, tok):
    path, calls = _corpus(tmp_path), []
    store, notes = _open(tmp_path / "tok" / "train", path, tok, _docs(path, tok, calls))
    assert calls == [1] and notes == []
    assert sorted(os.listdir(tmp_path / "tok")) == ["train"]  # no lock, no temporary directory left
    want = [encode_pretrain_array(t, tok) for t in iter_pretrain_texts(path)]
    assert np.array_equal(store.tokens, np.concatenate(want))
    assert store.doc_offsets.tolist() == np.cumsum([0] + [len(d) for d in want]).tolist()
    again, notes = _open(tmp_path / "tok" / "train", path, tok, _must_not_tokenize)
    assert isinstance(again.tokens, np.memmap) and isinstance(again.doc_offsets, np.memmap) and notes == []
    assert np.array_equal(again.tokens, store.tokens)
    meta = json.loads((tmp_path / "tok" / "train" / "store.json").read_text())
    assert meta["fingerprint"]["sources"] == [[path, os.path.getsize(path), os.stat(path).st_mtime_ns]]
    assert meta["num_docs"] == 40 and meta["format"] == ts.FORMAT


def test_rows_over_the_store_equal_pack_without_copying(tmp_path, tok):
    path = _corpus(tmp_path, n=30)
    store, _ = _open(tmp_path / "s", path, tok, _docs(path, tok))
    rows = PackedDocuments.from_arrays(store.tokens, store.doc_offsets, 16, pad_id=0)
    assert rows.tokens is store.tokens and rows.doc_offsets is store.doc_offsets  # mapped, not copied
    docs = [encode_pretrain_array(t, tok) for t in iter_pretrain_texts(path)]
    want = pack([(d, d) for d in docs], 16)
    assert len(rows) == len(want) and all(np.array_equal(w[k], g[k]) for w, g in zip(want, rows[:]) for k in w)


def test_a_changed_source_or_tokenizer_rebuilds_with_a_note(tmp_path, tok):
    path, store_dir = _corpus(tmp_path), tmp_path / "tok" / "train"
    _open(store_dir, path, tok, _docs(path, tok))
    with open(path, "a") as f:
        f.write("one more document\n")
    calls = []
    store, notes = _open(store_dir, path, tok, _docs(path, tok, calls))
    assert calls == [1] and notes == [f"tokenized_path: rebuilding {store_dir} (built from other sources)"]
    assert len(store.doc_offsets) == 42
    thinking = tok.with_thinking_template()  # adds its tags as tokens: other ids for the same text
    assert ts.tokenizer_digest(thinking) != ts.tokenizer_digest(tok)
    _, notes = _open(store_dir, path, thinking, _docs(path, thinking))
    assert notes == [f"tokenized_path: rebuilding {store_dir} (built from other tokenizer)"]
    (store_dir / "tokens.bin").write_bytes(b"\0" * 8)  # damaged: rebuilt, not read
    _, notes = _open(store_dir, path, thinking, _docs(path, thinking))
    assert notes == [
        f"tokenized_path: rebuilding {store_dir} (its tokens.bin or doc_offsets.bin is missing or of the wrong size)"
    ]


def test_building_memory_does_not_grow_with_the_corpus(tmp_path, tok):
    """Tokenizing 300 KB of text (~270 K ids, 1.1 MB as int32) into a store takes under 150 KB of Python
    heap (measured: ~70 KB): one document at a time from the reader, its ids written out at once."""
    path = tmp_path / "big.txt"
    line = " ".join(f"w{i % 50} {i}+1={i + 1}" for i in range(60))
    path.write_text(f"{line}\n" * (300_000 // (len(line) + 1)))
    want = ts.corpus_fingerprint(str(path), tok)
    tracemalloc.start()
    try:
        store = ts.open_or_build(str(tmp_path / "tok"), want, _docs(str(path), tok))
        heap = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert store.tokens.nbytes > 1 << 20 and heap < 150 << 10


def test_a_directory_that_is_not_a_store_is_left_alone(tmp_path, tok):
    path, mine = _corpus(tmp_path), tmp_path / "tok" / "train"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("not yours")
    with pytest.raises(DataError, match="tok/train exists but is not a token store .*set tokenized_path to another"):
        _open(mine, path, tok, _docs(path, tok))
    assert (mine / "notes.txt").read_text() == "not yours"


def test_a_failed_build_leaves_no_store_and_no_lock(tmp_path, tok):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: field 'text' must be a string"):
        _open(tmp_path / "tok" / "train", str(path), tok, _docs(str(path), tok))
    assert os.listdir(tmp_path / "tok") == []


WORKER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from erniekit.data.encode import encode_pretrain_array
from erniekit.data.formats import iter_pretrain_texts
from erniekit.data.token_store import corpus_fingerprint, open_or_build
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

path, store_dir, go, log = sys.argv[1:5]
tok = default_tokenizer()
want = corpus_fingerprint(path, tok)

def docs():
    with open(log, "a") as f:
        f.write(f"build {{os.getpid()}}\\n")
    time.sleep(0.5)  # a build that takes a while: the other process arrives while the lock is held
    return (encode_pretrain_array(t, tok) for t in iter_pretrain_texts(path))

while not os.path.exists(go):
    time.sleep(0.005)
store = open_or_build(store_dir, want, docs)
print(json.dumps([int(store.tokens.sum()), len(store.doc_offsets)]))
"""


def test_processes_starting_together_build_once(tmp_path):
    path, store_dir, go, log = _corpus(tmp_path), tmp_path / "tok" / "train", tmp_path / "go", tmp_path / "log"
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=ROOT))
    args = [sys.executable, str(script), path, str(store_dir), str(go), str(log)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(0.5)  # let them import and wait for the signal
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len(log.read_text().splitlines()) == 1  # one build
    assert len({o[0] for o in outs}) == 1 and json.loads(outs[0][0])[1] == 41  # the same store for all
    assert sorted(os.listdir(tmp_path / "tok")) == ["train"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _lock(store_dir, **owner):
    store_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = Path(f"{store_dir}.lock")
    lock.write_text(json.dumps({"host": socket.gethostname(), "token": "t", **owner}))
    return lock


def test_the_lock_of_a_dead_process_is_taken_over_at_once(tmp_path, tok, monkeypatch):
    path, store_dir = _corpus(tmp_path), tmp_path / "tok" / "train"
    # not taken over at once: a DataError after WAIT_S = 5 s, before the lock could go stale (STALE_S = 300 s)
    monkeypatch.setattr(ts, "WAIT_S", 5.0)
    pid = _dead_pid()
    lock = _lock(store_dir, pid=pid)
    leftover = Path(f"{store_dir}.tmp-{socket.gethostname()}-{pid}-abc")  # the dead build's partial files
    leftover.mkdir()
    store, notes = _open(store_dir, path, tok, _docs(path, tok))
    assert len(store.doc_offsets) == 41
    assert notes == [
        f"tokenized_path: removed the stale lock {lock} (host {socket.gethostname()}, pid {pid}: gone, or silent for 300 s)"
    ]
    assert not lock.exists() and not leftover.exists()


def test_a_silent_lock_of_another_host_is_taken_over_after_stale_s(tmp_path, tok, monkeypatch):
    path, store_dir = _corpus(tmp_path), tmp_path / "tok" / "train"
    lock = _lock(store_dir, host="elsewhere", pid=1)
    monkeypatch.setattr(ts, "STALE_S", 0.3)
    monkeypatch.setattr(ts, "POLL_S", 0.02)
    monkeypatch.setattr(ts, "WAIT_S", 5.0)
    t0 = time.monotonic()
    store, notes = _open(store_dir, path, tok, _docs(path, tok))
    assert 0.3 <= time.monotonic() - t0 and len(store.doc_offsets) == 41 and not lock.exists()
    assert notes[0].startswith(f"tokenized_path: removed the stale lock {lock} (host elsewhere, pid 1")


def test_a_live_lock_is_waited_for_then_a_one_line_error(tmp_path, tok, monkeypatch):
    """A live holder (same host, its pid alive, heartbeat beating) is waited for up to WAIT_S."""
    path, store_dir = _corpus(tmp_path), tmp_path / "tok" / "train"
    lock = _lock(store_dir, pid=os.getppid())
    monkeypatch.setattr(ts, "WAIT_S", 0.3)
    monkeypatch.setattr(ts, "POLL_S", 0.02)
    with pytest.raises(DataError) as e:
        _open(store_dir, path, tok, _must_not_tokenize)
    assert str(e.value) == (
        f"tokenized_path: waited 0 s for {store_dir}, still locked by {lock} (host {socket.gethostname()}, "
        f"pid {os.getppid()}); check that process, or delete the lock if nothing is building"
    )
    assert lock.exists()  # a live process's lock is not removed


def test_the_pretrain_stage_reads_the_store_of_tokenized_path(tmp_path, tok, monkeypatch):
    """Rows (and so train_rows, which a resume checks) are the same with and without tokenized_path;
    a second start maps the train and eval stores without tokenizing."""
    import dataclasses

    from erniekit.config.schema import TrainConfig
    from erniekit.train.stages.pretrain import PretrainStage

    train, held = _corpus(tmp_path, n=50), _corpus(tmp_path, n=7, name="e.txt")
    plain = dataclasses.replace(TrainConfig(), train_dataset_path=train, eval_dataset_path=held, max_seq_len=24)
    cached = dataclasses.replace(plain, tokenized_path=str(tmp_path / "tok"))
    stage = PretrainStage()
    want = [stage.build_train_rows(plain, tok), stage.build_eval_data(plain, tok)]
    first = [stage.build_train_rows(cached, tok), stage.build_eval_data(cached, tok)]
    assert sorted(os.listdir(tmp_path / "tok")) == ["eval", "train"]
    monkeypatch.setattr(tok, "encode", lambda *a, **k: _must_not_tokenize())
    again = [stage.build_train_rows(cached, tok), stage.build_eval_data(cached, tok)]
    for rows in (first, again):
        assert all(isinstance(r.tokens, np.memmap) for r in rows)
        for got, ref in zip(rows, want):
            assert len(got) == len(ref) > 1
            assert all(np.array_equal(g[k], w[k]) for g, w in zip(got[:], ref[:]) for k in w)


def test_a_stop_request_ends_the_tokenizing_and_the_wait_for_a_lock(tmp_path, tok, monkeypatch):
    """SIGTERM during the start-up of a large pretraining corpus took effect only after the first
    step (tokenizing can take many minutes): now the run stops before its first step, as a stop."""
    import dataclasses
    import signal

    from erniekit.config.schema import TrainConfig
    from erniekit.train import run
    from erniekit.train.stages import pretrain
    from erniekit.utils import run_control

    cfg = dataclasses.replace(TrainConfig(), train_dataset_path=_corpus(tmp_path, n=600), max_seq_len=24, do_eval=False)
    seen = []
    real = pretrain.encode_pretrain_array

    def encode(text, tokenizer):
        seen.append(1)
        if len(seen) == 300:
            run_control.request_stop(signal.SIGTERM)
        return real(text, tokenizer)

    monkeypatch.setattr(pretrain, "encode_pretrain_array", encode)
    monkeypatch.setitem(run_control._requested, "signal", 0)
    with pytest.raises(run.StoppedBeforeFirstStep):
        run._build_data(pretrain.PretrainStage(), cfg, tok)
    assert len(seen) < 600  # stopped within STOP_POLL_DOCS documents, not at the end
    store_dir = tmp_path / "tok" / "train"
    _lock(store_dir, pid=os.getppid())  # a live builder elsewhere
    monkeypatch.setattr(ts, "WAIT_S", 5.0)  # a wait the stop did not end: "waited 5 s", a DataError, after 5 s
    with pytest.raises(run.StoppedBeforeFirstStep) as e:
        run._build_data(pretrain.PretrainStage(), dataclasses.replace(cfg, tokenized_path=str(tmp_path / "tok")), tok)
    assert str(e.value.__cause__).startswith("tokenized_path: stopped while waiting for")  # the stop ended the wait


def test_a_builder_whose_lock_was_taken_over_does_not_publish(tmp_path, tok, monkeypatch):
    """A holder judged stale (its heartbeat missed) while it still built: a waiter took the lock over
    and builds too. The first must not publish over, nor delete, the new holder's work."""
    path, store_dir = _corpus(tmp_path), tmp_path / "tok" / "train"
    monkeypatch.setattr(ts, "WAIT_S", 0.3)
    monkeypatch.setattr(ts, "POLL_S", 0.02)

    def docs_then_taken_over():
        for i, doc in enumerate(_docs(path, tok)()):
            if i == 3:  # another process, alive on this host, now holds the lock
                Path(f"{store_dir}.lock").write_text(
                    json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "token": "theirs"})
                )
            yield doc

    with pytest.raises(DataError, match="still locked by"):
        _open(store_dir, path, tok, docs_then_taken_over)
    assert not store_dir.exists() and not list(store_dir.parent.glob("train.tmp-*"))
    assert json.loads(Path(f"{store_dir}.lock").read_text())["token"] == "theirs"  # their lock stands


def test_only_dead_builds_leftovers_are_removed(tmp_path):
    store_dir = tmp_path / "tok" / "train"
    host = socket.gethostname()
    live = tmp_path / "tok" / f"train.tmp-{host}-{os.getppid()}-aaaa"
    dead = tmp_path / "tok" / f"train.tmp-{host}-{_dead_pid()}-bbbb"
    silent = tmp_path / "tok" / "train.tmp-elsewhere-1-cccc"
    for d in (live, dead, silent):
        d.mkdir(parents=True)
        (d / ts.TOKENS).write_bytes(b"")
    old = time.time() - ts.STALE_S - 10
    for p in (silent, silent / ts.TOKENS):
        os.utime(p, (old, old))
    ts._remove_leftovers(str(store_dir))
    assert live.exists() and not dead.exists() and not silent.exists()
