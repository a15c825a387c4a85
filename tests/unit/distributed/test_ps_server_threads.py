"""The parameter server's threads beside a pipeline (erniekit/distributed/ps/server.py): at STEP every
worker gets the squared norm of the gradients as summed, never of a sum another thread is clipping."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import paddle

from erniekit.distributed.ps.server import EMBED, ParameterServer
from erniekit.distributed.ps.topology import STEP, STOP

_serving = threading.local()  # which worker's link the current server thread serves


class FakeLink:
    """One worker's end as the server sees it: a STEP, then STOP; worker 0 sends (norm, lr)."""

    def __init__(self, w: int, norm: float):
        self.w, self.norm = w, norm
        self.headers = [(STEP, 0), (STOP, 0)]
        self.sent: list[np.ndarray] = []

    def recv_header(self):
        _serving.worker = self.w
        return self.headers.pop(0)

    def send_array(self, a):
        self.sent.append(np.array(a))

    def recv_array(self, shape, dtype):
        return np.array([self.norm, 0.1], dtype=dtype)


class RecordingOptimizer:
    def __init__(self, rows):
        self.rows = dict(rows)
        self.grads = None

    def set_lr(self, lr):
        self.lr = lr

    def step(self, grads):
        self.grads = {n: grads[id(p)].numpy().copy() for n, p in self.rows.items()}


def test_a_slow_thread_answers_the_norm_of_the_unclipped_sum(monkeypatch):
    """Worker 1's thread reaches its answer late (after thread 0 has clipped the sum in place for
    the update): it must still send the norm both threads agreed on at the meet."""
    vocab, hidden, norm = 6, 4, 10.0
    links = [FakeLink(0, norm), FakeLink(1, norm)]
    topo = SimpleNamespace(workers=2, servers=1, server_index=0, pipe=object(), link=lambda w: links[w])
    cfg = SimpleNamespace(ps_sync_mode="sync", max_grad_norm=1.0, ps_compress="none")
    tables = {EMBED: np.zeros([vocab, hidden], "float32")}
    server = ParameterServer(topo, tables, cfg, RecordingOptimizer, stop_signal=lambda: 0)
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal([vocab, hidden]).astype("float32") for _ in range(2)]
    for w in range(2):
        server.grads[w][EMBED] = paddle.to_tensor(parts[w])
    answer = ParameterServer._step_answer

    def slow_for_worker_1(self, acc):
        if getattr(_serving, "worker", 0) == 1:
            time.sleep(0.3)
        return answer(self, acc)

    monkeypatch.setattr(ParameterServer, "_step_answer", slow_for_worker_1)
    server.serve()

    total = paddle.to_tensor(parts[0]) + paddle.to_tensor(parts[1])  # worker order, as the server sums
    expect_sq = float(paddle.sum(total**2))
    for link in links:
        assert len(link.sent) == 1
        assert link.sent[0][0] == expect_sq  # the same bits for every worker
    np.testing.assert_allclose(server.opt.grads[EMBED], total.numpy() * (1.0 / (norm + 1e-6)), rtol=1e-6)
