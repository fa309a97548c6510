"""The raw Get channel refuses what it should, with a clear message, and stays within its bounds.

Raw sockets speak to the real stream server (in-process, beside the real servicer): a connection
without a valid token gets nothing; malformed or oversized requests get a one-line error frame;
connections and unused tokens are bounded, stalled handshakes are closed; the daemon keeps
serving throughout.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest

from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import stream_wire as w
from kvstore.server.stream_server import MAX_KEYS
from tests.fixtures_kvstore import (
    MIB,
    WAIT_S,
    StreamDaemon,
    big_block,
    connect,
    fetch,
    fetch_one,
    stream_daemon,
)


def _token(c: KVStoreClient) -> tuple[int, bytes]:
    resp = c._stub.OpenStream(pb.OpenStreamRequest(), timeout=WAIT_S)
    assert resp.ok, resp.reason
    return resp.port, resp.token


def _token_eventually(c: KVStoreClient) -> tuple[int, bytes]:
    """A token once a slot is free (slots free up asynchronously: expiry, the daemon seeing EOF)."""
    deadline = time.monotonic() + WAIT_S
    while not (resp := c._stub.OpenStream(pb.OpenStreamRequest(), timeout=WAIT_S)).ok:
        assert time.monotonic() < deadline, f"no slot came free: {resp.reason}"
        time.sleep(0.1)
    return resp.port, resp.token


def _connect(port: int, token: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.sendall(token)
    return s


def _reply(s: socket.socket) -> tuple[int, bytes]:
    """(kind, message) of the first frame, or (-1, b"") if the daemon closed the connection."""
    try:
        head = s.recv(w.FRAME.size, socket.MSG_WAITALL)
    except ConnectionResetError:  # closed with our request unread
        return -1, b""
    if not head:
        return -1, b""
    kind, n = w.FRAME.unpack(head)
    return kind, s.recv(n, socket.MSG_WAITALL) if kind >= w.ERR_INVALID else b""


def _still_serves(d: StreamDaemon) -> None:
    k, v = big_block(99, mib=1)
    with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True) as c:
        c.put(k, v)
        assert fetch_one(c, k) == v


@pytest.mark.parametrize("token", ["wrong", "reused"])
def test_connection_without_a_valid_token_gets_nothing(token: str) -> None:
    with stream_daemon() as d, connect(d, deadline_s=WAIT_S) as c:
        k, _ = big_block(1, mib=1)
        c.put(k, big_block(1, mib=1)[1])
        port, tok = _token(c)
        if token == "reused":
            with _connect(port, tok) as first:
                first.sendall(w.encode_request([k]))
                assert _reply(first)[0] == w.FOUND
        with _connect(port, tok if token == "reused" else b"x" * w.TOKEN_BYTES) as s:
            s.sendall(w.encode_request([k]))
            assert _reply(s) == (-1, b"")  # closed without a byte of the block
        _still_serves(d)


@pytest.mark.parametrize(
    ("request_bytes", "kind", "message"),
    [
        (b"HTTP/1.1 GET /", w.ERR_INVALID, b"not a stream-channel request"),
        (w.REQUEST.pack(w.MAGIC, MAX_KEYS + 1), w.ERR_INVALID, b"keys in one call (max 65536)"),
        (w.REQUEST.pack(w.MAGIC, 2) + struct.pack("!H", 3) + b"abc" + struct.pack("!H", 0), w.ERR_INVALID,
         b"key 1: length 0 outside 1..256"),
        (w.REQUEST.pack(w.MAGIC, 8) + (struct.pack("!H", 200) + b"k" * 200) * 8, w.ERR_EXHAUSTED,
         b"request keys over 1024 bytes"),
    ],
    ids=["bad-magic", "too-many-keys", "empty-key", "oversized-request"],
)  # fmt: skip
def test_malformed_request_gets_a_clear_error(request_bytes: bytes, kind: int, message: bytes) -> None:
    with stream_daemon(max_request_bytes=1024) as d, connect(d, deadline_s=WAIT_S) as c:
        with _connect(*_token(c)) as s:
            s.sendall(request_bytes)
            got_kind, got_msg = _reply(s)
            assert got_kind == kind and message in got_msg, got_msg
            assert _reply(s) == (-1, b"")  # and the connection is closed
        _still_serves(d)


def test_client_sees_a_refusal_typed_and_not_retried() -> None:
    with stream_daemon() as d:
        with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=Retry(attempts=3)) as c:
            with pytest.raises(InvalidRequest, match="key 0: length 0"):
                fetch(c, [b""])
        _still_serves(d)


def test_client_refuses_a_block_over_its_limit() -> None:
    with stream_daemon() as d, connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True,
                                             max_block_bytes=MIB) as c:  # fmt: skip
        k, v = big_block(3, mib=2)
        c.put(k, v)
        with pytest.raises(KVStoreError, match="client limit"):
            fetch_one(c, k)


def test_connections_and_tokens_are_bounded() -> None:
    """At the limit OpenStream is refused and the client streams over gRPC instead; an unused
    token and a stalled handshake give their slot back after the handshake time."""
    with stream_daemon(max_conns=2, handshake_s=0.5) as d, connect(d, deadline_s=WAIT_S) as raw:
        k, v = big_block(5, mib=1)
        raw.put(k, v)
        held = connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True)
        try:
            assert fetch_one(held, k) == v  # one connection, kept idle
            _token(raw)  # a second slot: a token nobody uses
            assert not raw._stub.OpenStream(pb.OpenStreamRequest(), timeout=WAIT_S).ok
            with connect(d, deadline_s=WAIT_S, use_shm=False) as other:
                assert fetch_one(other, k) == v  # over gRPC
                assert not other._stream._idle
            _token_eventually(raw)  # the unused token expired and gave its slot back
        finally:
            held.close()
        port, _ = _token_eventually(raw)
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as stalled:  # sends no token
            assert stalled.recv(1) == b""  # closed by the daemon after handshake_s
        _still_serves(d)


def test_connections_past_the_limit_are_closed_at_once() -> None:
    """Every slot taken: a new connection (which cannot hold a valid token) gets no thread."""
    with stream_daemon(max_conns=1, handshake_s=10 * WAIT_S) as d, connect(d, deadline_s=WAIT_S) as c:
        with _connect(*_token(c)):
            deadline = time.monotonic() + WAIT_S
            while len(d.streams._conns) != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with socket.create_connection(("127.0.0.1", d.streams.port), timeout=WAIT_S) as extra:
                assert extra.recv(1) == b""


def test_idle_connection_is_closed_and_the_client_opens_another() -> None:
    with stream_daemon(idle_s=0.3) as d:
        k, v = big_block(6, mib=1)
        with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=Retry(attempts=1)) as c:
            c.put(k, v)
            assert fetch_one(c, k) == v
            assert c._stream._idle
            deadline = time.monotonic() + WAIT_S
            while d.streams._conns:  # the daemon closes it once idle
                assert time.monotonic() < deadline, "an idle connection was kept"
                time.sleep(0.05)
            assert fetch_one(c, k) == v  # not the dead one: a fresh one


def test_client_that_stops_reading_loses_its_connection() -> None:
    with stream_daemon(send_s=0.3) as d, connect(d, deadline_s=WAIT_S) as c:
        blocks = [big_block(i) for i in range(8)]
        c.put_many(blocks)
        with _connect(*_token(c)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.sendall(w.encode_request([k for k, _ in blocks]))  # and never reads the reply
            deadline = time.monotonic() + WAIT_S
            while d.streams._conns:
                assert time.monotonic() < deadline, "a stalled reply held its connection"
                time.sleep(0.05)
        _still_serves(d)
