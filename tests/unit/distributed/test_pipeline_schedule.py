"""The 1F1B schedule (erniekit/train/pipeline_schedule.py), simulated with gloo's semantics: a
send completes only when the peer posts the matching receive. Every stage must finish (no
deadlock, both ends of each link agree on the message order) and stage s may hold at most
min(P - s, M) micro-batches' activations: the point of 1F1B over GPipe's M."""

from __future__ import annotations

import pytest

from erniekit.distributed.collective.pipeline import stage_bounds
from erniekit.train.pipeline_schedule import one_f_one_b


def _events(pp: int, s: int, m: int) -> list[tuple]:
    """A stage's operations as primitive events: compute, or a blocking send/recv of a message."""
    out = []
    for op, i in one_f_one_b(pp, s, m):
        if op == "F":
            if s > 0:
                out.append(("recv", s - 1, ("act", i)))
            out.append(("fwd", i))
        elif op == "SEND_F":
            out.append(("send", s + 1, ("act", i)))
        elif op == "RECV_B":
            out.append(("recv", s + 1, ("grad", i)))
        else:
            out.append(("bwd", i))
            if s > 0:
                out.append(("send", s - 1, ("grad", i)))
    return out


def simulate(pp: int, m: int) -> list[int]:
    """Run all stages in lock-step rendezvous; return each stage's peak of live activations."""
    ev = [_events(pp, s, m) for s in range(pp)]
    pos, live, peak = [0] * pp, [0] * pp, [0] * pp
    while any(pos[s] < len(ev[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if pos[s] >= len(ev[s]):
                continue
            e = ev[s][pos[s]]
            if e[0] in ("fwd", "bwd"):
                live[s] += 1 if e[0] == "fwd" else -1
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                moved = True
            elif e[0] == "send":
                peer = e[1]
                if pos[peer] < len(ev[peer]) and ev[peer][pos[peer]][0] == "recv" and ev[peer][pos[peer]][1] == s:
                    assert ev[peer][pos[peer]][2] == e[2], (
                        f"stage {s} sends {e[2]}, stage {peer} waits for {ev[peer][pos[peer]][2]}"
                    )
                    pos[s] += 1
                    pos[peer] += 1
                    moved = True
        assert moved, (
            f"deadlock: pp={pp} m={m} at {[ev[s][pos[s]] if pos[s] < len(ev[s]) else None for s in range(pp)]}"
        )
    return peak


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_1f1b_finishes_and_bounds_the_live_activations(pp, m):
    peak = simulate(pp, m)
    assert peak == [min(pp - s, m) for s in range(pp)]
    for s in range(pp):  # every micro-batch forward and backward exactly once, backward after forward
        ops = one_f_one_b(pp, s, m)
        f = [i for op, i in ops if op == "F"]
        b = [i for op, i in ops if op == "B"]
        assert f == list(range(m)) and b == list(range(m))
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))


def test_gpipe_order_would_deadlock_with_blocking_sends():
    """The plain order (send the newest activation, then receive the oldest gradient) is what
    the simulation must catch: both neighbours send at once."""
    import erniekit.train.pipeline_schedule as ps

    def naive(pp, s, m):
        ops = ps.one_f_one_b(pp, s, m)
        out = []
        for k, op in enumerate(ops):  # swap RECV_B/SEND_F pairs back to send-first
            if op[0] == "RECV_B" and k + 1 < len(ops) and ops[k + 1][0] == "SEND_F":
                continue
            out.append(op)
            if op[0] == "SEND_F" and k > 0 and ops[k - 1][0] == "RECV_B":
                out.append(ops[k - 1])
        return out

    orig = ps.one_f_one_b
    globals()["one_f_one_b"] = naive
    try:
        with pytest.raises(AssertionError, match="deadlock"):
            simulate(2, 4)
    finally:
        globals()["one_f_one_b"] = orig


def test_stage_bounds_split_layers_contiguously():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(5, 2) == [(0, 2), (2, 5)]  # the extra layer goes to the later stage
    assert stage_bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
