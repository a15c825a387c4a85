"""Fixtures shared by the checkpoint-loading tests."""

from types import SimpleNamespace

import pytest


@pytest.fixture
def shard_maps(monkeypatch):
    """Records each shard mapping the checkpoint reader opens (`opened`) and drops (`dropped`)."""
    from erniekit.models.ernie4_5 import checkpoint

    seen = SimpleNamespace(opened=[], dropped=[])
    real_open = checkpoint.open_safetensors

    def counting_open(file):
        h = real_open(file)
        seen.opened.append(file)
        real_exit = h.__exit__
        h.__exit__ = lambda *exc: seen.dropped.append(file) or real_exit(*exc)
        return h

    monkeypatch.setattr(checkpoint, "open_safetensors", counting_open)
    return seen
