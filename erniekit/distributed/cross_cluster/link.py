"""Authenticated, message-oriented TCP links between the same rank of different clusters.

Rank r of cluster c listens on host_c:(base_port_c + r); for each pair the lower cluster id listens
and the higher one connects. The handshake exchanges (cluster id, rank, fresh nonce, a JSON hello)
MAC'd with the shared key, and both sides derive a session key from the two nonces, so a recorded
session cannot be replayed into a new one. Every message is then

    header = seq (u64) | payload length (u64) | tag (32 bytes, NUL-padded UTF-8)
    frame  = header | HMAC(session, "H", sender, header) | payload | HMAC(session, "P", sender, header, payload)

with seq counting up from 0 in each direction: a flipped byte anywhere fails a MAC (the fixed-size
header has its own, so a forged length cannot make the reader wait for bytes that never come), and a
replayed or reordered frame fails the sequence check. The hello is built the same way, MAC'd with
the shared key: fixed part | its MAC | JSON | MAC of both. No encryption: docs/cross_cluster.md
says which tunnel to use.

Each link has a sender thread (send() only queues: both sides can send large messages and then
recv without deadlock) and a reader thread (receipt does not wait for the application, so a slow
reader never stalls the other cluster's sender; received messages wait in memory until recv()).
`LinkShape` emulates a slow link in the sender."""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, fields

from erniekit.distributed.cross_cluster import auth
from erniekit.errors import ConfigError, ErniekitError

RESTART = "the other cluster stopped or the link dropped; restart both clusters with resume_from_checkpoint=auto"
_HEAD = struct.Struct(">QQ32s")  # seq, payload length, tag
_HELLO = struct.Struct(">8sII32sI")  # magic, cluster id, rank, nonce, JSON length
_MAGIC = b"EKCCLNK1"  # protocol name and version
_MAX_HELLO_JSON = 1 << 20  # bytes of a hello's JSON
_CONFIRM = "handshake"  # tag of message 0 in each direction: proves both sides hold the session key
_SENDER_QUEUE = 64  # messages a link holds for its sender thread before send() waits
_MAX_MESSAGE = 1 << 40  # bytes of one message's payload (a rank's share of a model is far smaller)
_HANDSHAKE_S = 30.0  # seconds an accepted connection has to finish its handshake (a real peer sends at once)
_MAX_HANDSHAKES = 32  # accepted connections in their handshake at once; more are closed at once
_POLL_S = 0.05  # how often the accepting loop looks at finished handshakes
_REPORTED = 10  # refused connections reported one by one on stderr (a flood is then only counted)


class LinkError(ErniekitError):
    """The cross-cluster link failed: peer gone, timeout, wrong message; the job has to stop."""


class AuthError(LinkError):
    """A handshake or message failed its HMAC or sequence check: a different key or tampered traffic."""


class _Unheard(LinkError):
    """The listening side closed before sending a byte (it was busy, or not yet the real cluster):
    the connecting side tries again until its deadline."""


@dataclass(frozen=True)
class LinkShape:
    """A slow link emulated by the sender: a message of n wire bytes handed to send() at time t is
    readable by the peer no earlier than t + latency + 8n / bandwidth, and messages queue behind each
    other (one at a time per direction). bandwidth None or 0 and latency 0: not emulated."""

    bandwidth_mbit: float | None = None
    latency_ms: float = 0.0
    # a directory where every process of this machine that sends from cluster a to cluster b keeps one
    # shared "link busy until" clock: a cluster's ranks then share one emulated link, as a site's ranks
    # share its uplink (None: each rank pair has a link of its own)
    shared_dir: str | None = None

    def __post_init__(self) -> None:
        for name, key in (
            ("bandwidth_mbit", "cross_cluster_link_mbit"),
            ("latency_ms", "cross_cluster_link_latency_ms"),
        ):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{key}={v}: use a finite number >= 0 (0 = not emulated)")

    @property
    def emulated(self) -> bool:
        return bool(self.bandwidth_mbit) or self.latency_ms > 0

    def transmit_seconds(self, nbytes: int) -> float:
        """Time the emulated link is busy carrying `nbytes` (0 when bandwidth is not emulated)."""
        return 8.0 * nbytes / (self.bandwidth_mbit * 1e6) if self.bandwidth_mbit else 0.0

    def seconds(self, nbytes: int) -> float:
        """Time from send() to the peer's recv() for one message of `nbytes` wire bytes on an idle link."""
        return self.latency_ms / 1000.0 + self.transmit_seconds(nbytes)


