"""tools/bench_vs_torch.py: both frameworks time the same transformers-written checkpoint, the
embedded default's model is read from its config, and a model that differs is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
TOOL = str(ROOT / "tools" / "bench_vs_torch.py")
PEAK_TFLOPS = 0.5  # a made-up peak: the runs' MFU against it
sys.path.insert(0, str(ROOT / "tools"))

import bench_vs_torch as B  # noqa: E402


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, TOOL, "--cases", "train:tiny-moe", "--repeats", "1", "--steps", "1", "--threads", "1"]
    cmd += ["--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "vs.json"), "--peak-tflops", str(PEAK_TFLOPS)]
    cmd += args
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One run of the tool (it writes the checkpoint and transformers' reference logits into
    work/): what the first test checks, and the intact work/ the second one damages a copy of."""
    base = tmp_path_factory.mktemp("bench")
    r = _run(base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


def test_both_frameworks_train_the_embedded_defaults_model_from_one_checkpoint(first_run):
    tmp_path = first_run
    record = json.loads((tmp_path / "vs.json").read_text())
    assert (record["device"], record["precision"], record["gpu"]) == ("cpu", "fp32", None)  # auto on a CPU host
    case = record["cases"]["train:tiny-moe"]
    e, t = case["runs"]["erniekit"][0], case["runs"]["torch"][0]
    # model FLOPs of each run against the given peak
    assert case["model_flops_per_token"] == B.train_flops_per_token("tiny-moe", 32)
    for r in (e, t):
        assert r["model_tflops"] == r["tokens_per_s"] * case["model_flops_per_token"] / 1e12
        assert r["mfu"] == r["model_tflops"] / PEAK_TFLOPS
    assert case["erniekit_mfu"]["median"] == e["mfu"] and record["reference_mfu"] == 0.47
    assert e["tokens_per_s"] > 0 and t["tokens_per_s"] > 0 and e["peak_rss_bytes"] > 0 and t["peak_rss_bytes"] > 0
    assert case["ratio_erniekit_over_torch"] == e["tokens_per_s"] / t["tokens_per_s"]
    assert e["load_s"] > 0 and t["load_s"] > 0 and case["load_speedup"] == t["load_s"] / e["load_s"]
    assert e["fused_head_loss"] is True  # the head's loss as erniekit train takes it by default
    # the same model: the first losses agree up to the frameworks' router-loss formulas (coef 0.01)
    assert abs(e["first_loss"] - t["first_loss"]) < 0.05, (e["first_loss"], t["first_loss"])
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config

    written = Ernie4_5Config.from_pretrained(str(tmp_path / "work" / "tiny-moe"))  # as transformers saved it
    overrides = yaml.safe_load(open(ROOT / "examples" / "configs" / "tiny" / "sft.yaml"))["model_overrides"]
    assert {k: getattr(written, k) for k in overrides} == overrides and written.is_moe


def test_a_model_whose_logits_differ_from_transformers_is_refused(first_run, tmp_path):
    shutil.copytree(first_run / "work", tmp_path / "work")  # a run of the tool left it
    ref = tmp_path / "work" / "tiny-moe" / "torch_logits.npy"
    np.save(ref, np.load(ref) + 1.0)
    r = _run(tmp_path, "--repeats", "2")  # repeat 2 runs erniekit first: it reads the damaged reference
    assert r.returncode != 0 and "logits differ" in r.stderr + r.stdout


def test_both_frameworks_run_on_the_same_kind_of_device():
    assert B.resolve_device("auto", False, False) == "cpu"
    assert B.resolve_device("auto", True, True) == "gpu" == B.resolve_device("gpu", True, True)
    assert B.resolve_device("cpu", True, True) == "cpu"
    for paddle_gpu, torch_gpu, words in (
        (False, True, "Paddle sees no CUDA GPU here; install paddlepaddle-gpu"),
        (True, False, "torch sees no CUDA GPU here; install a CUDA build of torch"),
    ):
        with pytest.raises(SystemExit, match=words):
            B.resolve_device("auto", paddle_gpu, torch_gpu)
    with pytest.raises(SystemExit, match="--device gpu: Paddle and torch see no"):
        B.resolve_device("gpu", False, False)


def test_the_cli_asks_both_frameworks_before_it_runs_on_a_gpu(tmp_path):
    """--device gpu probes Paddle and torch in processes of their own (none sees a GPU here), and
    bf16 on the CPU and a peak of 0 are refused, each in one line before any checkpoint is written."""
    for args, words in (
        (["--device", "gpu"], "--device gpu: Paddle and torch see no CUDA GPU here"),
        (["--device", "cpu", "--precision", "bf16"], "--precision bf16 needs a GPU"),
        (["--peak-tflops", "0"], "--peak-tflops 0.0: give the device's peak in TFLOP/s (> 0)"),
    ):
        r = _run(tmp_path, *args)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "work").exists()


