"""Daemon side of the shared-memory path: the segments clients handed over, bounded and reclaimed.

A segment costs memory for as long as *either* process maps it, so the daemon must not keep
segments forever: it bounds the bytes it maps at once, drops the least recently used session
beyond a count, and drops a session as soon as its client's unix connection closes
(kvstore/server/shm_listener.py): the kernel closes it when the client exits or is killed, in
any PID namespace. Nothing here looks at process ids.

Attaching takes two steps. ``ticket`` (from the authenticated AttachShm call) checks the bound
and records which credential asked (``Caller.credential``, kvstore/server/credentials.py) and
whether it may read the arena in place; ``bind`` (on the unix socket, with the segment's fd) spends
the ticket and maps the segment. A session belongs to the credential that attached it: ``use``,
``release`` and ``detach`` with any other credential see no such session.

A call that is using a dropped session keeps its mapping until it returns, and sees the session
``lost`` before each write, so it fails with ShmSessionLost (the client attaches again and
retries) instead of writing into memory nobody reads or crashing on an unmapped buffer.

Leases: a Get answered in place from the cpu tier's shared arena (no copy into the segment)
hands the client offsets into daemon memory; the views of those blocks are kept in a lease of
the session until the client releases it (after copying), the lease expires (``lease_s``), the
session holds more than ``max_leases``, or the session is dropped. While a view is kept the cpu
tier never reuses its bytes, so an eviction or overwrite cannot change them under the reader.
(The client verifies what it copied anyway: a lease that ended early costs a miss, never bad KV.)
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.client.shm import HEADER_BYTES, ShmSegment
from kvstore.errors import ResourceExhausted, ShmSessionLost
from tiers.errors import ConfigError

DEFAULT_MAX_BYTES = 4 * 1024**3  # shared memory a daemon maps at once (32 default client segments)
TICKET_BYTES = 16


@dataclass(eq=False)
class Session:
    """One attached segment on the daemon side. ``users`` counts calls using it right now: a
    dropped session stays mapped until the last of them is done, and each of them sees ``lost``."""

    seg: ShmSegment
    owner: bytes = b""  # the credential that attached it (Caller.credential): only it may use the session
    arena: bool = False  # its Gets may be answered in place from the cpu arena
    conn: socket.socket | None = None  # the client's unix connection: its closing ends the session
    users: int = 0
    lost: bool = False
    # lease id -> (expiry on the monotonic clock, the pinning views), oldest first
    leases: OrderedDict[int, tuple[float, list[memoryview]]] = field(default_factory=OrderedDict)
    next_lease: int = 1

    def check(self) -> None:
        """Raise ShmSessionLost if the session was dropped while a call was using it."""
        if self.lost:
            raise ShmSessionLost("shared-memory session dropped by the daemon: attach again")


class _Ticket(NamedTuple):
    size: int
    owner: bytes
    arena: bool
    until: float  # monotonic


class ShmSessions:
    """Daemon side: attached segments by session id, bounded and reclaimed.

    - ``max_bytes`` bounds the shared memory mapped at once: an attach beyond it is refused
      (ResourceExhausted; the client streams instead).
    - ``max_sessions``: beyond it the least recently used session is dropped.
    - A session ends when its client's connection closes (``detach``, called by the listener).
    - ``start()``'s thread expires leases (``lease_s``) and unspent tickets (``ticket_s``).
    A dropped session is unmapped once no call uses it; a call using it sees ``Session.lost``.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_sessions: int = 64, reap_interval_s: float = 2.0,
                 lease_s: float = 30.0, max_leases: int = 16, ticket_s: float = 30.0,
                 max_tickets: int = 256) -> None:  # fmt: skip
        if min(max_sessions, max_leases, max_tickets) < 1 or min(reap_interval_s, lease_s, ticket_s) <= 0 \
                or max_bytes <= HEADER_BYTES:
            raise ConfigError(f"shared-memory bound of {max_bytes} bytes, {max_sessions} sessions, "
                              f"reap every {reap_interval_s} s, leases of {lease_s} s, {max_leases} leases "
                              f"a session, tickets of {ticket_s} s, {max_tickets} tickets: each must be positive")
        self.max_bytes, self._max, self._interval = max_bytes, max_sessions, reap_interval_s
        self.lease_s, self.max_leases, self.ticket_s, self._max_tickets = lease_s, max_leases, ticket_s, max_tickets
        self.socket_path = ""  # where clients hand over segments (set by the listener once it listens)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._tickets: OrderedDict[bytes, _Ticket] = OrderedDict()
        self._mapped = 0  # bytes of every session not yet unmapped, dropped ones in use included
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def __len__(self) -> int:
        return len(self._sessions)

    def ticket(self, size: int, owner: bytes = b"", arena: bool = False) -> bytes:
        """A single-use ticket for ``bind``: ValueError for a size no segment has,
        ResourceExhausted when a segment of ``size`` would take the daemon past ``max_bytes``."""
        if not HEADER_BYTES < size <= self.max_bytes:
            raise ValueError(f"segment size {size} outside {HEADER_BYTES + 1}..{self.max_bytes}")
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._check_room(size)
            self._tickets[ticket] = _Ticket(size, owner, arena, time.monotonic() + self.ticket_s)
            while len(self._tickets) > self._max_tickets:  # the oldest unspent one: its client gave up
                self._tickets.popitem(last=False)
        return ticket

    def bind(self, ticket: bytes, fd: int, size: int, uid: int,
             conn: socket.socket | None = None) -> tuple[str, bool]:  # fmt: skip
        """Spend ``ticket`` on the segment ``fd`` (the caller's to close) that the process of user
        ``uid`` handed over on ``conn``: (the new session's id, whether it may read the arena).
        ValueError/OSError when the ticket or the segment is not right, ResourceExhausted at the bound."""
        with self._lock:
            t = self._tickets.pop(bytes(ticket), None)
        if t is None or t.until < time.monotonic():
            raise ValueError("unknown or expired ticket: call AttachShm again")
        if size != t.size:
            raise ValueError(f"segment of {size} bytes, but AttachShm announced {t.size}")
        return self.attach(fd, size, uid, t.owner, t.arena, conn), t.arena

    def attach(self, fd: int, size: int, uid: int, owner: bytes = b"", arena: bool = False,
               conn: socket.socket | None = None) -> str:  # fmt: skip
        """Map the segment ``fd`` (the caller's to close; checked by ``ShmSegment.adopt``); the
        session id. ResourceExhausted if it would take the daemon past ``max_bytes``."""
        with self._lock:  # refuse before mapping anything
            self._check_room(size)
            self._mapped += size
        try:
            seg = ShmSegment.adopt(fd, size, uid)
        except BaseException:
            with self._lock:
                self._mapped -= size
            raise
        sid = uuid.uuid4().hex
        with self._lock:
            self._sessions[sid] = Session(seg, owner, arena, conn)
            old = [self._sessions.popitem(last=False)[1] for _ in range(len(self._sessions) - self._max)]
        self._drop(old)
        return sid

    def _check_room(self, size: int) -> None:
        if self._mapped + size > self.max_bytes:
            raise ResourceExhausted(f"shared-memory bound reached ({self._mapped} of {self.max_bytes} "
                                    f"bytes mapped; {size} more asked)")  # fmt: skip

    @contextmanager
    def use(self, sid: str, owner: bytes = b"") -> Iterator[Session]:
        """The session for the duration of one call; ShmSessionLost if the daemon has none (or it
        is another credential's)."""
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None or sess.owner != owner:
                raise ShmSessionLost(f"unknown shm session {sid!r}: attach again")
            self._sessions.move_to_end(sid)
            sess.users += 1
        try:
            yield sess
        finally:
            with self._lock:
                sess.users -= 1
                unmap = sess.lost and sess.users == 0
            if unmap:
                self._unmap(sess)

    def lease(self, sess: Session, views: list[memoryview]) -> int:
        """Keep ``views`` (pinning their bytes) for the client until ``release``; the lease id.
        Raises ShmSessionLost if the session was dropped meanwhile (nothing is then kept)."""
        with self._lock:
            sess.check()
            lease_id = sess.next_lease
            sess.next_lease += 1
            sess.leases[lease_id] = (time.monotonic() + self.lease_s, views)
            while len(sess.leases) > self.max_leases:  # the oldest: its reader is surely done
                sess.leases.popitem(last=False)
        return lease_id

    def release(self, sid: str, leases: Iterable[int], owner: bytes = b"") -> int:
        """End leases of a session (unknown ones are ignored); how many ended."""
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None or sess.owner != owner:
                return 0
            return sum(sess.leases.pop(int(i), None) is not None for i in leases)

    def leased(self) -> int:
        """Leases held right now, over every session."""
        with self._lock:
            return sum(len(s.leases) for s in self._sessions.values())

    def detach(self, sid: str, owner: bytes = b"", any_owner: bool = False) -> None:
        """Drop a session (``any_owner``: whoever attached it: the listener, when its connection closed)."""
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None or not (any_owner or sess.owner == owner):
                return
            del self._sessions[sid]
        self._drop([sess])

    def reap(self) -> None:
        """End leases and tickets past their time."""
        now = time.monotonic()
        with self._lock:
            for s in self._sessions.values():
                for lease_id in [i for i, (until, _) in s.leases.items() if until <= now]:
                    del s.leases[lease_id]
            for t in [t for t, v in self._tickets.items() if v.until <= now]:
                del self._tickets[t]

    def start(self) -> None:
        """Expire leases and tickets every ``reap_interval_s`` until ``close()``."""
        def loop() -> None:
            while not self._stop.wait(self._interval):
                self.reap()

        self._reaper = threading.Thread(target=loop, name="shm-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), OrderedDict()
            self._tickets.clear()
        self._drop(sessions)

    def _drop(self, sessions: list[Session]) -> None:
        """Mark sessions lost, end their connections; unmap those no call is using (the others:
        when their last call ends)."""
        idle = []
        with self._lock:
            for s in sessions:
                s.lost = True
                s.leases.clear()
                if s.users == 0:
                    idle.append(s)
        for s in sessions:
            if s.conn is not None:
                try:
                    s.conn.shutdown(socket.SHUT_RDWR)  # the listener sees it end, and closes it
                except OSError:
                    pass  # closed already
        for s in idle:
            self._unmap(s)

    def _unmap(self, sess: Session) -> None:
        sess.seg.close()
        with self._lock:
            self._mapped -= sess.seg.size
