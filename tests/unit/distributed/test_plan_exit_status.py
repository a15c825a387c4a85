"""`erniekit plan`'s exit status means the same with or without --all: 0 when some layout both fits
and is one `erniekit train` runs for the config, else 1 (--all only adds the refused rows)."""

import json
from pathlib import Path

from erniekit.cli import main

ROOT = Path(__file__).resolve().parents[3]
SFT = str(ROOT / "examples/configs/tiny/sft.yaml")


def _plan(tmp_path, capsys, memory: str, *args: str) -> tuple[int, list[dict]]:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"devices_per_node: 2\ndevice_flops: 2.5e10\ndevice_memory: {memory}\n")
    out = tmp_path / "rows.json"
    rc = main(["plan", SFT, f"cluster={cluster}", "--json", str(out), *args])
    capsys.readouterr()
    return rc, json.loads(out.read_text())


def test_every_layout_refused_exits_1_with_or_without_all(tmp_path, capsys):
    """The credibility loss runs in one process: train refuses every layout of 2 devices, though
    they fit; --all lists them (the first fits) and still exits 1."""
    rc, rows = _plan(tmp_path, capsys, "1.2e10", "credibility_loss_weight=0.1")
    assert rc == 1 and rows == []
    rc, rows = _plan(tmp_path, capsys, "1.2e10", "credibility_loss_weight=0.1", "--all")
    assert rc == 1 and rows and rows[0]["fits"] and all(r["refused"] for r in rows)


def test_layouts_that_fit_only_where_refused_exit_1_with_or_without_all(tmp_path, capsys):
    """A memory limit under which only layouts train refuses (a pipeline beside generation during
    eval, ZeRO-3 on CPU) would fit: the first row --all prints fits, and the exit status is 1."""
    rows = _plan(tmp_path, capsys, "1.2e10", "--all")[1]
    runnable = min(r["memory_bytes"] for r in rows if not r["refused"])
    refused = min(r["memory_bytes"] for r in rows if r["refused"])
    assert refused < runnable
    memory = f"{(refused + runnable) / 2:.6e}"
    rc, rows = _plan(tmp_path, capsys, memory, "--all")
    assert rc == 1 and rows[0]["fits"] and rows[0]["refused"]
    assert not any(r["fits"] and not r["refused"] for r in rows)
    assert _plan(tmp_path, capsys, memory)[0] == 1


def test_a_runnable_layout_that_fits_exits_0_with_or_without_all(tmp_path, capsys):
    for args in ((), ("--all",)):
        rc, rows = _plan(tmp_path, capsys, "1.2e10", *args)
        assert rc == 0 and any(r["fits"] and not r["refused"] for r in rows), args