def test_gpu_peaks_are_found_by_name():
    assert B.gpu_peak_tflops("NVIDIA H200") == B.gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert B.gpu_peak_tflops("NVIDIA H20") == 148.0 and B.gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert B.gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and B.gpu_peak_tflops("NVIDIA A10") == 125.0
    assert B.gpu_peak_tflops("NVIDIA L40S") == 362.1 and B.gpu_peak_tflops("NVIDIA L40") == 181.0
    assert B.gpu_peak_tflops("Tesla T4") is None and B.gpu_peak_tflops(None) is None
    assert B.gpu_peak_tflops("NVIDIA A10G") is None and B.gpu_peak_tflops("NVIDIA H100 NVL") is None  # other peaks


def test_model_flops_of_a_trained_token_count_every_product():
    """6 x the active parameters (a MoE layer: attention, norms, router, shared and k routed
    experts), 12 L A S for the attention's two products, 6 H V for the head; by hand."""
    H, L, V, q, kv, S = 1024, 4, 32000, 16 * 64, 2 * 64, 256
    layer = H * q + 2 * H * kv + q * H + 3 * H * 3072 + 2 * H
    assert B.train_flops_per_token("dense-1024", S) == 6 * (L * layer + H) + 12 * L * q * S + 6 * H * V
    H, V, q, kv = 512, 8192, 8 * 64, 2 * 64
    attn = H * q + 2 * H * kv + q * H + 2 * H
    dense, moe = attn + 3 * H * 1536, attn + H * 16 + 3 * H * 512 * (1 + 4)
    assert B.train_flops_per_token("moe16-top4", S) == 6 * (dense + 3 * moe + H) + 12 * L * q * S + 6 * H * V


def _table_rows(section: str) -> list[list[str]]:
    """The cells of a markdown table's body rows in `section` (header and rule left out)."""
    return [r.split("|")[1:-1] for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]


def _check_cells(cells: list[str], case: dict, where) -> None:
    """Three cells [torch, erniekit, ratio] quote `case` as the tool wrote it: both medians to 0.1
    (the min-max after them is not read) and the ratio in bold to 0.01."""
    torch_med, ours_med = (float(c.split("(")[0]) for c in cells[:2])
    assert torch_med == round(case["torch_tokens_per_s"]["median"], 1), where
    assert ours_med == round(case["erniekit_tokens_per_s"]["median"], 1), where
    assert cells[2].strip() == f"**{case['ratio_erniekit_over_torch']:.2f}**", where


def _check_table(section: str, recorded: str, n_cases: int, cpu: str = "Intel") -> None:
    """The table of `section` quotes bench_results/`recorded`: every case, torch's and erniekit's
    medians and the ratio, as the tool wrote them."""
    rows = _table_rows(section)
    got = json.loads((ROOT / "bench_results" / recorded).read_text())
    assert got["cpu"].startswith(cpu) and got["threads"] == 2
    cases = got["cases"]
    assert len(rows) == len(cases) == n_cases
    for row, (name, case) in zip(rows, cases.items()):
        _check_cells(row[1:4], case, (name, row))


def test_the_intel_tables_in_the_docs_are_the_recorded_runs():
    doc = (ROOT / "docs" / "performance.md").read_text()
    _check_table(doc.split("## On an Intel Xeon", 1)[1].split("\n## ", 1)[0], "vs_torch_intel_xeon.json", 10)
    fifth = doc.split("### Fifth round", 1)[1].split("\n- ", 1)[0]
    _check_table(fifth, "vs_torch_intel_xeon_round5.json", 7)
    sixth = doc.split("### Sixth round", 1)[1].split("\n- ", 1)[0]
    _check_table(sixth, "vs_torch_intel_xeon_round6.json", 7)


