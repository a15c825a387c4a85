"""The store a gloo process group forms through (collective/pipeline.py _host_store): it listens
before its address goes to the members, so none of them connects too early (Paddle retries such a
client only 3 s later); an address that is not this host's is a one-line error, not a hang."""

from __future__ import annotations

import socket

import pytest
from paddle.base import core

from erniekit.distributed.collective.pipeline import _host_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_store_listens_when_it_returns_and_serves_its_members():
    port = _free_port()
    wait = _host_store("127.0.0.1", port, 2)
    socket.create_connection(("127.0.0.1", port), timeout=1).close()  # listening already
    member = core.TCPStore("127.0.0.1", port, False, 2, 60)
    host = wait()
    host.set("k", "v")
    assert member.get("k") == b"v"


def test_an_address_of_another_host_is_a_one_line_error():
    with pytest.raises(
        RuntimeError, match=r"192\.0\.2\.1:\d+ did not start listening within 1 s; check PADDLE_CURRENT_ENDPOINT"
    ):
        _host_store("192.0.2.1", _free_port(), 2, timeout=1)
