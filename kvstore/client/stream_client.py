"""The client side of the raw Get channel (framing in stream_wire, daemon side in stream_server).

``StreamChannel.get`` reads one batch on a pooled connection: each block is received with
``recv_into`` straight into a buffer this client owns, then handed to the sink. The deadline
covers the whole call. A connection goes back to the pool only after a call that read its
``DONE``: after any failure (deadline, sink error, daemon gone) unread bytes of that call may
still be on their way, so the connection is closed and never read again.

With ``tls`` (the client's gRPC TLS, kvstore/server/stream_tls.py) each connection is TLS, the
daemon's certificate checked against the same CA and host name as its gRPC channel: the token
is sent only once the handshake succeeded. A failed handshake is a typed error of that call, not
a reason to send anything in plaintext.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable

from kvstore.errors import (
    InvalidRequest,
    KVStoreError,
    KVStoreTimeout,
    KVStoreUnavailable,
    PermissionDenied,
    ResourceExhausted,
)
from kvstore.server import stream_wire as w

log = logging.getLogger(__name__)
#: () -> (port, token), or None when the daemon refuses a connection now; raises when it has none
OpenFn = Callable[[], "tuple[int, bytes] | None"]
Sink = Callable[[int, memoryview], None]
_ERRORS = {w.ERR_INVALID: InvalidRequest, w.ERR_UNAVAILABLE: KVStoreUnavailable, w.ERR_EXHAUSTED: ResourceExhausted,
           w.ERR_DENIED: PermissionDenied}


class StreamChannel:
    def __init__(self, host: str, open_fn: OpenFn, max_block_bytes: int, keep_idle: int = 4,
                 tls: ssl.SSLContext | None = None) -> None:
        self.host, self.open_fn, self.tls = host.strip("[]"), open_fn, tls
        self.max_block_bytes, self.keep_idle = max_block_bytes, keep_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self.enabled = True  # off once the channel's port proved unreachable (e.g. not published)

    def get(self, keys: list[bytes], sink: Sink, timeout: float) -> bool:
        """``sink(i, view)`` per block found, the view over a buffer reused by the next block;
        False when no connection could be had (stream over gRPC instead)."""
        if not self.enabled:
            return False
        deadline = time.monotonic() + timeout
        conn = self._take(timeout)
        if conn is None:
            return False
        try:
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            conn.sendall(w.encode_request(keys))
            _read_reply(conn, len(keys), sink, deadline, self.max_block_bytes)
        except BaseException as e:
            conn.close()  # its reply may be half read: never used again
            typed = _typed(e)
            if typed is e:
                raise
            raise typed from None
        with self._lock:
            if len(self._idle) < self.keep_idle:
                self._idle.append(conn)
                return True
        conn.close()
        return True

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _take(self, timeout: float) -> socket.socket | None:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not select.select([conn], [], [], 0)[0]:
                    return conn
                conn.close()  # readable while idle: the daemon closed it (idle limit, restart)
        grant = self.open_fn()
        if grant is None:
            return None
        port, token = grant
        try:
            conn = socket.create_connection((self.host, port), timeout=timeout)
        except OSError as e:  # gRPC reached the daemon, this port does not: stream over gRPC from now on
            log.warning("stream channel %s:%d unreachable (%s): Gets stream over gRPC", self.host, port, e)
            self.enabled = False
            return None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:  # the handshake (within ``timeout``) before the token
                conn = self.tls.wrap_socket(conn, server_hostname=self.host)
            conn.sendall(token)
        except ssl.SSLCertVerificationError as e:
            conn.close()
            raise KVStoreUnavailable(f"stream channel {self.host}:{port}: TLS certificate refused: {e}") from None
        except OSError as e:
            conn.close()
            raise KVStoreUnavailable(f"stream channel {self.host}:{port} lost: {e}") from None
        return conn


def _read_reply(conn: socket.socket, n: int, sink: Sink, deadline: float, max_block: int) -> None:
    buf = bytearray()
    head = bytearray(w.FRAME.size)
    i = 0
    while True:
        _recv(conn, memoryview(head), deadline)
        kind, length = w.FRAME.unpack(head)
        if kind == w.DONE and i == n:
            return
        if kind in (w.FOUND, w.MISS) and i < n:
            if kind == w.FOUND:
                if length > max_block:
                    raise KVStoreError(f"daemon announced a {length}-byte block (client limit {max_block})")
                if len(buf) < length:
                    buf = bytearray(length)
                view = memoryview(buf)[:length]
                _recv(conn, view, deadline)
                sink(i, view)
            i += 1
            continue
        if kind in _ERRORS or kind == w.ERR_INTERNAL:
            msg = bytearray(min(length, 4096))
            _recv(conn, memoryview(msg), deadline)
            raise _ERRORS.get(kind, KVStoreError)(msg.decode(errors="replace"))
        raise KVStoreError(f"stream channel out of step: frame {kind} after {i} of {n} keys")


def _recv(conn: socket.socket, view: memoryview, deadline: float) -> None:
    got, n = 0, view.nbytes
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVStoreTimeout("daemon did not answer within the deadline (stream channel)")
        conn.settimeout(left)
        r = conn.recv_into(view[got:], n - got)
        if r == 0:
            raise KVStoreUnavailable(f"daemon closed the stream channel mid-reply ({got} of {n} bytes)")
        got += r


def _typed(e: BaseException) -> BaseException:
    if isinstance(e, TimeoutError):  # socket.timeout
        return KVStoreTimeout("daemon did not answer within the deadline (stream channel)")
    if isinstance(e, OSError):
        return KVStoreUnavailable(f"stream channel lost: {e}")
    return e
