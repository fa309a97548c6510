"""The unix socket between a same-host client and the daemon: how a segment's fd gets there.

Why a socket and not a path: a file descriptor passed with SCM_RIGHTS reaches exactly the process
it was sent to, across PID and IPC namespaces (containers), and nobody else can open it by name;
the connection, held open for the session's life, is closed by the kernel when the client dies,
so the daemon learns of a dead client from the kernel rather than from a pid it was told
(every process in a container is PID 1 in its own namespace). The daemon reads the peer's
credentials (SO_PEERCRED) on it and checks the segment is that user's.

The exchange (SOCK_SEQPACKET, so each message arrives whole): the client sends ``ShmHello`` (the
single-use ticket AttachShm gave it, the segment's size) with the segment's fd; the daemon
answers ``ShmWelcome`` (ok, the session id, and with the arena, its read-only fd). Nothing else
is ever sent; the daemon ends a connection that sends more. Daemon side:
kvstore/server/shm_listener.py.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager

from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb

MAX_MESSAGE = 4096  # a hello or a welcome is well under it
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less its terminating NUL


@contextmanager
def unix_address(path: str) -> Iterator[str]:
    """``path`` as an address bind/connect accept: a path longer than sun_path is reached
    through its directory's descriptor (/proc/self/fd/N/name), which the kernel resolves."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    head, name = os.path.split(path)
    dirfd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{dirfd}/{name}"
    finally:
        os.close(dirfd)


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, from the kernel (SO_PEERCRED), as this
    process's namespaces see them."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))  # fmt: skip
    return pid, uid


def join(path: str, ticket: bytes, fd: int, size: int, timeout_s: float) -> tuple[socket.socket, pb.ShmWelcome,
                                                                                    int | None]:  # fmt: skip
    """Hand the segment ``fd`` to the daemon listening at ``path``: (the connection, which the
    caller keeps open for as long as the session lives; the daemon's answer; the arena's fd, the
    caller's to close, or None). OSError when the socket cannot be reached (another host, another
    mount), ValueError when the answer is not a welcome."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        conn.settimeout(timeout_s)
        with unix_address(path) as addr:
            conn.connect(addr)
        socket.send_fds(conn, [pb.ShmHello(ticket=ticket, size=size).SerializeToString()], [fd])
        data, fds, _flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
        if not data:
            raise ValueError("the daemon closed its socket without an answer")
        try:
            welcome = pb.ShmWelcome.FromString(data)
        except DecodeError:
            raise ValueError("not a kvstore daemon's answer on its shared-memory socket") from None
        arena = fds.pop() if fds and welcome.ok and welcome.arena_size else None
        return conn, welcome, arena
    except BaseException:
        conn.close()
        raise
    finally:
        for extra in fds:
            os.close(extra)
