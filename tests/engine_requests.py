"""Requests through the built-in engine, waited for: shared by the engine's unit tests."""

from __future__ import annotations

import threading


def submit_and_wait(engine, reqs: list, timeout: float = 120.0) -> list:
    """Submit every request at once (so they can share decode steps) and wait until each finished;
    the requests, filled in by the engine."""
    done = [threading.Event() for _ in reqs]
    for r, d in zip(reqs, done):
        r.emit = lambda _t, f, d=d: d.set() if f is not None else None
        engine.submit(r)
    for d in done:
        assert d.wait(timeout), f"a request did not finish within {timeout} s"
    return reqs