@dataclass
class LinkStats:
    """Counters of one link (or summed over links). Bytes are wire bytes: handshake, headers and MACs
    included. send_seconds: time this side's messages spent queued or on the wire (the union of each
    message's send()-to-last-byte interval); recv_wait_seconds: time callers waited in recv()."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    send_seconds: float = 0.0
    recv_wait_seconds: float = 0.0

    def __add__(self, other: LinkStats) -> LinkStats:
        return LinkStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _shared_pipe(shape: LinkShape, src: int, dst: int, queued_at: float, nbytes: int) -> float:
    """When a message of nbytes queued at `queued_at` has crossed the emulated link src -> dst that every
    process of this machine sending that way shares (time.monotonic() is one clock for all of them):
    it starts once the link is free, and the link is then busy until it is through."""
    import fcntl

    path = os.path.join(shape.shared_dir, f"link-{src}-to-{dst}")
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            raw = f.read(8)
            free_at = struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0
            done = max(queued_at, free_at) + shape.transmit_seconds(nbytes)
            f.seek(0)
            f.truncate()
            f.write(struct.pack("<d", done))
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    return done


def frame_bytes(tag: str, nbytes: int) -> int:
    """Wire bytes of one message with `nbytes` of payload (what the link counts and the planner uses)."""
    return _HEAD.size + 2 * auth.MAC_BYTES + nbytes


def parse_address(address: str, where: str = "cross_cluster_peers") -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: {address!r} is not host:port (e.g. 10.0.0.2:29600)")
    return host.strip("[]"), int(port)


def _peer_name(cluster_id: int, rank: int, where: str) -> str:
    return f"cluster {cluster_id} rank {rank} ({where})"


def _who(cid: int) -> bytes:
    return struct.pack(">I", cid)


class _Conn:
    """A socket with exact reads and a byte count; raises LinkError naming the peer when the peer
    closes or resets the connection."""

    def __init__(self, sock: socket.socket, name: str, where: str) -> None:
        self.sock, self.name, self.where = sock, name, where  # where: host:port, for renaming after the hello
        self.sent = self.received = 0

    def send(self, *parts: bytes | memoryview) -> None:
        for p in parts:
            self.sock.sendall(p)
            self.sent += len(p)

    def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise LinkError(f"link to {self.name} closed: {RESTART}")
            got += k
            self.received += k
        return buf


def _frame(skey: bytes, sender: int, seq: int, tag: bytes, payload: bytes | memoryview) -> tuple:
    """The wire parts of one message: header + its MAC, payload, MAC of header and payload."""
    head = _HEAD.pack(seq, len(payload), tag)
    who = _who(sender)
    return head + auth.mac(skey, b"H", who, head), payload, auth.mac(skey, b"P", who, head, payload)


def _read_frame(conn: _Conn, skey: bytes, sender: int, expect_seq: int) -> tuple[str, bytes]:
    head = bytes(conn.read(_HEAD.size))
    seq, n, tag = _HEAD.unpack(head)
    who = _who(sender)
    failed = (
        f"message {expect_seq} from {conn.name} failed its HMAC check: a different key or tampered traffic; "
        "the job stops"
    )
    if not auth.verify(skey, conn.read(auth.MAC_BYTES), b"H", who, head):
        raise AuthError(failed)
    if seq != expect_seq:
        raise AuthError(
            f"message {seq} from {conn.name} arrived when {expect_seq} was due: a replayed or reordered "
            "message (tampered traffic); the job stops"
        )
    if n > _MAX_MESSAGE:
        raise LinkError(
            f"message {seq} from {conn.name} claims {n} bytes, more than {_MAX_MESSAGE}: a different erniekit "
            "version or a broken peer; the job stops"
        )
    payload = conn.read(n)
    if not auth.verify(skey, conn.read(auth.MAC_BYTES), b"P", who, head, payload):
        raise AuthError(failed)
    try:
        return tag.rstrip(b"\0").decode("utf-8"), bytes(payload)
    except UnicodeDecodeError:
        raise LinkError(
            f"message {seq} from {conn.name} has a tag that is not UTF-8: a different erniekit version"
        ) from None


def _handshake(
    conn: _Conn, key: bytes, me: int, rank: int, hello: dict, accept: set[int] | None, peer: int | None
) -> tuple[int, bytes, dict]:
    """Exchange authenticated hellos and confirm the session key; returns (peer cluster id, session key,
    peer hello). `peer` is the expected cluster id when connecting, `accept` the allowed ids when listening."""
    nonce = secrets.token_bytes(32)
    body = json.dumps(hello, sort_keys=True).encode("utf-8")
    if len(body) > _MAX_HELLO_JSON:
        raise LinkError(f"the hello for {conn.name} has {len(body)} bytes of JSON, more than {_MAX_HELLO_JSON}")
    head = _HELLO.pack(_MAGIC, me, rank, nonce, len(body))
    conn.send(head, auth.mac(key, b"hello-head", head), body, auth.mac(key, b"hello", head, body))

    failed = AuthError(
        f"handshake from {conn.name} failed its HMAC check: the clusters use different keys "
        "(cross_cluster_key_file / $ERNIEKIT_CROSS_CLUSTER_KEY) or the traffic was tampered with; the job stops"
    )
    their_head = bytes(conn.read(_HELLO.size))
    head_mac = conn.read(auth.MAC_BYTES)
    magic, cid, their_rank, their_nonce, nbody = _HELLO.unpack(their_head)
    ours = magic == _MAGIC and nbody <= _MAX_HELLO_JSON
    # read the whole hello before judging it: closing with its body unread would send a reset, and
    # the peer would report a broken pipe instead of the key mismatch it is about to find itself
    their_body, body_mac = (bytes(conn.read(nbody)), conn.read(auth.MAC_BYTES)) if ours else (b"", b"")
    if not auth.verify(key, head_mac, b"hello-head", their_head):
        raise failed
    if not ours:
        raise LinkError(f"{conn.name} speaks another protocol version ({magic!r}): use the same erniekit everywhere")
    if not auth.verify(key, body_mac, b"hello", their_head, their_body):
        raise failed
    expected = {peer} if peer is not None else accept
    if their_rank != rank or cid not in expected:
        raise LinkError(
            f"{_peer_name(cid, their_rank, conn.where)} reached cluster {me} rank {rank}, which expected "
            f"cluster {sorted(expected)} rank {rank}: every cluster needs the same cross_cluster_peers and layout"
        )
    conn.name = _peer_name(cid, their_rank, conn.where)
    low, high = (nonce, their_nonce) if me < cid else (their_nonce, nonce)
    skey = auth.session_key(key, struct.pack(">III", min(me, cid), max(me, cid), rank), low, high)
    conn.send(*_frame(skey, me, 0, _CONFIRM.encode(), b""))
    tag, _ = _read_frame(conn, skey, cid, 0)  # fails when the hello was replayed from another session
    if tag != _CONFIRM:
        raise LinkError(f"{conn.name} did not confirm the handshake (sent {tag!r}): a different erniekit version")
    return cid, skey, _parse_hello(their_body, conn.name)


def _parse_hello(body: bytes, name: str) -> dict:
    """The peer's hello JSON; authenticated, but a peer of another version may still send what this
    one cannot read, which must stop the link with one line, not a traceback."""
    try:
        hello = json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        hello = None
    if not isinstance(hello, dict):
        raise LinkError(
            f"{name} sent a hello that is not a JSON object: a different erniekit version; use the same everywhere"
        )
    return hello


class PeerLink:
    """Duplex, authenticated message channel to the same rank in one other cluster.

    Built by `connect` / `accept` (normally through CrossClusterLinks.open). send() queues a copy of
    the payload for the sender thread; recv() returns messages in order. After any failure every later
    send()/recv() raises the same one-line error."""

    def __init__(
        self,
        sock: socket.socket,
        conn: _Conn,
        me: int,
        peer: int,
        skey: bytes,
        hello: dict,
        shape: LinkShape,
        timeout_s: float,
    ) -> None:
        self.cluster_id, self.peer_cluster_id, self.hello = me, peer, hello
        self.shape, self.timeout_s = shape, timeout_s
        self.name = conn.name
        self._sock, self._conn, self._skey = sock, conn, skey
        self._stats = LinkStats(
            bytes_sent=conn.sent, bytes_received=conn.received, messages_sent=1, messages_received=1
        )
        self._lock = threading.Lock()
        self._error: LinkError | None = None
        self._closing = False
        self._send_seq = 1
        self._link_free_at = self._last_end = 0.0  # emulated link busy until; end of the last message's send
        self._outbox: queue.Queue = queue.Queue(_SENDER_QUEUE)
        self._inbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name=f"cc-send-{peer}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"cc-recv-{peer}", daemon=True)
        self._sender.start()
        self._reader.start()

    # ----------------------------------------------------------------- opening
    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        cluster_id: int,
        rank: int,
        peer_cluster_id: int,
        key: bytes,
        hello: dict,
        shape: LinkShape = LinkShape(),
        connect_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        deadline: float | None = None,
    ) -> PeerLink:
        """Connect to the listening peer (a lower cluster id), retrying until connect_timeout_s after
        now, or until `deadline` (time.monotonic()) when given."""
        where = f"{host}:{port}"
        deadline = time.monotonic() + connect_timeout_s if deadline is None else deadline
        pause, last = 0.02, None
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic()))
                return cls._handshaken(
                    sock, where, deadline, key, cluster_id, rank, hello, None, peer_cluster_id, shape, timeout_s
                )
            except _Unheard as e:
                if time.monotonic() + pause > deadline:
                    raise LinkError(str(e)) from None
            except OSError as e:
                last = e.strerror or type(e).__name__
            if time.monotonic() + pause > deadline:
                raise LinkError(
                    f"could not connect to {_peer_name(peer_cluster_id, rank, where)} in {connect_timeout_s:g} s "
                    f"({last}): start that cluster and check cross_cluster_peers"
                )
            time.sleep(pause)
            pause = min(0.5, pause * 2)

    @classmethod
    def accept(
        cls,
        listener: socket.socket,
        *,
        cluster_id: int,
        rank: int,
        peers: set[int],
        key: bytes,
        hello: dict,
        deadline: float,
        shape: LinkShape = LinkShape(),
        timeout_s: float = 600.0,
    ) -> PeerLink:
        """Accept one connection on `listener` from any cluster in `peers` (higher ids) before `deadline`
        (time.monotonic()); the peer's cluster id is the authenticated one of its hello."""
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        sock, addr = listener.accept()  # socket.timeout is turned into a LinkError by the caller
        where = f"{addr[0]}:{addr[1]}"
        return cls._handshaken(sock, where, deadline, key, cluster_id, rank, hello, peers, None, shape, timeout_s)

    @classmethod
    def _handshaken(cls, sock, where, deadline, key, me, rank, hello, accept, peer, shape, timeout_s) -> PeerLink:
        name = _peer_name(peer, rank, where) if peer is not None else f"a cluster at {where}"
        conn = _Conn(sock, name, where)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            cid, skey, their_hello = _handshake(conn, key, me, rank, hello, accept, peer)
            sock.settimeout(None)  # from here the threads block; timeouts are the callers' (recv, close)
        except (TimeoutError, socket.timeout):
            sock.close()
            raise LinkError(
                f"handshake with {conn.name} did not finish in time: the peer is not an erniekit cluster, "
                "is stuck, or the link is down; check cross_cluster_peers"
            ) from None
        except OSError as e:
            sock.close()
            err = LinkError(f"link to {conn.name} failed during the handshake ({e.strerror or e}): {RESTART}")
            raise (_Unheard(str(err)) if peer is not None and conn.received == 0 else err) from None
        except LinkError as e:
            sock.close()
            if peer is not None and conn.received == 0 and not isinstance(e, AuthError):
                raise _Unheard(str(e)) from None
            raise
        except BaseException:
            sock.close()
            raise
        return cls(sock, conn, me, cid, skey, their_hello, shape, timeout_s)

    # --------------------------------------------------------------- messages
    def send(self, tag: str, payload: bytes | bytearray | memoryview) -> None:
        """Queue one message (the payload is copied: the caller may reuse its buffer); returns at once
        unless _SENDER_QUEUE messages are already waiting, then waits up to timeout_s for room."""
        self._raise_if_failed()
        tag_b = tag.encode("utf-8")
        if not 0 < len(tag_b) <= 32 or b"\0" in tag_b:
            raise LinkError(f"message tag {tag!r}: use 1 to 32 UTF-8 bytes without NUL")
        item = (tag_b, bytes(payload), time.monotonic())
        try:
            self._outbox.put(item, timeout=self.timeout_s)
        except queue.Full:
            raise LinkError(
                f"{_SENDER_QUEUE} messages to {self.name} still unsent after {self.timeout_s:g} s; "
                "raise cross_cluster_timeout_s or check the link"
            ) from None

    def recv(self, timeout_s: float | None = None, expect: str | None = None) -> tuple[str, bytes]:
        """The next message (tag, payload), waiting at most timeout_s (default: the link's timeout_s).
        With `expect`, a message with another tag is an error (the clusters disagree on the protocol)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        try:
            item = self._inbox.get(timeout=wait)
        except queue.Empty:
            raise LinkError(
                f"no message from {self.name} in {wait:g} s; raise cross_cluster_timeout_s or check the link"
            ) from None
        finally:
            self._stats.recv_wait_seconds += time.monotonic() - t0
        if item is None:  # a failure, recorded in self._error before the marker was queued
            self._inbox.put(None)
            self._raise_if_failed()
        tag, payload = item
        if expect is not None and tag != expect:
            self._fail(
                LinkError(
                    f"expected a {expect!r} message from {self.name}, got {tag!r}: the clusters run different "
                    "erniekit versions or configs; use the same on every cluster"
                )
            )
            self._raise_if_failed()
        return tag, payload

    def stats(self) -> LinkStats:
        """A snapshot of this link's counters."""
        s = self._stats
        return LinkStats(**{f.name: getattr(s, f.name) for f in fields(s)})

    def close(self, flush_s: float | None = None) -> None:
        """Send what is queued (waiting up to flush_s, default timeout_s), then close the connection."""
        if self._closing:
            return
        wait = self.timeout_s if flush_s is None else flush_s
        if self._error is None:  # let the sender finish what is queued
            try:
                self._outbox.put(None, timeout=wait)
                self._sender.join(wait)
            except queue.Full:
                pass  # the link is stuck: shutting the socket below unblocks the sender
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already reset by the peer
        self._sock.close()
        try:
            self._outbox.put_nowait(None)  # wakes a sender still waiting for work
        except queue.Full:
            pass  # it is in sendall on the shut socket and will fail out
        self._sender.join(1.0)
        self._reader.join(1.0)

    # ----------------------------------------------------------------- threads
    def _fail(self, err: LinkError) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
                self._inbox.put(None)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise type(self._error)(str(self._error))

    def _lost(self, e: OSError) -> LinkError:
        if self._closing:
            return LinkError(f"link to {self.name} was closed by this process")
        return LinkError(f"link to {self.name} failed ({e.strerror or type(e).__name__}): {RESTART}")

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None or self._error is not None:
                return
            try:
                self._transmit(*item)
            except OSError as e:
                self._fail(self._lost(e))
                return

    def _transmit(self, tag: bytes, payload: bytes, queued_at: float) -> None:
        parts = _frame(self._skey, self.cluster_id, self._send_seq, tag, payload)  # the MACs overlap the emulated wait
        n = _HEAD.size + 2 * auth.MAC_BYTES + len(payload)
        if self.shape.emulated:  # one message at a time on the emulated pipe, then the latency
            if self.shape.shared_dir:
                done = _shared_pipe(self.shape, self.cluster_id, self.peer_cluster_id, queued_at, n)
            else:
                done = max(queued_at, self._link_free_at) + self.shape.transmit_seconds(n)
                self._link_free_at = done
            pause = done + self.shape.latency_ms / 1000.0 - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        before = self._conn.sent
        self._conn.send(*parts)
        self._send_seq += 1
        end = time.monotonic()
        s = self._stats
        s.bytes_sent += self._conn.sent - before
        s.messages_sent += 1
        s.send_seconds += end - max(queued_at, self._last_end)
        self._last_end = end

    def _read_loop(self) -> None:
        seq = 1
        while True:
            before = self._conn.received
            try:
                item = _read_frame(self._conn, self._skey, self.peer_cluster_id, seq)
            except LinkError as e:
                self._fail(LinkError(f"link to {self.name} was closed by this process") if self._closing else e)
                return
            except OSError as e:
                self._fail(self._lost(e))
                return
            except MemoryError:
                self._fail(LinkError(f"link to {self.name}: no memory for its next message; the job stops"))
                return
            seq += 1
            self._stats.bytes_received += self._conn.received - before
            self._stats.messages_received += 1
            self._inbox.put(item)


