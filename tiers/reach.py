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


def any_reachable(addresses: Sequence[tuple[str, int]], timeout_s: float) -> Reach:
    """Connect to every one of ``addresses`` at once; done at the first that completes, when all
    failed (refused, no route), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for host, port in addresses:
            try:
                family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            except OSError:  # a name that does not resolve answers nothing
                continue
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setblocking(False)
            err = s.connect_ex(addr)
            if err == 0:
                return Reach(True, False)
            if err in (socket.EWOULDBLOCK, getattr(socket, "EINPROGRESS", 115)):
                sel.register(s, selectors.EVENT_WRITE)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return Reach(False, True)
            for key, _ in sel.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    return Reach(True, False)
                sel.unregister(sock)  # refused or unreachable: this one is done
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

    def refusal(self) -> str | None:
        """None: the call may go ahead; otherwise why it is refused now (cheap unless it checks)."""
        if not self._suspect:
            return None
        with self._lock:
            if not self._suspect:
                return None
            if self._checking:
                return "another call is checking whether any node answers"
            if self._failed_at is not None and (ago := time.monotonic() - self._failed_at) < self.retry_after_s:
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
