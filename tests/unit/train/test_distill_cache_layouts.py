"""The pieces that carry stage: Distill into the layouts that split the student (docs/distillation.md,
"Parallel layouts"), each against the 1-process computation: the per-position form of the cached
teacher (DistTensor layouts), the loss as token log-probability terms through a head computed like
the parameter servers' (PS workers), the other ranks' wait for rank 0's cache, and the config rules.
The 2-process runs themselves are tests/e2e/test_distill_layouts.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from erniekit.config import load_config, validate
from erniekit.errors import ConfigError
from erniekit.train.distill_cache import build_cache, open_cache, wait_for_cache
from erniekit.train.distill_losses import (
    aligned_distill_loss_sum,
    aligned_topk,
    distill_loss_sum,
    gather_positions,
    top_k,
    trained_positions,
)

ROOT = Path(__file__).resolve().parents[3]
V, H = 23, 6


def _labels(seed: int, B: int = 3, S: int = 9) -> np.ndarray:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, V, (B, S))
    labels[:, :3] = -100  # prompts
    labels[1, 6:] = -100  # padding
    return labels


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("k,T", [(5, 1.0), (5, 2.0), (V, 1.5)])
def test_the_per_position_teacher_gives_the_gathered_loss_and_gradient(kind, k, T):
    rng = np.random.default_rng(1)
    labels = _labels(1)
    zs = rng.normal(size=labels.shape + (V,)).astype(np.float32) * 3
    zt = rng.normal(size=labels.shape + (V,)).astype(np.float32) * 3
    flat = trained_positions(labels)
    top = top_k(gather_positions(paddle.to_tensor(zt), flat), k, T)
    a = paddle.to_tensor(zs, stop_gradient=False)
    want = distill_loss_sum(a, labels, top, kind, 0.3, T)
    want.backward()
    per = aligned_topk(top, labels)
    assert per.ids.shape == labels.shape + (k,)
    weight = np.zeros(labels.shape, np.float32)
    weight.reshape(-1)[flat] = 1.0
    b = paddle.to_tensor(zs, stop_gradient=False)
    got = aligned_distill_loss_sum(
        b, paddle.to_tensor(per.ids), paddle.to_tensor(per.logp), paddle.to_tensor(weight), kind, 0.3, T
    )
    got.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), a.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert np.abs(b.grad.numpy().reshape(-1, V)[np.setdiff1d(np.arange(labels.size), flat)]).max() == 0.0


def test_a_per_position_teacher_of_other_positions_is_refused():
    labels = _labels(2)
    top = top_k(paddle.ones([3, V]), 4)
    with pytest.raises(ValueError, match="has 3 positions for a batch with"):
        aligned_topk(top, labels)


class _Head:
    """One block of the parameter servers' head, in process, by the arithmetic of
    erniekit/distributed/ps/server.py (`_head`, `_head_back`) and worker.py (`head_loss`): the
    log-sum-exp and target logit of each row, then coef x (softmax - one-hot) back through W."""

    data_ranks = 1

    def __init__(self, w: np.ndarray):
        self.w = paddle.to_tensor(w)

    def head_loss(self, h: paddle.Tensor, target: np.ndarray):
        z = paddle.matmul(h, self.w, transpose_y=True)
        zn = z.numpy().astype(np.float64)
        top = zn.max(1)
        lse = top + np.log(np.exp(zn - top[:, None]).sum(1))
        self.ctx = (z, target)
        return lse - zn[np.arange(len(target)), target], lse

    def head_backward(self, lse: np.ndarray, coef: np.ndarray) -> paddle.Tensor:
        z, target = self.ctx
        p = np.exp(z.numpy() - lse[:, None].astype(np.float32))
        p[np.arange(len(target)), target] -= 1.0
        return paddle.matmul(paddle.to_tensor(p * coef[:, None].astype(np.float32)), self.w)


def _cached_stage(tmp_path: Path, alpha: float, T: float, k: int):
    """A Distill stage reading a real cache built from random teacher logits, and a batch of its rows."""
    from erniekit.train.batching import collate
    from erniekit.train.stages.distill import DistillStage

    rng = np.random.default_rng(3)
    labels = _labels(3, B=4)
    rows, teacher = [], {}
    for n, lab in enumerate(labels):
        rows.append({"input_ids": rng.integers(0, V, len(lab)), "labels": lab, "row_index": np.array(n)})
        teacher[n] = rng.normal(size=(len(lab), V)).astype(np.float32) * 3

    def batch_topk(part):
        z = np.concatenate([teacher[int(r["row_index"])][trained_positions(r["labels"][None])] for r in part])
        return top_k(paddle.to_tensor(z), k, T)

    want = {"k": k, "rows": "random"}
    stage = DistillStage()
    stage.cfg = SimpleNamespace(distill_alpha=alpha, distill_temperature=T, distill_loss="jsd", distill_beta=0.3)
    stage.vocab = V
    stage.cache = build_cache(str(tmp_path / "cache"), want, rows, batch_topk, 3)
    batch = collate(rows, 0)
    batch["row_index"] = np.arange(len(rows))
    return stage, batch


@pytest.mark.parametrize("alpha,T", [(1.0, 2.0), (0.0, 1.0), (0.6, 1.0), (0.6, 2.0)])
@pytest.mark.parametrize("k", [5, V])
def test_the_loss_as_token_terms_through_the_servers_head_is_the_logits_loss(tmp_path, alpha, T, k):
    """PSRunner._terms_loss_and_grad (one head request per temperature, each trained position sent
    once per token) gives the loss and the hidden states' gradient of the loss on whole logits."""
    from erniekit.train.runners.ps import PSRunner

    stage, batch = _cached_stage(tmp_path, alpha, T, k)
    B, S = batch["labels"].shape
    rng = np.random.default_rng(4)
    w = rng.normal(size=(V, H)).astype(np.float32)
    h0 = rng.normal(size=(B, S, H)).astype(np.float32)

    h = paddle.to_tensor(h0, stop_gradient=False)
    want = stage.logits_loss(paddle.matmul(h, paddle.to_tensor(w), transpose_y=True), batch)
    want.backward()

    runner = PSRunner(_Head(w), token_balance=False)
    h2 = paddle.to_tensor(h0, stop_gradient=False)
    flat = trained_positions(batch["labels"], batch["segment_ids"])
    sel = paddle.gather(h2.reshape([-1, H]), paddle.to_tensor(flat))
    terms = stage.token_logp_terms(batch)
    assert len(terms) == (2 if 0 < alpha < 1 and T != 1 else 1)
    total, tensors, grads = runner._terms_loss_and_grad(sel, terms, 1.0, 1.0)
    paddle.autograd.backward(tensors, grads)
    assert total == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(h2.grad.numpy(), h.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_other_ranks_wait_for_the_cache_rank_0_renames_into_place(tmp_path):
    rows = [{"input_ids": np.arange(6), "labels": np.array([-100, -100, 3, 4, 5, 6])}]
    want = {"k": 2}
    src = tmp_path / "built"
    build_cache(str(src), want, rows, lambda part: top_k(paddle.ones([4, V]), 2), 1)
    target = tmp_path / "cache"

    def later():
        time.sleep(0.5)
        os.rename(src, target)  # as build_cache finishes: one rename of a complete directory

    t = threading.Thread(target=later)
    t.start()
    got = wait_for_cache(str(target), want, timeout_s=30, poll_s=0.05)
    t.join()
    np.testing.assert_array_equal(got.offsets, open_cache(str(target), want).offsets)
    with pytest.raises(ConfigError, match="stale") as e:  # another build's cache: the same refusal as rank 0's
        wait_for_cache(str(target), {"k": 3}, timeout_s=1)
    with pytest.raises(ConfigError, match=r"nowhere did not appear within 0 s .*\(launch_logs/") as e:
        wait_for_cache(str(tmp_path / "nowhere"), want, timeout_s=0.2, poll_s=0.05)
    assert "\n" not in str(e.value)


def test_a_cache_another_job_finished_first_is_kept(tmp_path):
    """Two jobs building the same cache (clusters on one machine): the second's rename finds the first's
    directory; it keeps that one (same fingerprint) and refuses one built from something else."""
    rows = [{"input_ids": np.arange(6), "labels": np.array([-100, -100, 3, 4, 5, 6])}]
    target = str(tmp_path / "cache")
    first = build_cache(target, {"k": 2}, rows, lambda part: top_k(paddle.ones([4, V]), 2), 1)
    second = build_cache(target, {"k": 2}, rows, lambda part: top_k(paddle.zeros([4, V]), 2), 1)
    np.testing.assert_array_equal(second.offsets, first.offsets)
    assert sorted(os.listdir(tmp_path)) == ["cache"]  # the loser's temporary directory is gone
    with pytest.raises(ConfigError, match="stale"):
        build_cache(target, {"k": 3}, rows, lambda part: top_k(paddle.ones([4, V]), 3), 1)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    from erniekit.models import registry

    out = str(tmp_path_factory.mktemp("teacher") / "t")
    small = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}
    registry.save_model(
        registry.load_model("tiny-dense", small), out, registry.family_of("tiny-dense").default_tokenizer()
    )
    return out