def test_the_second_amd_host_table_quotes_its_record():
    """docs/performance.md's second-AMD-host table: each case's ratio as bench_results/vs_torch_amd_round7.json
    has it (the table names cases in words, in the record's order mapped below)."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### The same benchmark on a second AMD EPYC host", 1)[1].split("\n**", 1)[0]
    rows = _table_rows(section)
    got = json.loads((ROOT / "bench_results" / "vs_torch_amd_round7.json").read_text())
    assert got["cpu"].startswith("AMD") and got["threads"] == 2
    names = {
        "train dense-1024": "train:dense-1024",
        "train tiny-moe": "train:tiny-moe",
        "greedy decode, batch 1": "decode-b1",
        "greedy decode, batch 8": "decode-b8",
        "server, 16 requests": "server-c16",
        "server, 64 requests": "server-c64",
    }
    assert len(rows) == len(got["cases"]) == len(names)
    for row in rows:
        case = got["cases"][names[row[0].strip()]]
        assert row[1].strip() == f"{case['ratio_erniekit_over_torch']:.2f}", row


def test_the_eighth_round_table_quotes_its_record():
    """The decode kernels' table on the second AMD host: medians and ratios as the tool wrote them,
    and the 5-repeat batch-1 ratio the text quotes."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    eighth = doc.split("### Eighth round", 1)[1].split("\n- ", 1)[0]
    _check_table(eighth.split("Other runs", 1)[0], "vs_torch_amd_round8.json", 4, cpu="AMD")
    five = json.loads((ROOT / "bench_results" / "vs_torch_amd_round8_decode_5repeats.json").read_text())
    ratio = five["cases"]["decode-b1"]["ratio_erniekit_over_torch"]
    assert five["repeats"] == 5 and f"batch 1 **{ratio:.2f}x** over 5 repeats" in eighth


def test_the_packed_server_table_quotes_its_record():
    doc = (ROOT / "docs" / "performance.md").read_text()
    part = doc.split("### Eighth round, second part", 1)[1].split("\n- ", 1)[0]
    _check_table(part, "vs_torch_amd_round8_server_packed.json", 2, cpu="AMD")
    assert json.loads((ROOT / "bench_results" / "vs_torch_amd_round8_server_packed.json").read_text())["packed_weights"]


def test_the_ninth_round_table_quotes_its_records_and_their_packing():
    """The default (auto) packing's decode and server table: each row as its record has it, and each
    erniekit run recorded the packing it chose."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    ninth = doc.split("### Ninth round", 1)[1].split("\n- ", 1)[0]
    rows = _table_rows(ninth)
    for recorded, part in (
        ("vs_torch_amd_round9_decode_auto.json", rows[:2]),
        ("vs_torch_amd_round9_server_auto.json", rows[2:]),
    ):
        got = json.loads((ROOT / "bench_results" / recorded).read_text())
        assert got["cpu"].startswith("AMD") and got["threads"] == 2 and got["packed_weights"] == "auto"
        assert len(part) == len(got["cases"]) == 2
        for row, case in zip(part, got["cases"].values()):
            _check_cells(row[1:4], case, row)
            assert all(r["packing"].startswith("packed weights on") for r in case["runs"]["erniekit"])


def test_the_ninth_round_quotes_its_five_repeat_batch_1_run():
    doc = (ROOT / "docs" / "performance.md").read_text()
    ninth = doc.split("### Ninth round", 1)[1].split("\n### ", 1)[0]
    five = json.loads((ROOT / "bench_results" / "vs_torch_amd_round9_decode_b1_5repeats.json").read_text())
    case = five["cases"]["decode-b1"]
    assert five["repeats"] == 5 and five["packed_weights"] == "auto"
    assert f"batch 1 **{case['ratio_erniekit_over_torch']:.2f}x** over 5 repeats" in ninth
    e, t = case["erniekit_tokens_per_s"], case["torch_tokens_per_s"]
    assert f"erniekit {e['min']:.1f}-{e['max']:.1f} tokens/s, torch {t['min']:.1f}-{t['max']:.1f}" in ninth


def test_the_main_table_quotes_the_tenth_round_s_full_run():
    """docs/performance.md's first table: the full benchmark with the current code, every case of
    bench_results/vs_torch_amd_round10.json, and the issue's thresholds hold in that record."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    _check_table(doc.split("## The table", 1)[1].split("### ", 1)[0], "vs_torch_amd_round10.json", 10, cpu="AMD")
    cases = json.loads((ROOT / "bench_results" / "vs_torch_amd_round10.json").read_text())["cases"]
    ratio = {k: c["ratio_erniekit_over_torch"] for k, c in cases.items()}
    assert min(v for k, v in ratio.items() if k.startswith("train:")) >= 1.0
    assert ratio["decode-b1"] >= 1.5 and ratio["decode-b8"] >= 1.5 and ratio["server-c16"] >= 2.0


