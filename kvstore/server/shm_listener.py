"""The daemon's unix socket: where same-host clients hand over their segments, and stay connected.

One thread serves it with a selector (no thread per client). Each connection carries one
exchange (kvstore/client/shm_link.py): a hello with the segment's fd, checked and mapped by
``ShmSessions.bind``, answered with a welcome (and the cpu arena's read-only fd, when the
AttachShm call that issued the ticket was allowed it). The connection then stays open with
nothing on it: when it closes (the client closed the segment, exited or was killed: the kernel
closes its descriptors) the session is dropped at once. That is the daemon's only notion of a
client being alive; it holds in any PID namespace, unlike a pid the client claims.

Bounds (a client that misbehaves costs only itself): a connection that has not said hello
within ``hello_s`` is closed, at most ``max_pending`` wait at once (more are closed on accept),
one message of at most MAX_MESSAGE bytes and one fd is read (more fds are closed unread), and a
connection that sends anything after its hello loses its session.

The socket file is created 0660 in a directory the daemon owns; a stale one left by a daemon
that died is replaced, a live one is never taken over (ConfigError).
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import stat
import threading
import time
from pathlib import Path

from google.protobuf.message import DecodeError

from kvstore.client.shm_link import MAX_MESSAGE, peer_credentials, unix_address
from kvstore.errors import ResourceExhausted
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.shm_sessions import ShmSessions
from tiers.errors import ConfigError
from tiers.memfd import ArenaShare

log = logging.getLogger(__name__)


def _claim(path: Path) -> None:
    """Make room for our socket at ``path``: remove a dead daemon's socket, refuse anything else."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"shm_socket {path} exists and is not a socket: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        with unix_address(str(path)) as addr:
            probe.connect(addr)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ConfigError(f"shm_socket {path}: {e.strerror or e}") from None
        path.unlink(missing_ok=True)  # nobody listens: a daemon that died left it
        return
    finally:
        probe.close()
    raise ConfigError(f"shm_socket {path} is in use by another daemon: give this one its own (--shm-socket)")


class ShmListener:
    def __init__(self, sessions: ShmSessions, path: str | os.PathLike[str], arena: ArenaShare | None = None,
                 hello_s: float = 10.0, max_pending: int = 32) -> None:  # fmt: skip
        """Binds at once (ConfigError when it cannot); serves from ``start()``."""
        self.sessions, self.path, self.arena = sessions, Path(path), arena
        self.hello_s, self.max_pending = hello_s, max_pending
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _claim(self.path)
            with unix_address(str(self.path)) as addr:
                self._sock.bind(addr)
            os.chmod(self.path, 0o660)
            self._sock.listen(64)
            self._sock.setblocking(False)
        except OSError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen on shm_socket {self.path}: {e.strerror or e}") from None
        except BaseException:
            self._sock.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: dict[socket.socket, float] = {}  # connection -> when its hello is due
        self._live: dict[socket.socket, str] = {}  # connection -> its session
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        sessions.socket_path = str(self.path)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="shm-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, end every session's connection, remove the socket file."""
        self._stop.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join()
        self.sessions.socket_path = ""
        for conn in [*self._pending, *self._live]:
            self._end(conn)
        self._sel.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
        try:
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        except OSError:
            pass

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            due = min(self._pending.values(), default=time.monotonic() + 1.0)
            for key, _ in self._sel.select(max(0.0, due - time.monotonic())):
                try:
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.fileobj in self._pending:
                        self._hello(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._ended(key.fileobj)  # type: ignore[arg-type]
                except Exception:  # one connection's surprise must not end shared memory for everyone
                    log.exception("shm socket: dropping a connection")
                    if isinstance(key.fileobj, socket.socket) and key.data is None:
                        self._ended(key.fileobj)
            now = time.monotonic()
            for conn in [c for c, until in self._pending.items() if until <= now]:
                self._end(conn)  # no hello in time

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, for one: the client streams
                log.warning("shm socket: accept failed: %s", e.strerror or e)
                return
            if len(self._pending) >= self.max_pending:
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn] = time.monotonic() + self.hello_s
            self._sel.register(conn, selectors.EVENT_READ)

    def _hello(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
        except (BlockingIOError, InterruptedError):
            return  # nothing there after all: still pending
        except OSError:
            self._end(conn)
            return
        del self._pending[conn]
        try:
            if not data:  # closed before saying anything
                self._end(conn)
                return
            try:
                welcome = self._welcome(conn, data, fds, flags)
            except (ValueError, OSError, ResourceExhausted, DecodeError) as e:
                welcome = pb.ShmWelcome(ok=False, reason=str(e).splitlines()[0] if str(e) else type(e).__name__)
        finally:
            for fd in fds:  # a mapped segment lives on in its mapping
                os.close(fd)
        give = [self.arena.fd] if welcome.ok and welcome.arena_size and self.arena is not None else []
        try:
            socket.send_fds(conn, [welcome.SerializeToString()], give)
        except OSError:  # the client is gone already
            welcome.ok = False
        if welcome.ok:  # from now on the connection's end is the session's (dropped early: it reads as ended)
            self._live[conn] = welcome.session
        else:
            if welcome.session:
                self.sessions.detach(welcome.session, any_owner=True)
            self._end(conn)

    def _welcome(self, conn: socket.socket, data: bytes, fds: list[int], flags: int) -> pb.ShmWelcome:
        if flags & socket.MSG_CTRUNC or len(fds) != 1:
            raise ValueError("the hello must carry exactly one descriptor: the segment's")
        if flags & socket.MSG_TRUNC:
            raise ValueError(f"a hello longer than {MAX_MESSAGE} bytes")
        hello = pb.ShmHello.FromString(data)
        pid, uid = peer_credentials(conn)
        sid, arena = self.sessions.bind(hello.ticket, fds[0], hello.size, uid, conn)
        log.debug("shm session %s attached by pid %d (uid %d), %d bytes", sid, pid, uid, hello.size)
        share = self.arena if arena else None
        return pb.ShmWelcome(ok=True, session=sid, arena_size=share.size if share else 0,
                             arena_token=share.token if share else b"")  # fmt: skip

    def _ended(self, conn: socket.socket) -> None:
        """A live connection is readable: it closed (or sent what it must not): drop its session."""
        sid = self._live.pop(conn, None)
        if sid is not None:
            self.sessions.detach(sid, any_owner=True)
        self._end(conn)

    def _end(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        self._live.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