def _cfg(teacher: str, tmp_path: Path, *overrides: str):
    data = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
    return validate(
        load_config(
            None,
            [
                "stage=Distill",
                f"teacher_name_or_path={teacher}",
                "model_name_or_path=tiny-moe",
                "model_overrides.num_hidden_layers=2",
                f"train_dataset_path={data}",
                "do_eval=false",
                f"output_dir={tmp_path / 'out'}",
                *overrides,
            ],
        )
    )


SPLIT = {
    "tp=2": ["tensor_parallel_degree=2"],
    "pp=2": ["pipeline_parallel_degree=2"],
    "sharding stage1": ["sharding=stage1"],
    "ep=2": ["expert_parallel_degree=2"],
    "distributed_mode=ps": ["distributed_mode=ps"],
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_layouts_that_split_the_student_read_the_cache_and_refuse_on_policy_steps(teacher_dir, tmp_path, name):
    layout = ["nproc_per_node=2", *SPLIT[name]]
    cache = f"teacher_topk_cache={tmp_path / 'cache'}"
    assert _cfg(teacher_dir, tmp_path, *layout, cache).teacher_topk_cache == str(tmp_path / "cache")
    with pytest.raises(ConfigError, match=f"stage Distill with .*{name}.* set teacher_topk_cache=DIR") as e:
        _cfg(teacher_dir, tmp_path, *layout)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"on_policy_ratio=0.5: .* not .*{name}; set on_policy_ratio=0"):
        _cfg(teacher_dir, tmp_path, *layout, cache, "on_policy_ratio=0.5", "max_new_tokens=4")


def test_one_process_and_plain_data_parallelism_keep_the_teacher_in_memory(teacher_dir, tmp_path):
    for layout in ([], ["nproc_per_node=2"]):  # no cache needed, on-policy steps allowed
        cfg = _cfg(teacher_dir, tmp_path, *layout, "on_policy_ratio=0.5", "max_new_tokens=4")
        assert cfg.teacher_topk_cache is None