def test_the_eleventh_round_table_quotes_its_fused_and_whole_logits_records():
    """fused_head_loss on / off: each row's ratios and memory as the four records have them, each
    record run with the setting its column names, and the erniekit runs' first losses the same."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    rows = _table_rows(doc.split("### Eleventh round", 1)[1].split("\n### ", 1)[0])
    records = {
        "train dense-1024": ("train", "train:dense-1024"),
        "train 0.3b-2l (2": ("train", "train:0.3b-2l"),
        "train 0.3b-2l-4k": ("long", "train:0.3b-2l-4k"),
    }
    assert len(rows) == 3
    for row in rows:
        kind, case = next(v for k, v in records.items() if row[0].strip().startswith(k))
        got = {
            f: json.loads((ROOT / "bench_results" / f"vs_torch_amd_round11_{kind}_fused_{f}.json").read_text())
            for f in ("on", "off")
        }
        assert all(got[f]["fused_head_loss"] == f and got[f]["cpu"].startswith("AMD") for f in got)
        on, off = got["on"]["cases"][case], got["off"]["cases"][case]
        assert all(r["fused_head_loss"] for r in on["runs"]["erniekit"])
        assert not any(r["fused_head_loss"] for r in off["runs"]["erniekit"])
        assert on["runs"]["erniekit"][0]["first_loss"] == off["runs"]["erniekit"][0]["first_loss"]
        assert row[1].strip().strip("*") == f"{on['ratio_erniekit_over_torch']:.2f}x", row
        assert row[2].strip() == f"{off['ratio_erniekit_over_torch']:.2f}x", row
        for cell, c in ((row[3], on), (row[4], off)):
            mib = round(c["erniekit_peak_rss_bytes"]["median"] / 2**20)
            assert cell.strip().replace("*", "") == f"{c['memory_ratio']:.2f}x ({mib} MiB)", row


def test_the_twelfth_round_tables_quote_their_records():
    """The twelfth round's two tables: the training ratios and memory as vs_torch_amd_round12_train.json
    has them (fused_head_loss on), and the attention kernel's recomputed / saved ratios as
    attention_recompute.json has them, per thread count."""
    section = (ROOT / "docs" / "performance.md").read_text().split("### Twelfth round", 1)[1].split("\n## ", 1)[0]
    attention, training = section.split("| shape (B x S", 1)[1], section.split("| case | erniekit / torch", 1)[1]
    rec = json.loads((ROOT / "bench_results" / "vs_torch_amd_round12_train.json").read_text())
    assert rec["cpu"].startswith("AMD") and rec["fused_head_loss"] == "on"
    rows = _table_rows("| case |\n" + training.split("\n\n", 1)[0])
    assert len(rows) == 5
    for row in rows:
        case = "train:" + row[0].split()[1]
        c = rec["cases"][case]
        assert row[1].strip().split()[0] == f"{c['ratio_erniekit_over_torch']:.2f}x", row
        mib = round(c["erniekit_peak_rss_bytes"]["median"] / 2**20)
        assert row[3].strip().replace("*", "") == f"{c['memory_ratio']:.2f}x ({mib} MiB)", row
    runs = {
        r["threads"]: r["rows"]
        for r in json.loads((ROOT / "bench_results" / "attention_recompute.json").read_text())["runs"]
    }
    rows = _table_rows("| shape |\n" + attention.split("\n\n", 1)[0])
    assert len(rows) == len(runs["2"]) == 8
    for row, two in zip(rows, runs["2"]):
        s = two["shape"]
        assert row[0].strip().startswith(f"{s['batch']} x {s['seq']}, {s['heads']} of {s['head_dim']}"), row
        assert row[2].strip().split()[0] == f"{two['ratio']:.2f}x", row
        one = next((r for r in runs["1"] if r["shape"] == s), None)
        assert row[3].strip() == (f"{one['ratio']:.2f}x" if one else ""), row


def test_the_thirteenth_round_tables_quote_their_records():
    """The memory split before the gradient change (bench_heap records), the mmap threshold's two
    runs and the training table after it: every cell as its record has it."""
    section = (ROOT / "docs" / "performance.md").read_text().split("### Thirteenth round", 1)[1].split("\n## ", 1)[0]
    heap, mmap, training = (
        section.split(head, 1)[1].split("\n\n", 1)[0]
        for head in ("| case | framework |", "  | case | speed, default |", "| case | erniekit / torch |")
    )
    rows = _table_rows("| h |\n" + heap)
    assert len(rows) == 4
    for row, (model, fw) in zip(rows, [(m, f) for m in ("dense-1024", "0.3b-2l") for f in ("torch", "erniekit")]):
        got = json.loads((ROOT / "bench_results" / f"heap_{model}_grads_kept.json").read_text())["mib"][fw]
        assert row[1].strip() == fw, row
        keys = ("peak_rss", "import_rss", "live_growth", "beyond_live")
        assert [int(c) for c in row[2:]] == [round(got[k]) for k in keys], row
    rows = _table_rows("| h |\n" + "\n".join(line.strip() for line in mmap.splitlines()))
    runs = {
        k: json.loads((ROOT / "bench_results" / f"vs_torch_amd_round13_grads_kept{k}.json").read_text())["cases"]
        for k in ("", "_mmap64")
    }
    assert len(rows) == 2
    for row in rows:
        case = "train:" + row[0].split()[1]
        default, mapped = runs[""][case], runs["_mmap64"][case]
        assert row[1].strip() == f"{default['erniekit_tokens_per_s']['median']:.1f} tokens/s", row
        assert row[2].strip().split()[0] == f"{mapped['erniekit_tokens_per_s']['median']:.1f}", row
        for cell, c in ((row[3], default), (row[4], mapped)):
            assert cell.strip() == f"{round(c['erniekit_peak_rss_bytes']['median'] / 2**20)} MiB", row
    # the threshold after the gradient change: its record against the training table's
    after = json.loads((ROOT / "bench_results" / "vs_torch_amd_round13_mmap64.json").read_text())["cases"]
    base = json.loads((ROOT / "bench_results" / "vs_torch_amd_round13_train.json").read_text())["cases"]
    for name, case in (("dense-1024", "train:dense-1024"), ("0.3b-2l", "train:0.3b-2l")):
        d, m = base[case], after[case]
        speed = f"{d['erniekit_tokens_per_s']['median']:.1f} -> {m['erniekit_tokens_per_s']['median']:.1f} tokens/s"
        mib = [round(c["erniekit_peak_rss_bytes"]["median"] / 2**20) for c in (d, m)]
        change = round(100 * (m["erniekit_tokens_per_s"]["median"] / d["erniekit_tokens_per_s"]["median"] - 1))
        text = " ".join(section.split())
        assert f"{name} {speed} ({change}%) for {mib[0]} -> {mib[1]} MiB" in text, (name, speed, change, mib)
    # decode and the server before and after the loading change, and the load's own peak
    text = " ".join(section.split())
    load = {
        k: json.loads((ROOT / "bench_results" / f"heap_dense-1024_load{k}.json").read_text())["mib"]["erniekit"]
        for k in ("_before", "")
    }
    assert f"peaked at {round(load['_before']['load_peak_rss'])} MiB resident against " in text
    assert f"{round(load['_before']['loaded_rss'])} after it" in text
    assert f"tensor: {round(load['']['load_peak_rss'])} MiB" in text
    for recorded, names in (("decode", ("decode-b1", "decode-b8", "server-c16")), ("infer", None)):
        got = json.loads((ROOT / "bench_results" / f"vs_torch_amd_round13_{recorded}.json").read_text())["cases"]
        names = names or ("prefill", "decode-b1", "decode-b8", "server-c16")
        peaks = " / ".join(str(round(got[c]["erniekit_peak_rss_bytes"]["median"] / 2**20)) for c in names)
        assert f"peaks {peaks} MiB" in text, (recorded, peaks)
        for c in names:
            assert f"{got[c]['ratio_erniekit_over_torch']:.2f}x" in text, (recorded, c)
    cases = {}
    for name in ("train", "long"):
        rec = json.loads((ROOT / "bench_results" / f"vs_torch_amd_round13_{name}.json").read_text())
        assert rec["cpu"].startswith("AMD") and rec["threads"] == 2 and rec["fused_head_loss"] == "on"
        cases |= rec["cases"]
    rows = _table_rows("| h |\n" + training)
    assert len(rows) == len(cases) == 5
    for row in rows:
        c = cases["train:" + row[0].split()[1]]
        assert row[1].strip() == f"{c['ratio_erniekit_over_torch']:.2f}x", row
        mib = round(c["erniekit_peak_rss_bytes"]["median"] / 2**20)
        assert row[3].strip().replace("*", "") == f"{c['memory_ratio']:.2f}x ({mib} MiB)", row


def test_the_fourteenth_round_load_table_quotes_its_records():
    """Load times before and after loading stopped drawing random weights, as the records have them."""
    section = (
        (ROOT / "docs" / "performance.md")
        .read_text()
        .split("### Fourteenth round", 1)[1]
        .split("\n## ", 1)[0]
        .split("\n### ", 1)[0]
    )
    rows = _table_rows(section)
    runs = {
        k: json.loads((ROOT / "bench_results" / f"vs_torch_amd_round14_load{k}.json").read_text())["cases"]
        for k in ("_before", "")
    }
    assert len(rows) == 2
    for row in rows:
        case = row[0].split("(")[1].rstrip(") ")
        before, now = runs["_before"][case], runs[""][case]
        cells = [c.strip().replace("*", "") for c in row[1:]]
        assert cells == [
            f"{before['erniekit_load_s']['median']:.2f} s",
            f"{now['erniekit_load_s']['median']:.2f} s",
            f"{now['torch_load_s']['median']:.2f} s",
            f"{before['load_speedup']:.2f}x",
            f"{now['load_speedup']:.2f}x",
        ], row


def test_the_fifteenth_round_table_quotes_the_avx2_records():
    """The AVX2-only host's table: the decode and server rows, then the training rows, as recorded."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    fifteenth = doc.split("### Fifteenth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = _table_rows(fifteenth)
    got = [
        json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_{part}.json").read_text())
        for part in ("decode", "train")
    ]
    cases = [case for record in got for case in record["cases"].values()]
    assert all(r["cpu"].startswith("AMD") and r["threads"] == 2 and r["repeats"] == 3 for r in got)
    assert len(rows) == len(cases) == 7
    for row, case in zip(rows, cases):
        _check_cells(row[1:4], case, row)
    for case in got[0]["cases"].values():  # auto chose the plain kernels on this CPU then
        assert all(r["packing"].startswith("packed weights off: no AVX-512") for r in case["runs"]["erniekit"])


