"""DataReplicas' gradient sum (erniekit/distributed/collective/replicas.py) with the collective
replaced by what two identical ranks would give (x2), and its row split."""

import numpy as np
import paddle
import pytest

from erniekit.distributed.collective import replicas as R


@pytest.fixture
def two_equal_ranks(monkeypatch):
    calls = []

    def all_reduce(t, group=None):
        calls.append(tuple(t.shape))
        paddle.assign(t * 2, output=t)

    monkeypatch.setattr(R.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(R, "HostSum", lambda *a, **k: None)  # gloo's path (the shared-memory one: test_host_sum)
    return calls


def _param(shape, seed):
    p = paddle.create_parameter(shape, "float32")
    p.set_value(paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32")))
    return p


def test_gradients_and_values_are_summed_in_one_all_reduce(two_equal_ranks):
    ps = [_param([3, 4], 0), _param([5], 1), _param([2, 2], 2)]
    (ps[0] * ps[0]).sum().backward()
    (ps[1] * 3).sum().backward()  # ps[2] gets no gradient on this rank
    want = [2 * p.grad.numpy().copy() for p in ps[:2]]
    held = ps[0].grad  # summed in place: the optimizer's tensor is the one updated
    out = R.DataReplicas(2, 0).all_reduce(ps, [1.5, 0.25, 7.0])
    assert two_equal_ranks == [(12 + 5 + 4 + 3,)]  # one flat buffer: 3 gradients and 3 values
    np.testing.assert_array_equal(held.numpy(), want[0])
    np.testing.assert_array_equal(ps[1].grad.numpy(), want[1])
    np.testing.assert_array_equal(ps[2].grad.numpy(), np.zeros([2, 2], "float32"))  # same sizes on every rank
    assert out == [3.0, 0.5, 14.0]


def test_non_float32_gradients_travel_apart_and_values_with_float32(two_equal_ranks):
    a, b = _param([4], 0), paddle.create_parameter([3], "float64")
    (a * 2).sum().backward()
    (b * 5).sum().backward()
    out = R.DataReplicas(2, 1).all_reduce([a, b], [1.0])
    assert sorted(two_equal_ranks) == [(3,), (4 + 1,)]
    np.testing.assert_array_equal(a.grad.numpy(), np.full(4, 4.0, "float32"))
    np.testing.assert_array_equal(b.grad.numpy(), np.full(3, 10.0))
    assert out == [2.0]


def test_each_rank_takes_its_rows_and_an_uneven_batch_whole_at_a_share():
    batch = {"input_ids": np.arange(8).reshape(4, 2), "labels": np.arange(8).reshape(4, 2)}
    rows, w = R.DataReplicas(2, 1).local_rows(batch)
    assert w == 1.0 and rows["input_ids"].tolist() == [[4, 5], [6, 7]]
    rows, w = R.DataReplicas(3, 2).local_rows(batch)
    assert w == pytest.approx(1 / 3) and rows["input_ids"].shape == (4, 2)


def test_a_job_without_cpu_float32_gradients_keeps_the_process_group_s_sum():
    frozen = _param([4], 0)
    frozen.stop_gradient = True
    assert R.host_floats([frozen, paddle.create_parameter([3], "float64")]) == 0
    assert R.host_floats([_param([2, 3], 1), frozen]) == 6 + R._VALUES
    rep = R.DataReplicas(2, 0)
    assert rep.choose_transport(0) == "the process group's all-reduce" and rep.host is None
