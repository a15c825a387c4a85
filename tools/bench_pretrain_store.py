"""Memory and time of building pretraining rows: in memory, building the token store (tokenized_path),
and a second start with the store present. Each case runs in a fresh process (PretrainStage's
build_train_rows on a generated plain-text corpus, the bundled tokenizer); peak RSS is the process's
VmHWM, `rss_after_imports_mib` its VmRSS before the data is read (paddle and erniekit imported).

    python tools/bench_pretrain_store.py --mb 200 --out bench_results/pretrain_store.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

WORDS = "the quick brown fox jumps over lazy dog 12+34=46 model token paddle ernie data train loss step rank memory disk 7-3=4 and of".split()


def write_corpus(path: str, mb: float, seed: int = 0) -> int:
    """One document per line, 20-400 words drawn from WORDS; returns the bytes written."""
    import numpy as np

    rng, words, written = np.random.default_rng(seed), np.array(WORDS), 0
    with open(path, "w") as f:
        while written < mb * 1e6:
            line = " ".join(words[rng.integers(0, len(words), int(rng.integers(20, 400)))]) + "\n"
            f.write(line)
            written += len(line)
    return written


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))


def child(path: str, store: str | None, max_seq_len: int) -> dict:
    """One measurement in this process."""
    import dataclasses
    import warnings

    warnings.simplefilter("ignore")
    from erniekit.config.schema import TrainConfig
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.train.stages.pretrain import PretrainStage

    tok = default_tokenizer()
    cfg = dataclasses.replace(TrainConfig(), train_dataset_path=path, tokenized_path=store, max_seq_len=max_seq_len)
    base = _status_mib("VmRSS")
    t0 = time.perf_counter()
    rows = PretrainStage().build_train_rows(cfg, tok)
    seconds = time.perf_counter() - t0
    return {
        "rows": len(rows),
        "tokens": len(rows.tokens),
        "documents": rows.num_docs,
        "seconds": round(seconds, 3),
        "rss_after_imports_mib": round(base),
        "peak_rss_mib": round(_status_mib("VmHWM")),
    }


def _run(path: str, store: str | None, max_seq_len: int) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--max-seq-len", str(max_seq_len)]
    out = subprocess.run([*cmd, *(["--store", store] if store else [])], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0, help="corpus size in MB")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--out", default="bench_results/pretrain_store.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.store, a.max_seq_len)))
        return
    work = tempfile.mkdtemp(prefix="bench-pretrain-store-")
    try:
        corpus, store = os.path.join(work, "corpus.txt"), os.path.join(work, "tokenized")
        size = write_corpus(corpus, a.mb)
        cases = {"in_memory": _run(corpus, None, a.max_seq_len)}
        cases["store_build"] = _run(corpus, store, a.max_seq_len)
        cases["store_reuse"] = _run(corpus, store, a.max_seq_len)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {
        "what": " ".join(__doc__.split("\n\n")[0].split()),
        "corpus_bytes": size,
        "max_seq_len": a.max_seq_len,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
