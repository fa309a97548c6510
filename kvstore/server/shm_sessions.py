"""Daemon side of the shared-memory path: the segments clients attached, bounded and reclaimed.

A segment costs tmpfs pages for as long as *either* process maps it (the file is unlinked once
attached), so the daemon must not keep segments forever: it bounds the bytes it maps at once,
drops the least recently used session beyond a count, and drops the sessions of clients whose
process is gone (their pid, with its start time so that a reused pid does not count as alive).
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

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.client.shm import HEADER_BYTES, ShmSegment
from kvstore.errors import ResourceExhausted, ShmSessionLost
from tiers.errors import ConfigError

PROC = Path("/proc")
DEFAULT_MAX_BYTES = 4 * 1024**3  # shared memory a daemon maps at once (32 default client segments)


@dataclass(eq=False)
class Session:
    """One attached segment on the daemon side. ``users`` counts calls using it right now: a
    dropped session stays mapped until the last of them is done, and each of them sees ``lost``."""

    seg: ShmSegment
    pid: int  # the client's pid (0: unknown, never reclaimed by liveness)
    started: int  # that pid's start time, so a reused pid does not keep a dead client alive
    users: int = 0
    lost: bool = False
    # lease id -> (expiry on the monotonic clock, the pinning views), oldest first
    leases: OrderedDict[int, tuple[float, list[memoryview]]] = field(default_factory=OrderedDict)
    next_lease: int = 1

    def check(self) -> None:
        """Raise ShmSessionLost if the session was dropped while a call was using it."""
        if self.lost:
            raise ShmSessionLost("shared-memory session dropped by the daemon: attach again")


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when no such process exists."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class ShmSessions:
    """Daemon side: attached segments by session id, bounded and reclaimed.

    - ``max_bytes`` bounds the shared memory mapped at once: an attach beyond it is refused
      (ResourceExhausted; the servicer answers ok=False and the client streams instead).
    - ``max_sessions``: beyond it the least recently used session is dropped.
    - A session whose client process is gone is dropped (checked at every attach and every
      ``reap_interval_s`` by ``start()``'s thread), so a crashed client's tmpfs pages are freed.
    A dropped session is unmapped once no call uses it; a call using it sees ``Session.lost``.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_sessions: int = 64,
                 reap_interval_s: float = 2.0, lease_s: float = 30.0, max_leases: int = 16) -> None:  # fmt: skip
        if max_bytes <= HEADER_BYTES or max_sessions < 1 or reap_interval_s <= 0 or lease_s <= 0 or max_leases < 1:
            raise ConfigError(f"shared-memory bound of {max_bytes} bytes, {max_sessions} sessions, "
                              f"reap every {reap_interval_s} s, leases of {lease_s} s, {max_leases} leases "
                              "a session: each must be positive")
        self.max_bytes, self._max, self._interval = max_bytes, max_sessions, reap_interval_s
        self.lease_s, self.max_leases = lease_s, max_leases
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._mapped = 0  # bytes of every session not yet unmapped, dropped ones in use included
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def __len__(self) -> int:
        return len(self._sessions)

    def attach(self, name: str, size: int, token: bytes, pid: int = 0) -> str:
        """Map the client's segment; ValueError/OSError if it is not ours to see,
        ResourceExhausted if it would take the daemon past ``max_bytes``."""
        self.reap()
        started = _start_time(pid) if pid > 0 else None
        with self._lock:  # refuse before mapping anything
            if self._mapped + size > self.max_bytes:
                raise ResourceExhausted(f"shared-memory bound reached ({self._mapped} of {self.max_bytes} "
                                        f"bytes mapped; {size} more asked)")  # fmt: skip
            self._mapped += size
        try:
            seg = ShmSegment.open(name, size, token)
        except BaseException:
            with self._lock:
                self._mapped -= size
            raise
        sid = uuid.uuid4().hex
        sess = Session(seg, pid if started is not None else 0, started or 0)
        with self._lock:
            self._sessions[sid] = sess
            old = [self._sessions.popitem(last=False)[1] for _ in range(len(self._sessions) - self._max)]
        self._drop(old)
        return sid

    @contextmanager
    def use(self, sid: str) -> Iterator[Session]:
        """The session for the duration of one call; ShmSessionLost if the daemon has none."""
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None:
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

    def release(self, sid: str, leases: Iterable[int]) -> int:
        """End leases of a session (unknown ones are ignored); how many ended."""
        with self._lock:
            sess = self._sessions.get(sid)
            return 0 if sess is None else sum(sess.leases.pop(int(i), None) is not None for i in leases)

    def leased(self) -> int:
        """Leases held right now, over every session."""
        with self._lock:
            return sum(len(s.leases) for s in self._sessions.values())

    def detach(self, sid: str) -> None:
        with self._lock:
            sess = self._sessions.pop(sid, None)
        self._drop([sess] if sess is not None else [])

    def reap(self) -> int:
        """Drop the sessions of clients that have exited; returns how many."""
        with self._lock:
            watched = [(sid, s) for sid, s in self._sessions.items() if s.pid > 0]
        dead = [sid for sid, s in watched if _start_time(s.pid) != s.started]
        now = time.monotonic()
        with self._lock:
            gone = [self._sessions.pop(sid) for sid in dead if sid in self._sessions]
            for s in self._sessions.values():  # leases past their time
                for lease_id in [i for i, (until, _) in s.leases.items() if until <= now]:
                    del s.leases[lease_id]
        self._drop(gone)
        return len(gone)

    def start(self) -> None:
        """Reap dead clients every ``reap_interval_s`` until ``close()``."""
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
        self._drop(sessions)

    def _drop(self, sessions: list[Session]) -> None:
        """Mark sessions lost; unmap those no call is using (the others: when their last call ends)."""
        idle = []
        with self._lock:
            for s in sessions:
                s.lost = True
                s.leases.clear()
                if s.users == 0:
                    idle.append(s)
        for s in idle:
            self._unmap(s)

    def _unmap(self, sess: Session) -> None:
        sess.seg.close()
        with self._lock:
            self._mapped -= sess.seg.size
