"""The daemon's raw Get channel (framing in stream_wire): bounded, token-authenticated.

Trust: a connection is served only after it presents a token issued by the gRPC call
OpenStream — single use, valid for ``handshake_s`` — so whoever may call the gRPC API (and only
they) may read here. The token is bound to the credential of that call, and every request's keys
are checked against that credential as it is at the time of the request (a reload that revokes it
applies at once), as a gRPC Get's are (kvstore/server/credentials.py): one refused key answers the
request with ERR_DENIED, nothing sent, and closes the connection.

TLS: with ``tls`` (the daemon's gRPC TLS, kvstore/server/stream_tls.py) every connection is TLS,
its handshake done on the connection's own thread within ``handshake_s``; a plaintext client fails
the handshake before anything of it is read, and nothing is ever sent to it.

Bounds: at most ``max_conns`` connections and unused tokens together (OpenStream is refused past
it and the client streams over gRPC instead); a connection that does not authenticate within
``handshake_s`` or stays idle ``idle_s`` is closed; one request's keys are at most ``max_keys``
(the daemon's ``max_keys_per_call``, ``MAX_KEYS`` at most) and ``max_request_bytes``. Blocks are
sent from the store's own view with ``sendall``, so a call holds no copy of a block: bytes in
flight are bounded by the socket buffers. A send that cannot progress for ``send_s`` (a client
that stopped reading) ends the connection.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.block import MAX_KEY_LEN
from kvstore.errors import StoreClosed
from kvstore.server import stream_wire as w
from kvstore.server.credentials import ADMIN, Caller

log = logging.getLogger(__name__)
MAX_KEYS = 65536
Who = Callable[[], "Caller | None"]  # the credential a token was issued to, as it is now (None: revoked)


class _Readable(Protocol):
    def read(self, key: bytes, sink: Callable[[memoryview], Any]) -> Any: ...


class _Refused(Exception):
    def __init__(self, kind: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StreamServer:
    def __init__(self, store: _Readable, host: str = "127.0.0.1", port: int = 0, max_conns: int = 16,
                 max_request_bytes: int = 8 * 1024**2, handshake_s: float = 10.0, idle_s: float = 300.0,
                 send_s: float = 60.0, max_keys: int = MAX_KEYS, tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.store, self.max_conns, self.max_request_bytes = store, max_conns, max_request_bytes
        self.tls = tls  # None: plaintext (a daemon whose gRPC is plaintext)
        self.max_keys = min(max_keys, MAX_KEYS)
        self.handshake_s, self.idle_s, self.send_s = handshake_s, idle_s, send_s
        self._listener = socket.create_server((host.strip("[]"), port), family=_family(host), backlog=max_conns)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._tokens: dict[bytes, tuple[float, Who]] = {}  # token -> (expiry (monotonic), whose it is)
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-stream-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def issue(self, who: Who = lambda: ADMIN) -> bytes | None:
        """A fresh single-use token for ``who`` (the credential of the OpenStream call, resolved at
        each request: its connection may read what that credential may now), or None when
        connections and tokens are at their limit."""
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: v for t, v in self._tokens.items() if v[0] > now}
            if self._closed or len(self._tokens) + len(self._conns) >= self.max_conns:
                return None
            token = os.urandom(w.TOKEN_BYTES)
            self._tokens[token] = (now + self.handshake_s, who)
            return token

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:  # close() alone does not wake a thread blocked in accept() on Linux; shutdown does
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.ident is not None:  # a daemon stopped before it started has no thread
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                log.warning("stream accept thread did not stop within 5 s")

    # -- connections ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = self._closed or len(self._conns) >= self.max_conns
                if not full:
                    self._conns.add(conn)
            if full:  # every slot is taken (tokens included): nobody here holds a valid token
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-stream", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self._wrap(conn)
                self._handshake(conn)
            who = self._authenticate(conn)
            if who is not None:
                while self._serve_one(conn, who):
                    pass
        except (OSError, EOFError):
            pass  # the client went away or stalled: nothing to answer
        except Exception:
            log.exception("stream channel: unexpected error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _wrap(self, raw: socket.socket) -> ssl.SSLSocket:
        """The connection as a TLS socket, not yet shaken hands (no I/O). It takes over the raw
        socket's descriptor and its place among the connections, so ``close`` reaches it."""
        assert self.tls is not None
        conn = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            self._conns.discard(raw)
            self._conns.add(conn)
        return conn

    def _handshake(self, conn: ssl.SSLSocket) -> None:
        """Within ``handshake_s``; ssl.SSLError (an OSError) when the client does not speak TLS,
        does not trust the certificate, or (mutual TLS) has no certificate the client CA signed."""
        conn.settimeout(self.handshake_s)
        try:
            conn.do_handshake()
        except OSError as e:
            log.warning("stream channel: TLS handshake failed (%s): connection closed", e)
            raise

    def _authenticate(self, conn: socket.socket) -> Who | None:
        """The credential the connection's token was issued to; None: no valid token."""
        conn.settimeout(self.handshake_s)
        token = w.recv_exact(conn, w.TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            match = next((t for t in self._tokens if hmac.compare_digest(t, token)), None)
            grant = self._tokens.pop(match) if match is not None else None  # single use, even if late
        if grant is None or grant[0] <= now:
            log.warning("stream channel: connection without a valid token refused")
            return None
        return grant[1]

    def _serve_one(self, conn: socket.socket, who: Who) -> bool:
        """Answer one request; False once the connection should close."""
        conn.settimeout(self.idle_s)
        try:
            head = _recv_head(conn)
        except TimeoutError:
            return False
        if not head:
            return False  # the client closed it
        conn.settimeout(self.send_s)
        try:
            keys = self._read_keys(conn, head)
            caller = who()
            if caller is None:
                raise _Refused(w.ERR_DENIED, "permission denied: the credential this connection was opened with "
                                             "is no longer valid")
            if (why := caller.refusal(keys, write=False)) is not None:  # before any block is sent
                raise _Refused(w.ERR_DENIED, f"permission denied: {why}")
            for k in keys:
                if self.store.read(k, lambda mv, conn=conn: self._send_block(conn, mv)) is None:  # type: ignore[misc]
                    conn.sendall(w.FRAME.pack(w.MISS, 0))
            conn.sendall(w.FRAME.pack(w.DONE, 0))
        except _Refused as e:
            self._refuse(conn, e.kind, str(e))
            return False
        except StoreClosed as e:
            self._refuse(conn, w.ERR_UNAVAILABLE, str(e))
            return False
        return True

    def _read_keys(self, conn: socket.socket, head: bytes) -> list[bytes]:
        if len(head) != w.REQUEST.size:
            raise EOFError("request header cut short")
        magic, n = w.REQUEST.unpack(head)
        if magic != w.MAGIC:
            raise _Refused(w.ERR_INVALID, f"not a stream-channel request (magic {magic!r})")
        if n > self.max_keys:
            raise _Refused(w.ERR_INVALID, f"{n} keys in one call (max {self.max_keys})")
        keys: list[bytes] = []
        total = 0
        for i in range(n):
            (klen,) = w.KEY_LEN.unpack(w.recv_exact(conn, w.KEY_LEN.size))
            if not 0 < klen <= MAX_KEY_LEN:
                raise _Refused(w.ERR_INVALID, f"key {i}: length {klen} outside 1..{MAX_KEY_LEN}")
            total += klen
            if total > self.max_request_bytes:
                raise _Refused(w.ERR_EXHAUSTED, f"request keys over {self.max_request_bytes} bytes")
            keys.append(w.recv_exact(conn, klen))
        return keys

    @staticmethod
    def _send_block(conn: socket.socket, mv: memoryview) -> bool:
        conn.sendall(w.FRAME.pack(w.FOUND, mv.nbytes))
        conn.sendall(mv)
        return True

    def _refuse(self, conn: socket.socket, kind: int, message: str) -> None:
        """Send the error, then read (and drop) what the client still sends for a moment, so
        closing does not reset the connection before the client has read the error."""
        msg = message.encode()[:4096]
        conn.sendall(w.FRAME.pack(kind, len(msg)) + msg)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        left = self.max_request_bytes
        try:
            while left > 0 and (n := len(conn.recv(min(left, 65536)))):
                left -= n
        except OSError:
            pass


def _recv_head(conn: socket.socket) -> bytes:
    """A request's header, or what came of it before the client closed (b"": closed between
    requests). A loop, not MSG_WAITALL, which a TLS socket does not take."""
    buf = bytearray(w.REQUEST.size)
    got = 0
    while got < len(buf) and (n := conn.recv_into(memoryview(buf)[got:])):
        got += n
    return bytes(buf[:got])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