def test_the_nineteenth_rounds_training_table_quotes_its_record():
    """The training rows after the SwiGLU change, as recorded on the AVX2 host."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Nineteenth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(section) if r[0].strip().startswith("train")]
    got = [
        json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_train_{p}.json").read_text())
        for p in ("swiglu", "03b")
    ]
    assert all(r["cpu"].startswith("AMD") and r["threads"] == 2 and r["repeats"] == 3 for r in got)
    cases = [item for record in got for item in record["cases"].items()]
    assert len(rows) == len(cases) == 4
    for row, (name, case) in zip(rows, cases):
        assert row[0].strip().startswith(name.replace(":", " ")), row
        _check_cells(row[1:4], case, row)


def test_the_sixteenth_round_tables_quote_the_avx2_runs():
    """Packed (the default) and unpacked side by side, then the run after the attention's change, as
    recorded; auto packed in the packed runs."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    sixteenth = doc.split("### Sixteenth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(sixteenth) if r[0].strip().startswith(("greedy", "server"))]
    rows, after = [r for r in rows if len(r) == 7], [r for r in rows if len(r) == 4]
    got = [
        json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_{part}.json").read_text())
        for part in ("packed", "unpacked")
    ]
    assert [r["packed_weights"] for r in got] == ["auto", "off"]
    assert all(r["cpu"].startswith("AMD") and r["threads"] == 2 and r["repeats"] == 3 for r in got)
    assert len(rows) == 5 and all(list(r["cases"]) == list(got[0]["cases"]) for r in got)
    for row, *cases in zip(rows, *(r["cases"].values() for r in got)):
        for i, case in enumerate(cases):
            _check_cells(row[1 + 3 * i : 4 + 3 * i], case, row)
        assert all(r["packing"].startswith("packed weights on") for r in cases[0]["runs"]["erniekit"])
        assert all(r["packing"].startswith("packed weights off") for r in cases[1]["runs"]["erniekit"])
    # the run after the decode attention's change (3f02a22): packed by default, its own table
    record = json.loads((ROOT / "bench_results" / "vs_torch_amd_avx2_decode_attention.json").read_text())
    assert record["packed_weights"] == "auto" and record["cpu"].startswith("AMD") and record["repeats"] == 3
    assert len(after) == len(record["cases"]) == 5
    for row, case in zip(after, record["cases"].values()):
        _check_cells(row[1:4], case, row)
        assert all(r["packing"].startswith("packed weights on") for r in case["runs"]["erniekit"])


