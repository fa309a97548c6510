"""The raw Get channel's framing, shared by the daemon (stream_server) and the client (stream_client).

Why a side channel: a streamed gRPC Get from Python moves a block through several fresh copies
(the store's bytes, each chunk message, the client's parse, reassembly) and gRPC's per-message
machinery; a plain socket sends the store's own view (``sendall``) and receives with
``recv_into`` a buffer the client owns, so the bytes are copied only by the kernel.

One connection, opened with a token from the gRPC call OpenStream, carries one Get at a time:

    client -> daemon   TOKEN_BYTES token, once, first
    client -> daemon   REQUEST: magic, key count; then per key: u16 length, key bytes
    daemon -> client   per key, in order: FRAME(FOUND, n) + n bytes, or FRAME(MISS, 0)
    daemon -> client   FRAME(DONE, 0) once every key is answered
    daemon -> client   FRAME(ERR_*, n) + n bytes of UTF-8 message instead; then it closes
"""

from __future__ import annotations

import socket
import struct

TOKEN_BYTES = 32
MAGIC = b"TKG1"
REQUEST = struct.Struct("!4sI")  # magic, number of keys
KEY_LEN = struct.Struct("!H")
FRAME = struct.Struct("!BQ")  # kind, length of what follows

MISS, FOUND, DONE = 0, 1, 2
ERR_INVALID, ERR_UNAVAILABLE, ERR_EXHAUSTED, ERR_INTERNAL = 10, 11, 12, 13
ERR_DENIED = 14  # a key outside the credential the connection's token was issued to


def encode_request(keys: list[bytes]) -> bytes:
    return REQUEST.pack(MAGIC, len(keys)) + b"".join(KEY_LEN.pack(len(k)) + k for k in keys)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; EOFError if the peer closed first."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += r