class _Acceptor:
    """The listening side of CrossClusterLinks.open. Anyone who can reach the port can connect, so
    each connection is handshaken in a thread of its own with handshake_s to finish: one that never
    speaks, sends garbage, fails its MAC or claims a cluster already linked is closed and reported
    on stderr, and neither blocks nor fails the real peers' handshakes."""

    def __init__(
        self, listener, listen, rank: int, peers: set[int], deadline: float, wait_s: float, handshake_s: float
    ):
        self.listener, self.listen, self.rank, self.peers = listener, listen, rank, peers
        self.deadline, self.wait_s, self.handshake_s = deadline, wait_s, handshake_s
        self.results: queue.Queue = queue.Queue()
        self.inflight: dict[socket.socket, None] = {}  # in the order accepted
        self.evicted: set[socket.socket] = set()  # closed to make room for newer connections
        self.lock = threading.Lock()
        self.done = False
        self.refused, self.last_refused = 0, None  # a count, not a list: a flood must not grow memory
        self.stop = lambda: 0  # -> a pending stop signal; set by CrossClusterLinks.open

    def run(self, links: dict[int, PeerLink], handshake) -> None:
        """Fill `links` with a link to every cluster in `peers` before the deadline, or raise."""
        try:
            while self.peers - links.keys():
                self._collect(links)
                if not self.peers - links.keys():
                    break
                if time.monotonic() >= self.deadline:
                    raise self._timeout(links)
                if self.stop():
                    missing = sorted(self.peers - links.keys())
                    raise LinkError(f"stopped (signal {self.stop()}) while waiting for cluster(s) {missing} to connect")
                self._accept_one(handshake)
        finally:
            with self.lock:
                self.done = True
                for sock in self.inflight:  # strangers still talking: their threads fail out at once
                    _shut(sock)
            self._collect(links)

    def _accept_one(self, handshake) -> None:
        self.listener.settimeout(max(0.0, min(_POLL_S, self.deadline - time.monotonic())))
        try:
            sock, addr = self.listener.accept()
        except (TimeoutError, socket.timeout):
            return
        except OSError as e:  # e.g. out of file descriptors under a flood: wait and go on
            self._refuse(LinkError(f"accepting on {self.listen[0]}:{self.listen[1]} failed ({e.strerror or e})"))
            time.sleep(_POLL_S)
            return
        where = f"{addr[0]}:{addr[1]}"
        with self.lock:  # full: the oldest stranger makes room (a real peer finishes in a round trip)
            oldest = next(iter(self.inflight)) if len(self.inflight) >= _MAX_HANDSHAKES else None
            if oldest is not None:
                self.evicted.add(oldest)
                _shut(oldest)
            self.inflight[sock] = None
        until = min(self.deadline, time.monotonic() + self.handshake_s)
        threading.Thread(
            target=self._shake, args=(handshake, sock, where, until), name="cc-handshake", daemon=True
        ).start()

    def _shake(self, handshake, sock: socket.socket, where: str, until: float) -> None:
        try:
            got = handshake(sock, where, until, set(self.peers))
        except LinkError as e:
            got = e
        except Exception as e:  # noqa: BLE001 - anything a stranger's bytes provoke refuses that stranger only
            _shut(sock)
            got = LinkError(f"handshake with a cluster at {where} failed ({type(e).__name__})")
        with self.lock:
            self.inflight.pop(sock, None)
            evicted, late = sock in self.evicted, self.done
            self.evicted.discard(sock)
        if (evicted or late) and isinstance(got, PeerLink):
            got.close(flush_s=0)  # its socket was shut under it, or nobody waits for it any more
        if evicted:
            got = LinkError(f"a cluster at {where} had not finished its handshake after {_MAX_HANDSHAKES} newer ones")
        if not late:
            self.results.put(got)

    def _collect(self, links: dict[int, PeerLink]) -> None:
        while True:
            try:
                got = self.results.get_nowait()
            except queue.Empty:
                return
            if isinstance(got, LinkError):
                self._refuse(got)
            elif got.peer_cluster_id in links or self.done:
                got.close(flush_s=0)
                if not self.done:
                    self._refuse(LinkError(f"{got.name} connected a second time: the second link is closed"))
            else:
                links[got.peer_cluster_id] = got

    def _refuse(self, err: LinkError) -> None:
        err = type(err)(str(err).removesuffix("; the job stops"))  # this side waits on for its real peers
        self.refused, self.last_refused = self.refused + 1, err
        if self.refused <= _REPORTED:
            print(f"erniekit: cross-cluster: refused a connection: {err}", file=sys.stderr, flush=True)
        if self.refused == _REPORTED:
            print("erniekit: cross-cluster: further refused connections are counted, not shown", file=sys.stderr)

    def _timeout(self, links: dict[int, PeerLink]) -> LinkError:
        missing = sorted(self.peers - links.keys())
        msg = (
            f"cluster(s) {missing} rank {self.rank} did not connect to {self.listen[0]}:{self.listen[1]} in "
            f"{self.wait_s:g} s: start them and check that every cluster has the same cross_cluster_peers"
        )
        last = self.last_refused
        if last is None:
            return LinkError(msg)
        return type(last)(f"{msg}; refused {self.refused} connection(s), the last: {last}")


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more
    sock.close()