@pytest.mark.parametrize(
    "heading,recorded",
    [
        ("Seventeenth round", "vs_torch_amd_avx2_decode_step"),
        ("Eighteenth round", "vs_torch_amd_avx2_streamed"),
        ("Nineteenth round", "vs_torch_amd_avx2_rope_rows"),
    ],
)
def test_the_decode_rounds_tables_quote_their_two_runs(heading, recorded):
    """The decode step's and the streamed kernel's two runs side by side, as recorded: packed by
    default on the AVX2 host."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split(f"### {heading}", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(section) if r[0].strip().startswith(("greedy", "server"))]
    got = [json.loads((ROOT / "bench_results" / f"{recorded}{tail}.json").read_text()) for tail in ("", "_2")]
    assert all(r["packed_weights"] == "auto" and r["cpu"].startswith("AMD") and r["repeats"] == 3 for r in got)
    assert len(rows) == 5 and all(len(r) == 7 for r in rows)
    for row, *cases in zip(rows, *(r["cases"].values() for r in got)):
        for i, case in enumerate(cases):
            _check_cells(row[1 + 3 * i : 4 + 3 * i], case, row)
            assert all(r["packing"].startswith("packed weights on") for r in case["runs"]["erniekit"])


def test_the_twentieth_rounds_moe_decode_table_quotes_its_two_runs():
    """A MoE model's decode (decode-moe-b1 / b8 on moe16-top4) as the tool recorded it, twice."""
    assert B._model_of("decode-moe-b8") == "moe16-top4" and B._model_of("decode-b8") == "dense-1024"
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twentieth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(section) if r[0].strip().startswith("greedy")]
    tails = ("", "_2")
    got = [json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_moe_decode{t}.json").read_text()) for t in tails]
    assert all(list(r["cases"]) == ["decode-moe-b1", "decode-moe-b8"] and r["repeats"] == 3 for r in got)
    assert len(rows) == 2
    for row, *cases in zip(rows, *(r["cases"].values() for r in got)):
        for i, case in enumerate(cases):
            _check_cells(row[1 + 3 * i : 4 + 3 * i], case, row)
            assert all(r["packing"].startswith("packed weights on") for r in case["runs"]["erniekit"])
    before = json.loads((ROOT / "bench_results" / "vs_torch_amd_avx2_moe_decode_before.json").read_text())["cases"]
    quoted = [f"**{before[c]['ratio_erniekit_over_torch']:.2f}x**" for c in ("decode-moe-b1", "decode-moe-b8")]
    assert all(q in section for q in quoted), quoted  # the commit before, as the text quotes it


def test_the_twenty_first_rounds_tiny_decode_table_quotes_its_two_runs():
    """The embedded default's model's decode (decode-tiny-b1 / b8 on tiny-moe) as recorded, twice."""
    assert B._model_of("decode-tiny-b1") == "tiny-moe" and "decode-tiny-b8" in B.CASES
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twenty-first round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(section) if r[0].strip().startswith("greedy")]
    got = [
        json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_tiny_decode{t}.json").read_text()) for t in ("", "_2")
    ]
    assert all(list(r["cases"]) == ["decode-tiny-b1", "decode-tiny-b8"] and r["repeats"] == 3 for r in got)
    assert len(rows) == 2
    for row, *cases in zip(rows, *(r["cases"].values() for r in got)):
        for i, case in enumerate(cases):
            _check_cells(row[1 + 3 * i : 4 + 3 * i], case, row)
    before = json.loads((ROOT / "bench_results" / "vs_torch_amd_avx2_tiny_decode_before.json").read_text())["cases"]
    quoted = [f"**{before[c]['ratio_erniekit_over_torch']:.2f}x**" for c in ("decode-tiny-b1", "decode-tiny-b8")]
    assert all(q in section for q in quoted), quoted


