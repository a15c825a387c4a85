"""Expert parallelism's all-to-all token exchange (erniekit/distributed/collective/expert_exchange.py,
StackedExperts' expert-parallel forward): the pairing schedule, the reordering of received rows,
and 2 processes against the same layer run whole."""

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from launched_jobs import run_two_rank_script

from erniekit.distributed.collective.expert_exchange import pair_rounds
from erniekit.nn.moe import source_to_expert_order

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("n", range(1, 10))
def test_pair_rounds_meet_every_pair_once_and_no_rank_twice_in_a_round(n):
    rounds = pair_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) or n == 1


def test_source_to_expert_order_matches_a_naive_regrouping():
    rng = np.random.default_rng(0)
    for _ in range(20):
        S, E = rng.integers(1, 5), rng.integers(1, 5)
        blocks = rng.integers(0, 4, size=(S, E))
        # label each received row (source, expert, position) in source-major order
        rows = [(s, e, i) for s in range(S) for e in range(E) for i in range(blocks[s, e])]
        want = sorted(range(len(rows)), key=lambda j: (rows[j][1], rows[j][0], rows[j][2]))
        np.testing.assert_array_equal(source_to_expert_order(blocks), np.array(want, dtype="int64"))


def test_two_process_expert_parallel_layer_equals_the_whole_layer(tmp_path):
    """Outputs and gradients (input, gate weights, every expert parameter, DoRA adapters too) for
    random routing, routing that never leaves a rank, one-way routing (a rank receives nothing)
    and capacity drops."""
    run_two_rank_script(os.path.join(ROOT, "tests", "e2e", "ep_exchange_worker.py"), tmp_path, ROOT)
    for rank in (0, 1):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        assert len(result) == 8
        for case, diffs in result.items():
            assert len(diffs) >= 6, case  # y, x, gate weights, 3 expert projections (+ adapters)
            for name, d in diffs.items():
                assert d < 1e-4, f"{case} {name}: {d}"
