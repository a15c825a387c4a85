"""The cross_cluster_* keys (docs/cross_cluster.md): what is accepted, and one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest

from erniekit.config import TrainConfig, validate
from erniekit.errors import ConfigError

KEY = "k" * 32


def cfg(**kw) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **kw)


def test_clusters_on_this_machine_take_their_process_count_from_the_sizes():
    c = validate(cfg(cross_cluster_sizes=[2, 2], cross_cluster_compress="ADAPTIVE", cross_cluster_sync="Gradients"))
    assert (c.nproc_per_node, c.cross_cluster_compress, c.cross_cluster_sync) == (2, "adaptive", "gradients")
    assert c.cross_cluster.cross_cluster_sizes == [2, 2]  # its own config section


def test_a_site_needs_its_peers_and_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("ERNIEKIT_CROSS_CLUSTER_KEY", raising=False)
    peers = ["127.0.0.1:29600", "10.0.0.2:29600"]
    with pytest.raises(ConfigError, match="ERNIEKIT_CROSS_CLUSTER_KEY") as e:
        validate(cfg(cross_cluster_id=1, cross_cluster_peers=peers))
    assert "\n" not in str(e.value)
    monkeypatch.setenv("ERNIEKIT_CROSS_CLUSTER_KEY", KEY)
    assert validate(cfg(cross_cluster_id=1, cross_cluster_peers=peers)).cross_cluster_id == 1
    with pytest.raises(ConfigError) as e:
        validate(cfg(cross_cluster_id=1, cross_cluster_peers=["127.0.0.1:29600", "nohost"]))
    assert "cross_cluster_peers[1]" in str(e.value) and KEY not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"cross_cluster_sizes": [2, 1]}, "same process count"),
        ({"cross_cluster_sizes": [2]}, "at least 2 clusters"),
        ({"cross_cluster_sizes": [2, 2], "nproc_per_node": 4}, "drop nproc_per_node or set it to 2"),
        ({"cross_cluster_id": 0}, "give host:port of every cluster"),
        ({"cross_cluster_id": 2, "cross_cluster_peers": ["a:1", "b:2"]}, "cross_cluster_id=2"),
        ({"cross_cluster_sync_every": 4, "cross_cluster_overlap_steps": 4}, "below cross_cluster_sync_every=4"),
        ({"cross_cluster_topk_ratio": 0.0}, "cross_cluster_topk_ratio=0.0"),
        ({"cross_cluster_outer_momentum": 1.0}, "cross_cluster_outer_momentum"),
        ({"cross_cluster_link_mbit": -1.0}, "cross_cluster_link_mbit"),
        ({"save_total_limit": 1}, "save_total_limit >= 2"),
        ({"distributed_mode": "ps", "nproc_per_node": 2, "do_eval": False}, "distributed_mode=collective"),
        ({"stage": "GRPO"}, "RL stages"),
        ({"cross_cluster_compress": "fp4"}, "cross_cluster_compress"),
    ],
)
def test_refusals_are_one_line(overrides, message, monkeypatch):
    monkeypatch.setenv("ERNIEKIT_CROSS_CLUSTER_KEY", KEY)
    base = {"cross_cluster_sizes": [2, 2]}
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg(**{**base, **overrides}))
    assert "\n" not in str(e.value)