class CrossClusterLinks:
    """This process's links to the same rank in every other cluster (one PeerLink per cluster)."""

    def __init__(self, cluster_id: int, rank: int, links: dict[int, PeerLink], hellos: list[dict]) -> None:
        self.cluster_id, self.rank, self.hellos = cluster_id, rank, hellos
        self._links = links

    @classmethod
    def open(
        cls,
        cluster_id: int,
        rank: int,
        addresses: list[str],
        key: bytes,
        shape: LinkShape = LinkShape(),
        hello: dict | None = None,
        connect_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        bind_host: str | None = None,
        handshake_timeout_s: float = _HANDSHAKE_S,
        stop=None,
    ) -> CrossClusterLinks:
        """Open links to rank `rank` of every cluster in `addresses` (host:base_port, in cluster order).
        Listens on addresses[cluster_id] port + rank (bound to bind_host if given, e.g. 0.0.0.0 behind
        NAT); connects to the lower ids first, then accepts the higher ones. `hellos` then holds every
        cluster's hello dict in cluster order (this one's included). A connection that fails or stalls
        its handshake (handshake_timeout_s) is refused and reported, and the wait goes on. stop() -> a
        pending stop signal (0: none) ends the wait for the higher clusters at once."""
        if not 0 <= cluster_id < len(addresses):
            raise ConfigError(
                f"cross-cluster id {cluster_id} is not an index of the {len(addresses)} cluster addresses"
            )
        where = [parse_address(a, f"cross_cluster_peers[{i}]") for i, a in enumerate(addresses)]
        for i, (_, port) in enumerate(where):
            if port + rank > 65535:
                raise ConfigError(
                    f"cross_cluster_peers[{i}]={addresses[i]}: rank {rank} would use port {port + rank}, past 65535; "
                    "use a base port at least the processes per cluster below 65536"
                )
        hello = dict(hello or {})
        deadline = time.monotonic() + connect_timeout_s
        higher = set(range(cluster_id + 1, len(addresses)))
        listener = None
        links: dict[int, PeerLink] = {}
        try:
            if higher:  # listen before connecting anywhere, so higher clusters can queue up meanwhile
                listen = (bind_host or where[cluster_id][0], where[cluster_id][1] + rank)
                try:
                    listener = socket.create_server(listen, backlog=len(higher) + _MAX_HANDSHAKES)
                except OSError as e:
                    raise LinkError(
                        f"cluster {cluster_id} rank {rank} cannot listen on {listen[0]}:{listen[1]} "
                        f"({e.strerror}): cross_cluster_peers[{cluster_id}] needs an address of this machine and "
                        "a free base port"
                    ) from None
            for c in range(cluster_id):
                host, port = where[c]
                links[c] = PeerLink.connect(
                    host,
                    port + rank,
                    cluster_id=cluster_id,
                    rank=rank,
                    peer_cluster_id=c,
                    key=key,
                    hello=hello,
                    shape=shape,
                    connect_timeout_s=connect_timeout_s,
                    deadline=deadline,
                    timeout_s=timeout_s,
                )
            if higher:
                acceptor = _Acceptor(listener, listen, rank, higher, deadline, connect_timeout_s, handshake_timeout_s)
                acceptor.stop = stop or (lambda: 0)
                acceptor.run(
                    links,
                    lambda sock, where, until, peers: PeerLink._handshaken(
                        sock, where, until, key, cluster_id, rank, hello, peers, None, shape, timeout_s
                    ),
                )
        except BaseException:
            for link in links.values():
                link.close(flush_s=0)
            raise
        finally:
            if listener is not None:
                listener.close()
        hellos = [hello if c == cluster_id else links[c].hello for c in range(len(addresses))]
        return cls(cluster_id, rank, links, hellos)

    @property
    def n_clusters(self) -> int:
        return len(self._links) + 1

    def peer(self, cluster_id: int) -> PeerLink:
        return self._links[cluster_id]

    def all_gather(
        self, tag: str, payload: bytes | bytearray | memoryview, timeout_s: float | None = None
    ) -> list[bytes]:
        """Every cluster's payload in cluster order (this cluster's own is not sent to itself). Sends to
        all peers first (in the background), then receives from each."""
        own = bytes(payload)
        for link in self._links.values():
            link.send(tag, own)
        return [
            own if c == self.cluster_id else self._links[c].recv(timeout_s, expect=tag)[1]
            for c in range(self.n_clusters)
        ]

    def stats(self) -> LinkStats:
        """Counters summed over the links."""
        total = LinkStats()
        for link in self._links.values():
            total = total + link.stats()
        return total

    def close(self, flush_s: float | None = None) -> None:
        for link in self._links.values():
            link.close(flush_s)

    def __enter__(self) -> CrossClusterLinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush_s=0 if exc[0] is not None else None)