def test_the_vl_case_runs_both_frameworks_on_one_checkpoint(tmp_path, monkeypatch):
    """decode-vl-b1 on a VL checkpoint transformers wrote (a smaller one here): both frameworks
    generate after the same image prompt, erniekit after checking its logits against theirs."""
    import copy

    small = copy.deepcopy(B.VL_CONFIG)
    small["text_config"].update(hidden_size=64, intermediate_size=96, num_attention_heads=2, head_dim=32)
    small["text_config"].update(
        moe_intermediate_size=[32, 16],
        rope_parameters=dict(small["text_config"]["rope_parameters"], mrope_section=[6, 6, 4]),
    )
    monkeypatch.setattr(B, "VL_CONFIG", small)
    monkeypatch.setattr(B, "DECODE_NEW", 3)
    assert B._model_of("decode-vl-b1") == B.VL_MODEL and "decode-vl-b1" in B.CASES
    path = str(tmp_path / B.VL_MODEL)
    B.write_checkpoint(B.VL_MODEL, path)
    t = B.torch_case("decode-vl-b1", path, 1, 1)  # writes the reference logits
    e = B.erniekit_case("decode-vl-b1", path, 1)
    assert (tmp_path / B.VL_MODEL / "torch_logits.npy").is_file() and t["tokens_per_s"] > 0 and e["tokens_per_s"] > 0
    ids, pixels, grid = B._vl_prompt()
    assert 4 * int((ids == B.VL_IDS["image_token_id"]).sum()) == int(np.prod(grid[0])) == pixels.shape[0]
    np.save(tmp_path / B.VL_MODEL / "torch_logits.npy", np.load(tmp_path / B.VL_MODEL / "torch_logits.npy") + 1.0)
    with pytest.raises(SystemExit, match="logits differ"):
        B.erniekit_case("decode-vl-b1", path, 1)


