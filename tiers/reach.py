"""Fail fast while a server cannot be reached: ``ReachGate`` in front of a network tier's calls.

Why: a client library's own recovery can cost far more than one timeout. redis-py's cluster
client answers a connection error by refreshing its topology, which asks every known node in turn,
each up to the connect timeout: cut off from the cluster, one call took 9-11 s before it failed,
every call after it again 3-6 s, and a request of the engine waits for all of it.

How: after a call failed as unreachable the gate is *suspect*. The next call first checks, with
one bounded TCP connect to every known address at once (``any_reachable``: done at the first that
completes, ms when anything answers, at most ``timeout_s`` when nothing does), whether any node
answers; only then does it reach the client library (whose refresh then finds answering nodes).
After a check that waited out its timeout (connects left unanswered: a cut link) the gate refuses
at once, and checks again ``retry_after_s`` after it, so a healed link is found within about that;
a check that failed fast (every node refused or had no route: servers down, not a cut) costs
milliseconds, so every call makes it and a restarted server is used at once. One thread checks at
a time; the others are refused meanwhile rather than queued. A node refusing the connection counts as not answering
(a killed server); a partial outage (some nodes answer) passes the check and is left to the library.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Reach(NamedTuple):
    answered: bool  # a TCP connect to some address completed
    waited: bool  # nothing answered and some connect was still pending at the timeout (a cut link)


RESEND_S = 0.1  # while nothing answers, a check connects afresh this often


def any_reachable(addresses: Sequence[tuple[str, int]], timeout_s: float, resend_s: float = RESEND_S) -> Reach:
    """Connect to every one of ``addresses`` at once; done at the first that completes, when all
    failed (refused, no route), or after ``timeout_s``.

    While connects are left unanswered (a cut link drops the SYN), fresh ones are started every
    ``resend_s``: the kernel resends a dropped SYN only after a second, so a link healed during
    the check would otherwise be seen only then, or at the next check, ``retry_after_s`` later
    (tests/tiers/test_reach.py; bench.cluster's node_blackholed reads again in the first round
    after the heal)."""
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    targets: list[tuple[int, int, int, object]] = []
    for host, port in addresses:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError:  # a name that does not resolve answers nothing
            continue
        targets.append((family, kind, proto, addr))

    def start(family: int, kind: int, proto: int, addr: object) -> bool:
        """One connect; True when it completed at once."""
        s = socket.socket(family, kind, proto)
        socks.append(s)
        s.setblocking(False)
        err = s.connect_ex(addr)  # type: ignore[arg-type]
        if err == 0:
            return True
        target = (family, kind, proto, addr)
        if err in (socket.EWOULDBLOCK, getattr(socket, "EINPROGRESS", 115)):
            sel.register(s, selectors.EVENT_WRITE, target)
        else:
            done(target)
        return False

    def done(target: object) -> None:
        """``target`` refused or has no route: it is done, its older tries too."""
        for other in [k.fileobj for k in sel.get_map().values() if k.data == target]:
            sel.unregister(other)

    try:
        if any(start(*t) for t in targets):
            return Reach(True, False)
        resend_at = time.monotonic() + resend_s
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return Reach(False, True)
            if now >= resend_at:  # the pending ones' targets again, on fresh sockets
                pending = {key.data for key in sel.get_map().values()}
                if any(start(*t) for t in pending):  # type: ignore[misc]
                    return Reach(True, False)
                resend_at = now + resend_s
            for key, _ in sel.select(max(0.0, min(deadline, resend_at) - now)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock not in sel.get_map():  # its address was done earlier in this batch
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    return Reach(True, False)
                done(key.data)
        return Reach(False, False)
    finally:
        sel.close()
        for s in socks:
            s.close()


class ReachGate:
    """Let calls through while the server answers; refuse them fast while it cannot be reached."""

    def __init__(self, addresses: Callable[[], Sequence[tuple[str, int]]], timeout_s: float,
                 retry_after_s: float) -> None:
        if timeout_s <= 0 or retry_after_s < 0:
            raise ValueError(f"reach gate: timeout_s > 0 and retry_after_s >= 0, got {timeout_s}, {retry_after_s}")
        self._addresses, self.timeout_s, self.retry_after_s = addresses, timeout_s, retry_after_s
        self._lock = threading.Lock()
        self._suspect = False
        self._checking = False
        self._failed_at: float | None = None  # when the last check found nothing answering

    def suspect(self) -> None:
        """A call failed as unreachable (or nothing is known yet): the next call checks first."""
        self._suspect = True

    def refusal(self, eager: bool = False) -> str | None:
        """None: the call may go ahead; otherwise why it is refused now (cheap unless it checks).
        ``eager``: check even within ``retry_after_s`` of a check that waited out its timeout (a
        detached tier's prober, which no request waits on: a heal is then seen by its next probe)."""
        if not self._suspect:
            return None
        with self._lock:
            if not self._suspect:
                return None
            if self._checking:
                return "another call is checking whether any node answers"
            if (not eager and self._failed_at is not None
                    and (ago := time.monotonic() - self._failed_at) < self.retry_after_s):
                return f"no node answered a check {ago:.2f} s ago"
            self._checking = True
        reach = Reach(False, False)
        try:
            addresses = list(self._addresses())
            reach = any_reachable(addresses, self.timeout_s) if addresses else Reach(True, False)  # let it try
        finally:
            with self._lock:
                self._checking = False
                if reach.answered:
                    self._suspect, self._failed_at = False, None
                elif reach.waited:  # a check that costs the timeout runs at most every retry_after_s
                    self._failed_at = time.monotonic()
        if reach.answered:
            return None
        how = f"within {self.timeout_s} s" if reach.waited else "(refused or no route)"
        return f"no node of {len(addresses)} answered a connect {how}"
