"""The cross-cluster link: authenticated TCP channels between the same rank of different clusters,
run on 127.0.0.1 in threads (one per emulated cluster), with a byte-flipping proxy for tampering
and a killed subprocess for a lost peer."""

import os
import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from erniekit.distributed.cross_cluster import auth
from erniekit.distributed.cross_cluster.link import (
    AuthError,
    CrossClusterLinks,
    LinkError,
    LinkShape,
    LinkStats,
    frame_bytes,
)
from erniekit.errors import ConfigError

KEY = b"test-key-0123456789abcdef"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def free_base_ports(n_clusters: int, n_ranks: int = 1) -> list[int]:
    """A base port per cluster with base .. base + n_ranks - 1 all free on 127.0.0.1."""
    bases: list[int] = []
    taken: set[int] = set()
    for _ in range(200):
        base = random.randrange(20000, 60000 - n_ranks)
        span = set(range(base, base + n_ranks))
        if span & taken:
            continue
        try:
            for p in span:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        bases.append(base)
        taken |= span
        if len(bases) == n_clusters:
            return bases
    raise RuntimeError("no free ports on 127.0.0.1")


def open_all(addresses_of, n, rank=0, keys=None, shape=None, connect_timeout_s=10.0, timeout_s=10.0):
    """CrossClusterLinks.open for clusters 0..n-1 in threads; addresses_of(c) is cluster c's list.
    Returns one CrossClusterLinks or exception per cluster."""
    out: list = [None] * n

    def run(c):
        try:
            out[c] = CrossClusterLinks.open(
                c,
                rank,
                addresses_of(c),
                (keys or [KEY] * n)[c],
                shape=shape or LinkShape(),
                hello={"cluster": c, "world": 2},
                connect_timeout_s=connect_timeout_s,
                timeout_s=timeout_s,
            )
        except Exception as e:  # handed back to the test, which asserts on it
            out[c] = e

    threads = [threading.Thread(target=run, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def pair(shape=None, timeout_s=10.0, rank=0):
    bases = free_base_ports(2, rank + 1)  # rank r listens on base + r: that port must be free too
    links = open_all(lambda c: [f"127.0.0.1:{b}" for b in bases], 2, rank=rank, shape=shape, timeout_s=timeout_s)
    for x in links:
        if isinstance(x, Exception):
            raise x
    return links


class Proxy:
    """Forwards one TCP connection; the stream from the connecting (higher) cluster to the listening
    one is recorded, can have one byte flipped at an absolute offset, and can be re-injected."""

    def __init__(self, target_port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = target_port
        self.recorded = bytearray()
        self.flip_at: int | None = None
        self._down: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        up, _ = self.server.accept()
        self.server.close()
        for _ in range(250):  # cluster 0 may not listen yet
            try:
                self._down = socket.create_connection(("127.0.0.1", self.target))
                break
            except ConnectionRefusedError:
                time.sleep(0.02)
        threading.Thread(target=self._pump, args=(up, self._down, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self._down, up, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if record:
                    chunk = bytearray(chunk)
                    start = len(self.recorded)
                    if self.flip_at is not None and start <= self.flip_at < start + len(chunk):
                        chunk[self.flip_at - start] ^= 0x20
                    self.recorded += chunk  # counted before it is forwarded: offsets are known on arrival
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, start: int, end: int) -> None:
        self._down.sendall(bytes(self.recorded[start:end]))


def proxied_pair(flip_at=None, connect_timeout_s=5.0):
    """Cluster 1 reaches cluster 0 through a Proxy; returns (links0, links1 or exception, proxy)."""
    (b0, b1) = free_base_ports(2)
    proxy = Proxy(b0)
    proxy.flip_at = flip_at
    real = [f"127.0.0.1:{b0}", f"127.0.0.1:{b1}"]
    via = [f"127.0.0.1:{proxy.port}", f"127.0.0.1:{b1}"]
    links = open_all(lambda c: real if c == 0 else via, 2, connect_timeout_s=connect_timeout_s, timeout_s=5.0)
    return links[0], links[1], proxy


def test_large_messages_both_directions_at_once():
    """8 MB each way, both sides send first and then receive: send() only queues, so no deadlock;
    bytes and order arrive intact and the wire byte counts are exact."""
    a, b = pair()
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes() for _ in range(2)]
    got: dict = {}

    def side(links, c):
        peer = links.peer(1 - c)
        peer.send("big", memoryview(data[c]))
        peer.send("small", b"x")
        got[c] = [peer.recv(10.0), peer.recv(10.0)]

    threads = [threading.Thread(target=side, args=(x, c)) for c, x in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got[0] == [("big", data[1]), ("small", b"x")]
    assert got[1] == [("big", data[0]), ("small", b"x")]
    s0, s1 = a.stats(), b.stats()
    assert s0.bytes_sent == s1.bytes_received and s1.bytes_sent == s0.bytes_received
    handshake = s0.bytes_sent - frame_bytes("big", 8 << 20) - frame_bytes("small", 1)
    assert 0 < handshake < 400  # hello + confirm only
    assert (s0.messages_sent, s0.messages_received) == (3, 3)  # the handshake confirm counts as one
    a.close()
    b.close()


def test_all_gather_three_clusters_in_cluster_order():
    """3 clusters, rank 1 of each (ports base + 1): every cluster gets every payload in cluster order
    and every cluster's hello."""
    bases = free_base_ports(3, n_ranks=2)
    links = open_all(lambda c: [f"127.0.0.1:{b}" for b in bases], 3, rank=1)
    assert all(isinstance(x, CrossClusterLinks) for x in links), links
    payloads = [bytes([c]) * (1000 + c) for c in range(3)]
    out: list = [None] * 3
    threads = [
        threading.Thread(target=lambda c: out.__setitem__(c, links[c].all_gather("delta", payloads[c])), args=(c,))
        for c in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == [payloads] * 3
    assert [x.hellos for x in links] == [[{"cluster": c, "world": 2} for c in range(3)]] * 3
    own = links[0].stats()
    assert own.messages_received == 2 + 2  # one per peer, plus each handshake confirm
    assert own.bytes_sent >= 2 * frame_bytes("delta", 1000)
    for x in links:
        x.close()


def test_wrong_key_fails_the_handshake_without_showing_a_key():
    bases = free_base_ports(2)
    other = b"another-key-zyxwvutsrq"
    links = open_all(lambda c: [f"127.0.0.1:{b}" for b in bases], 2, keys=[KEY, other], connect_timeout_s=1.0)
    # each side reads the other's whole hello before refusing it, so neither sees a reset instead; the
    # listening side refuses the connection and waits on (anyone can connect), then names the refusal
    assert all(isinstance(x, AuthError) for x in links), links
    assert all("failed its HMAC check" in str(x) for x in links)
    assert "127.0.0.1" in str(links[0])
    assert f"cluster 0 rank 0 (127.0.0.1:{bases[0]})" in str(links[1])
    for e in links:
        assert KEY.decode() not in str(e) and other.decode() not in str(e)
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    "where",
    ["seq", "length", "tag", "header_mac", "payload", "payload_mac"],
)
def test_a_flipped_byte_anywhere_in_a_message_is_rejected(where):
    """A proxy flips one byte of message 1 (after the handshake); the receiving cluster raises an
    AuthError naming the sender, before handing any of the payload to the caller."""
    n = 5000
    offset = {"seq": 7, "length": 12, "tag": 16, "header_mac": 50, "payload": 80 + n // 2, "payload_mac": 80 + n + 31}
    # the handshake's length is fixed except for the hello JSON: measure it on an untampered pair
    a, b, proxy = proxied_pair()
    handshake = len(proxy.recorded)
    a.close(), b.close()
    a, b, proxy = proxied_pair(flip_at=handshake + offset[where])
    assert len(proxy.recorded) == handshake  # same handshake length: the flip lands in message 1
    b.peer(0).send("delta", os.urandom(n))
    with pytest.raises(AuthError) as e:
        a.peer(1).recv(5.0)
    msg = str(e.value)
    assert "cluster 1 rank 0" in msg and "the job stops" in msg and KEY.decode() not in msg
    with pytest.raises(AuthError):  # sticky: every later call stops too
        a.peer(1).send("x", b"")
    a.close(), b.close()


def test_a_flipped_byte_in_the_handshake_is_rejected():
    a, b, _ = proxied_pair(flip_at=20, connect_timeout_s=1.0)  # inside the hello's nonce
    assert isinstance(a, AuthError) and "handshake" in str(a), a
    assert isinstance(b, LinkError)


def test_a_replayed_message_is_rejected():
    """Message 1 delivered, then its exact bytes (valid MACs) sent again: rejected by the sequence check."""
    a, b, proxy = proxied_pair()
    start = len(proxy.recorded)
    b.peer(0).send("delta", b"pay me once")
    assert a.peer(1).recv(5.0) == ("delta", b"pay me once")
    proxy.inject(start, start + frame_bytes("delta", 11))
    with pytest.raises(AuthError, match="message 1 from cluster 1 rank 0 .* arrived when 2 was due"):
        a.peer(1).recv(5.0)
    a.close(), b.close()


def test_a_recorded_handshake_cannot_start_a_new_session():
    """Replaying cluster 1's recorded handshake into a new connection fails: the session key
    depends on cluster 0's fresh nonce, so the replayed confirm fails its HMAC."""
    a, b, proxy = proxied_pair()
    recorded = bytes(proxy.recorded)
    a.close(), b.close()
    (b0,) = free_base_ports(1)
    result: list = []

    def listen():
        try:
            result.append(CrossClusterLinks.open(0, 0, [f"127.0.0.1:{b0}", "127.0.0.1:1"], KEY, connect_timeout_s=1))
        except Exception as e:  # asserted below
            result.append(e)

    t = threading.Thread(target=listen)
    t.start()
    for _ in range(100):
        try:
            attacker = socket.create_connection(("127.0.0.1", b0))
            break
        except OSError:
            time.sleep(0.02)
    attacker.sendall(recorded)
    t.join(10)
    attacker.close()
    assert isinstance(result[0], AuthError) and "message 0 from cluster 1 rank 0" in str(result[0]), result


def test_recv_timeout_and_wrong_tag_raise_link_errors():
    """recv(0.2) waits its own 0.2 s (at least that: the lower bound), not the link's default: that is
    600 s here, so the upper bound can be as loose as a minute and still tell them apart."""
    a, b = pair(timeout_s=600.0)
    t0 = time.monotonic()
    with pytest.raises(LinkError, match=r"no message from cluster 1 rank 0 .* in 0.2 s; raise cross_cluster_timeout_s"):
        a.peer(1).recv(0.2)
    assert 0.18 < time.monotonic() - t0 < 60  # not the link's 600 s
    b.peer(0).send("late", b"1")  # a timeout leaves the link usable
    b.peer(0).send("other", b"2")
    assert a.peer(1).recv(5.0) == ("late", b"1")
    with pytest.raises(LinkError, match="expected a 'delta' message from cluster 1 rank 0 .*, got 'other'"):
        a.peer(1).recv(5.0, expect="delta")
    a.close(), b.close()


def test_peer_closing_its_side_ends_the_other_sides_recv_at_once():
    a, b = pair()
    b.peer(0).send("last", b"z")
    b.close()
    assert a.peer(1).recv(5.0) == ("last", b"z")  # what was sent before closing still arrives
    # recv's own timeout would be another message ("no message ... in 120 s"), after two minutes
    with pytest.raises(LinkError, match="cluster 1 rank 0 .* the other cluster stopped or the link dropped; restart"):
        a.peer(1).recv(120.0)
    a.close()


_CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from erniekit.distributed.cross_cluster.auth import load_key
from erniekit.distributed.cross_cluster.link import CrossClusterLinks
links = CrossClusterLinks.open(1, 0, {addresses!r}, load_key(None), connect_timeout_s=10)
print("ready", flush=True)
time.sleep(60)
"""


def test_killed_peer_process_stops_recv_quickly():
    """Cluster 1 is a real process (key from $ERNIEKIT_CROSS_CLUSTER_KEY); SIGKILL it while cluster 0
    waits in recv with a long timeout: the LinkError comes at once, naming the peer (recv's own
    timeout, 300 s, would leave the thread waiting past the test's join and say "no message")."""
    bases = free_base_ports(2)
    addresses = [f"127.0.0.1:{b}" for b in bases]
    env = dict(os.environ, ERNIEKIT_CROSS_CLUSTER_KEY=KEY.decode())
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(repo=REPO, addresses=addresses)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        links = CrossClusterLinks.open(0, 0, addresses, KEY, connect_timeout_s=20, timeout_s=300)
        assert child.stdout.readline().strip() == "ready"
        result: list = []

        def wait():
            try:
                links.peer(1).recv(300)
            except LinkError as e:
                result.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.2)
        child.kill()
        t.join(60)
        assert result, "recv did not return after the peer was killed"
        assert "cluster 1 rank 0" in str(result[0]) and "restart both clusters" in str(result[0])
        links.close(flush_s=0)
    finally:
        child.kill()
        child.wait()


def test_connect_timeouts_name_the_missing_cluster():
    (b0, b1) = free_base_ports(2)
    addresses = [f"127.0.0.1:{b0}", f"127.0.0.1:{b1}"]
    t0 = time.monotonic()
    with pytest.raises(LinkError, match=rf"could not connect to cluster 0 rank 0 \(127.0.0.1:{b0}\) in 0.3 s"):
        CrossClusterLinks.open(1, 0, addresses, KEY, connect_timeout_s=0.3)
    with pytest.raises(LinkError, match=rf"cluster\(s\) \[1\] rank 0 did not connect to 127.0.0.1:{b0} in 0.3 s"):
        CrossClusterLinks.open(0, 0, addresses, KEY, connect_timeout_s=0.3)
    assert time.monotonic() - t0 < 60  # the 0.3 s given, not the 300 s default


def test_emulated_link_delays_and_queues_messages():
    """100 Mbit/s + 50 ms: a 1.25 MB message takes latency + 8n/bandwidth = 0.15 s from send() to
    recv(); two sent back to back queue, the second arrives at 2 x 0.1 + 0.05 = 0.25 s. Every trial
    must take at least that long (a busy CPU only makes it longer, so there is no upper bound)."""
    shape = LinkShape(bandwidth_mbit=100, latency_ms=50)
    n = 1_250_000
    assert shape.seconds(n) == pytest.approx(0.15)
    wire = frame_bytes("m", n)
    a, b = pair(shape=shape)
    tx, rx = b.peer(0), a.peer(1)
    payload = bytes(n)

    def burst(k):
        """Arrival times of k messages sent back to back, from the first send()."""
        t0 = time.monotonic()
        for _ in range(k):
            tx.send("m", payload)
        arrivals = []
        for _ in range(k):
            rx.recv(5.0)
            arrivals.append(time.monotonic() - t0)
        return arrivals

    ones = [burst(1)[0] for _ in range(3)]
    twos = [burst(2) for _ in range(3)]
    assert min(ones) >= shape.seconds(wire)
    firsts, seconds = [t[0] for t in twos], [t[1] for t in twos]
    assert min(firsts) >= shape.seconds(wire)
    two = 0.05 + 2 * shape.transmit_seconds(wire)
    assert min(seconds) >= two  # the second waited for the first
    busy = tx.stats().send_seconds  # each burst counted once (not per message): busy from send() to its last byte
    # the lower bound allows 10%: a message's end is stamped after sendall returns, so a sender thread
    # descheduled there (a loaded machine) stamps it late and the next burst's overlap is not counted.
    # Counted per message, a burst of two would add its first message's time again (sum(firsts), at
    # least 0.45 s): half of that is the room a late stamp gets above the measured arrivals
    assert 0.9 * (3 * shape.seconds(wire) + 3 * two) <= busy < sum(ones) + sum(seconds) + sum(firsts) / 2
    a.close(), b.close()


def test_send_returns_while_the_emulated_link_still_carries_the_message():
    """send() queues the message for the sender thread and returns: over a link with 120 s of latency
    the message is neither sent nor received when send() is back (a send() that waited for the link
    would hold this test two minutes, then find the message delivered)."""
    a, b = pair(shape=LinkShape(latency_ms=120_000))
    tx, rx = b.peer(0), a.peer(1)
    tx.send("m", bytes(1000))
    assert tx.stats().messages_sent == 1  # the handshake's confirm only
    with pytest.raises(LinkError, match="no message from cluster 1 rank 0"):
        rx.recv(0.05)
    a.close(), b.close(flush_s=0)


def test_link_shape_and_stats_arithmetic():
    assert not LinkShape().emulated and not LinkShape(0, 0).emulated
    assert LinkShape(None, 5).emulated and LinkShape(1.0).emulated
    assert LinkShape(8.0).transmit_seconds(1_000_000) == pytest.approx(1.0)
    assert LinkShape(None, 20).seconds(10**9) == pytest.approx(0.02)
    with pytest.raises(ConfigError, match="latency_ms=-1"):
        LinkShape(10, -1)
    s = LinkStats(1, 2, 3, 4, 0.5, 0.25) + LinkStats(10, 20, 30, 40, 1.0, 2.0)
    assert s == LinkStats(11, 22, 33, 44, 1.5, 2.25)


def test_load_key_from_file_env_and_refusals(tmp_path, monkeypatch):
    secret = "s3cret-key-material-42"
    f = tmp_path / "cc.key"
    f.write_text(secret + "\n")
    f.chmod(0o600)
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    assert auth.load_key(str(f)) == secret.encode()
    f.chmod(0o644)
    with pytest.warns(UserWarning, match="readable by group/others .*chmod 600"):
        auth.load_key(str(f))
    monkeypatch.setenv(auth.KEY_ENV, secret)
    assert auth.load_key(None) == secret.encode()
    monkeypatch.setenv(auth.KEY_ENV, "short-secret")
    with pytest.raises(ConfigError, match=r"\$ERNIEKIT_CROSS_CLUSTER_KEY: the key has 12 bytes, at least 16") as e:
        auth.load_key(None)
    assert "short-secret" not in str(e.value)
    monkeypatch.delenv(auth.KEY_ENV)
    with pytest.raises(ConfigError, match="no cross-cluster key: set cross_cluster_key_file or"):
        auth.load_key(None)
    with pytest.raises(ConfigError, match="cross_cluster_key_file=.*missing.key: cannot read it"):
        auth.load_key(str(tmp_path / "missing.key"))


def test_hmac_helpers_match_the_standard_library():
    import hashlib
    import hmac

    parts = [b"a", memoryview(b"bc"), bytearray(b"def")]
    ref = hmac.new(KEY, b"abcdef", hashlib.sha256).digest()
    assert auth.mac(KEY, *parts) == ref
    assert auth.verify(KEY, ref, b"abcdef") and not auth.verify(KEY, ref, b"abcdeg")
    assert auth.session_key(KEY, b"c", b"1" * 32, b"2" * 32) != auth.session_key(KEY, b"c", b"1" * 32, b"3" * 32)


def test_a_shared_emulated_link_carries_one_message_at_a_time_for_every_rank(tmp_path):
    """Ranks 0 and 1 of cluster 1 (two link pairs, as two processes would hold them) send 1.25 MB each at
    once over a shared 10 Mbit/s link: the second message waits for the first (1 s each on the wire),
    so the later arrival is at least 2.05 s; over links of their own both arrive at ~1.05 s, before
    2.05 s with a second to spare for a busy CPU (best of 2)."""
    n = 1_250_000
    wire = frame_bytes("m", n)

    def both(shape):
        ranks = [pair(shape=shape, rank=r) for r in (0, 1)]
        t0 = time.monotonic()
        for _a, b in ranks:
            b.peer(0).send("m", bytes(n))
        arrivals = []
        for a, _b in ranks:
            a.peer(1).recv(60.0)
            arrivals.append(time.monotonic() - t0)
        for a, b in ranks:
            a.close(), b.close()
        return max(arrivals)

    shared = LinkShape(10, 50, shared_dir=str(tmp_path))
    own = LinkShape(10, 50)
    t_shared = both(shared)  # a lower bound: a busy CPU cannot make it pass
    t_own = min(both(own) for _ in range(2))
    two = 0.05 + 2 * own.transmit_seconds(wire)
    assert t_shared >= two
    assert own.seconds(wire) <= t_own < two
    assert sorted(os.listdir(tmp_path)) == ["link-1-to-0"]  # one clock per direction


# ---- hostile or broken peers ----------------------------------------------------------------------


def _listen_in_thread(addresses, **kw):
    """Cluster 0 of `addresses` opening its links in a thread; returns (thread, result list)."""
    out: list = []

    def run():
        try:
            out.append(CrossClusterLinks.open(0, 0, addresses, KEY, **kw))
        except Exception as e:  # asserted by the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _connect(port: int) -> socket.socket:
    for _ in range(250):
        try:
            return socket.create_connection(("127.0.0.1", port))
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {port}")


@pytest.mark.parametrize("stray", ["silent", "garbage", "huge_hello", "wrong_key"])
def test_a_stray_connection_neither_blocks_nor_fails_the_real_peer(stray, capfd):
    """Anyone who reaches the listening port connects first: one that never speaks (slowloris), sends
    garbage, announces a 1 MB hello and stalls, or holds another key. The real cluster 1, connecting
    after it, still links at once; the stranger is refused on stderr and its socket closed. A real
    peer kept waiting behind the stranger's 300 s handshake fails: both sides give up after 120 s."""
    from erniekit.distributed.cross_cluster.link import _HELLO, _MAGIC

    bases = free_base_ports(2)
    addresses = [f"127.0.0.1:{b}" for b in bases]
    t, out = _listen_in_thread(addresses, connect_timeout_s=120.0, timeout_s=5.0, handshake_timeout_s=300.0)
    bad = _connect(bases[0])
    head = _HELLO.pack(_MAGIC, 1, 0, b"n" * 32, 1 << 20)
    bad.sendall(
        {
            "silent": b"",
            "garbage": os.urandom(300),
            "huge_hello": head + auth.mac(KEY, b"hello-head", head) + b"{",
            "wrong_key": head[:-4] + b"\0\0\0\2" + bytes(32) + b"{}" + bytes(32),
        }[stray]
    )
    err, refused = "", stray in ("garbage", "wrong_key")
    if refused:  # refused at once: its report comes before the real cluster (a sleep would race a busy CPU)
        deadline = time.monotonic() + 60
        while "refused a connection" not in err and time.monotonic() < deadline:
            time.sleep(0.02)
            err += capfd.readouterr().err
    else:
        time.sleep(0.2)  # the stranger is accepted first
    real = CrossClusterLinks.open(1, 0, addresses, KEY, connect_timeout_s=120.0, timeout_s=5.0)
    t.join(60)
    assert isinstance(out[0], CrossClusterLinks), out  # not a LinkError after the 120 s connect timeout
    real.peer(0).send("x", b"1")
    assert out[0].peer(1).recv(2.0) == ("x", b"1")
    bad.settimeout(2.0)
    try:
        while bad.recv(1 << 16):  # our hello, then the close (a reset is a close too)
            pass
    except ConnectionResetError:
        pass
    bad.close()
    if refused:
        assert "refused a connection: handshake from a cluster at 127.0.0.1" in err + capfd.readouterr().err
    real.close(), out[0].close()


def test_a_flood_of_silent_connections_does_not_lock_the_real_peer_out(capfd):
    """More silent connections than handshakes run at once: the newest makes the oldest stranger
    room, so the real cluster, connecting last, still links; the refusals are reported, a few lines.
    A real peer locked out until the strangers' 300 s handshakes end would fail at the 120 s timeout."""
    from erniekit.distributed.cross_cluster.link import _MAX_HANDSHAKES, _REPORTED

    bases = free_base_ports(2)
    addresses = [f"127.0.0.1:{b}" for b in bases]
    t, out = _listen_in_thread(addresses, connect_timeout_s=120.0, timeout_s=5.0, handshake_timeout_s=300.0)
    flood = [_connect(bases[0]) for _ in range(_MAX_HANDSHAKES + 8)]
    time.sleep(0.3)
    real = CrossClusterLinks.open(1, 0, addresses, KEY, connect_timeout_s=120.0, timeout_s=5.0)
    t.join(60)
    assert isinstance(out[0], CrossClusterLinks), out
    # how many strangers were accepted (and evicted) before the real peer linked depends on the
    # machine's load; the report stays a few lines whatever the flood
    assert capfd.readouterr().err.count("refused a connection") <= _REPORTED
    for s in flood:
        s.close()
    real.close(), out[0].close()


def test_the_connecting_cluster_retries_a_listener_that_closed_without_a_word():
    """Cluster 0's port first answers with a close before any byte (a busy or restarting listener):
    cluster 1 tries again until the real cluster 0 is there, instead of stopping at the first close."""
    bases = free_base_ports(2)
    addresses = [f"127.0.0.1:{b}" for b in bases]
    bouncer = socket.create_server(("127.0.0.1", bases[0]))
    result: list = []

    def connect():
        try:
            result.append(CrossClusterLinks.open(1, 0, addresses, KEY, connect_timeout_s=5.0, timeout_s=5.0))
        except Exception as e:  # asserted below
            result.append(e)

    t = threading.Thread(target=connect)
    t.start()
    sock, _ = bouncer.accept()
    sock.close()
    bouncer.close()
    time.sleep(0.1)
    zero = CrossClusterLinks.open(0, 0, addresses, KEY, connect_timeout_s=5.0, timeout_s=5.0)
    t.join(10)
    assert isinstance(result[0], CrossClusterLinks), result
    result[0].close(), zero.close()


def test_a_stalled_handshake_is_dropped_and_named_when_nobody_else_comes(capfd):
    """A connection that never finishes its handshake is closed after handshake_timeout_s, and the
    listening cluster's timeout names the refusals. First with a listener that waits 120 s: the
    stranger is closed and reported while it still waits, and the real cluster then links (kept
    until the listener gave up, the stranger would not see its close within the minute it waits)."""
    bases = free_base_ports(2)
    addresses = [f"127.0.0.1:{b}" for b in bases]
    t, out = _listen_in_thread(addresses, connect_timeout_s=120.0, handshake_timeout_s=0.3)
    bad = _connect(bases[0])
    bad.settimeout(60.0)
    while bad.recv(1 << 16):  # the listener's hello, then its close after 0.3 s
        pass
    bad.close()
    err, deadline = "", time.monotonic() + 60
    while "did not finish in time" not in err and time.monotonic() < deadline:
        time.sleep(0.02)
        err += capfd.readouterr().err
    assert "refused a connection: handshake with a cluster at 127.0.0.1" in err and "did not finish in time" in err
    real = CrossClusterLinks.open(1, 0, addresses, KEY, connect_timeout_s=120.0)
    t.join(60)
    assert isinstance(out[0], CrossClusterLinks), out  # the listener was still waiting
    real.close(), out[0].close()
    # nobody else comes: the listener's own timeout names what it refused
    bases = free_base_ports(2)
    t, out = _listen_in_thread([f"127.0.0.1:{b}" for b in bases], connect_timeout_s=3.0, handshake_timeout_s=0.3)
    bad = _connect(bases[0])
    t.join(60)
    (err,) = out
    assert isinstance(err, LinkError) and "did not connect" in str(err)
    assert "refused 1 connection(s), the last: handshake with a cluster at 127.0.0.1" in str(err)
    assert "did not finish in time" in str(err) and "\n" not in str(err)
    bad.close()


class _FakePeer:
    """A key-holding listener that speaks the protocol by hand: the hello body it sends, and the
    raw bytes it sends after the handshake, are the test's."""

    def __init__(self, body: bytes, after=None) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.body, self.after = body, after
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import struct

        from erniekit.distributed.cross_cluster.link import _HELLO, _MAGIC, _frame

        sock, _ = self.server.accept()
        nonce = os.urandom(32)
        head = _HELLO.pack(_MAGIC, 0, 0, nonce, len(self.body))
        sock.sendall(head + auth.mac(KEY, b"hello-head", head) + self.body + auth.mac(KEY, b"hello", head, self.body))
        theirs = b""
        while len(theirs) < _HELLO.size:
            theirs += sock.recv(_HELLO.size - len(theirs))
        their_nonce = _HELLO.unpack(theirs)[3]
        skey = auth.session_key(KEY, struct.pack(">III", 0, 1, 0), nonce, their_nonce)
        head0, payload0, mac0 = _frame(skey, 0, 0, b"handshake", b"")
        sock.sendall(head0 + payload0 + mac0)
        if self.after is not None:
            sock.sendall(self.after(skey))
        self.sock = sock  # kept open: the test's side must stop on its own


@pytest.mark.parametrize("body", [b"\xff\xfe not json", b"[1, 2]", b'{"a": '])
def test_a_hello_that_is_not_a_json_object_is_one_line(body):
    """A peer with the key but another version: its authenticated hello is not a JSON object."""
    peer = _FakePeer(body)
    with pytest.raises(LinkError, match="sent a hello that is not a JSON object: a different erniekit version"):
        CrossClusterLinks.open(1, 0, [f"127.0.0.1:{peer.port}", "127.0.0.1:1"], KEY, connect_timeout_s=3.0)


def test_an_authenticated_absurd_length_stops_the_link_at_once():
    """A key-holding peer's header (valid MAC) claims 2^63 bytes: recv fails at once with one line,
    not after the link's timeout with the reader thread dead of an OverflowError."""
    from erniekit.distributed.cross_cluster.link import _HEAD

    def huge(skey):
        head = _HEAD.pack(1, 1 << 63, b"delta".ljust(32, b"\0"))
        return head + auth.mac(skey, b"H", (0).to_bytes(4, "big"), head)

    peer = _FakePeer(b"{}", after=huge)
    links = CrossClusterLinks.open(1, 0, [f"127.0.0.1:{peer.port}", "127.0.0.1:1"], KEY, connect_timeout_s=3.0)
    # recv's own timeout would be another message ("no message ... in 120 s"), after two minutes
    with pytest.raises(LinkError, match=r"message 1 from cluster 0 rank 0 \(127.0.0.1:\d+\) claims 922337203685477580"):
        links.peer(0).recv(120.0)
    links.close(flush_s=0)


def test_a_base_port_too_high_for_the_rank_is_a_config_error():
    with pytest.raises(ConfigError, match=r"cross_cluster_peers\[0\]=127.0.0.1:65534: rank 3 would use port 65537"):
        CrossClusterLinks.open(1, 3, ["127.0.0.1:65534", "127.0.0.1:29600"], KEY, connect_timeout_s=0.2)


# ---- careless configs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"cross_cluster_peers": ["127.0.0.1:65534", "10.0.0.2:29600"], "nproc_per_node": 4},
            r"cross_cluster_peers\[0\]=127.0.0.1:65534: its 4 ranks listen on ports 65534..65537, past 65535; "
            "use a base port of at most 65532",
        ),
        (
            {"cross_cluster_peers": ["h:29600", "h:29602", "h:29700"], "nproc_per_node": 4},
            r"cross_cluster_peers\[0\]=h:29600 and \[1\]=h:29602: both clusters listen .* at least 4 apart",
        ),
        (
            {"cross_cluster_timeout_s": 1e12},
            r"cross_cluster_timeout_s=1000000000000.0: must be in \(0, 1e\+08\] seconds",
        ),
    ],
)
def test_site_configs_that_could_not_run_are_one_line(overrides, message, monkeypatch):
    """Ports past 65535 and listening port ranges that collide (an OverflowError or a cluster reaching
    the wrong rank at run time), and a timeout Python's waits cannot hold, stop at the config check."""
    import dataclasses

    from erniekit.config import TrainConfig, validate

    monkeypatch.setenv(auth.KEY_ENV, KEY.decode())
    base = {"cross_cluster_id": 1, "cross_cluster_peers": ["127.0.0.1:29600", "10.0.0.2:29600"]}
    with pytest.raises(ConfigError, match=message) as e:
        validate(dataclasses.replace(TrainConfig(), **{**base, **overrides}))
    assert "\n" not in str(e.value)
    # the last cluster only connects: sharing a host and port with another is not a collision
    ok = {**base, "cross_cluster_peers": ["h:29600", "h:29600"], "nproc_per_node": 4}
    assert validate(dataclasses.replace(TrainConfig(), **ok)).cross_cluster_id == 1


@pytest.mark.parametrize("broken", [{"checkpoints": "3"}, {"checkpoints": None}, {"start_crc": None}])
def test_a_peer_hello_missing_fields_is_one_config_error(broken):
    """An authenticated hello of another version without the checkpoint list or the start checksum:
    one ConfigError naming the cluster, not a KeyError / TypeError when the runner reads it."""
    from types import SimpleNamespace

    from erniekit.train.runners.cross_cluster import CrossClusterRunner

    mine = {k: 1 for k in ("sync", "every", "overlap", "compress", "outer", "world", "elements")}
    mine.update(resume=False, checkpoints=[], start_crc=7)
    other = {k: v for k, v in mine.items() if k not in broken}
    other.update({k: v for k, v in broken.items() if v is not None})
    runner = object.__new__(CrossClusterRunner)
    runner.links, runner.cid, runner.rank = SimpleNamespace(hellos=[mine, other]), 0, 0
    with pytest.raises(ConfigError, match="cluster 1 "):
        runner._check_hellos(mine)
    runner.links = SimpleNamespace(hellos=[mine, dict(mine)])
    runner._check_hellos(mine)  # a matching hello passes


def test_a_stop_request_ends_the_wait_for_the_other_clusters():
    """SIGTERM while the listening cluster waits for the others (the runner passes run_control's
    stop_signal): the wait ends within a poll, not after the 300 s connect timeout (which would end
    it with another message, "did not connect ... in 300 s")."""
    bases = free_base_ports(2)
    asked = time.monotonic() + 0.3
    with pytest.raises(LinkError, match=r"stopped \(signal 15\) while waiting for cluster\(s\) \[1\] to connect"):
        CrossClusterLinks.open(
            0,
            0,
            [f"127.0.0.1:{b}" for b in bases],
            KEY,
            connect_timeout_s=300,
            stop=lambda: 15 * (time.monotonic() > asked),
        )