def test_the_twenty_second_rounds_vl_decode_table_quotes_its_two_runs():
    """A VL model's decode after an image (decode-vl-b1 on vl-moe16) as recorded, twice."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twenty-second round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [r for r in _table_rows(section) if r[0].strip().startswith("greedy")]
    got = [
        json.loads((ROOT / "bench_results" / f"vs_torch_amd_avx2_vl_decode{t}.json").read_text()) for t in ("", "_2")
    ]
    assert all(list(r["cases"]) == ["decode-vl-b1"] and r["repeats"] == 3 for r in got)
    assert len(rows) == 1
    for i, case in enumerate(r["cases"]["decode-vl-b1"] for r in got):
        _check_cells(rows[0][1 + 3 * i : 4 + 3 * i], case, rows[0])
    before = json.loads((ROOT / "bench_results" / "vs_torch_amd_avx2_vl_decode_before.json").read_text())["cases"]
    assert f"**{before['decode-vl-b1']['ratio_erniekit_over_torch']:.2f}x**" in section


def test_the_server_case_runs_the_engine_over_the_whole_vocabulary(monkeypatch):
    """The server case on a small model whose ids run past the bundled tokenizer's 1024 pieces: the
    engine takes the wrapped tokenizer (its length is the model's vocabulary) and every request
    finishes (the case once failed at the engine's start, so the benchmark stopped there)."""
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config
    from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM

    paddle = pytest.importorskip("paddle")
    paddle.seed(0)
    cfg = Ernie4_5Config(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    monkeypatch.setattr(B, "SERVER_NEW", 4)
    res = B._erniekit_server(Ernie4_5ForCausalLM(cfg), 2)
    assert res["tokens_per_s"] > 0


def test_the_twenty_third_rounds_intel_table_quotes_its_record():
    """The Intel Xeon table of the twenty-third round: every case of the recorded run, as written."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twenty-third round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    _check_table(section, "vs_torch_intel_xeon_round23.json", 15)


def test_the_twenty_fourth_rounds_tables_quote_their_records():
    """The twenty-fourth round's three tables (before, after the fused sums, the decode and server
    cases after both commits): every case of each recorded run, as written."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twenty-fourth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    parts = section.split("\n**")
    tables = {"Before": ("vs_torch_intel_round24_before.json", 4), "After": ("vs_torch_intel_round24_fma.json", 4)}
    tables["The decode and server cases"] = ("vs_torch_intel_xeon_round24.json", 7)
    for title, (recorded, n) in tables.items():
        (part,) = [p for p in parts if p.startswith(title)]
        _check_table(part, recorded, n)


def test_the_twenty_fifth_rounds_table_quotes_its_record():
    """The twenty-fifth round's decode and server cases: every case of the recorded run, as written."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("### Twenty-fifth round", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    (part,) = [p for p in section.split("\n**") if p.startswith("The decode and server cases after this round")]
    _check_table(part, "vs_torch_intel_xeon_round25.json", 7)
