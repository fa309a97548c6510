"""When the network itself lets a node through again after a heal, measured from inside the node.

Why: node_partitioned's recovery (bench/cluster/faults.py) counts rounds from the link coming up to
the node's first whole cross-node read. A link taken down loses its carrier, and after it comes
back the kernel resolves each of the node's neighbours again only at that neighbour's next ARP
resend (up to 1 s, ``net.ipv4.neigh.<dev>.retrans_time_ms``), before which nothing from the node
reaches that address, daemon or not; each address has a neighbour entry, and a resend time, of its
own. A whole read needs every Redis master (the blocks' keys spread over every master's slots).

``ReachWatch`` times that floor in the same run: from the heal it connects from the node's
namespace to each address, afresh every ``every_s`` while that one has not answered, keeping the
earlier connects open (one queued behind an unresolved neighbour completes the moment it
resolves), and records when each first completes: ``first_s`` (some address answered) and
``all_s`` (every one did: the earliest moment a whole read could be served at all). It starts at
the heal, not before, so during the cut it sends nothing. The fault reports both and the rounds
that ended after ``all_s``, the daemon's own share of the recovery.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

EVERY_S = 0.02


class ReachWatch:
    """``start()`` at the heal; ``answered`` maps each address to the monotonic time a connect to it
    first completed; ``stop()`` waits for every address, at most until ``limit_s`` after the start."""

    def __init__(self, entered: AbstractContextManager[Any], addresses: Sequence[tuple[str, int]],
                 every_s: float = EVERY_S, limit_s: float = 10.0) -> None:
        self._entered, self._addresses, self._every_s, self._limit_s = entered, list(addresses), every_s, limit_s
        self.started_at = 0.0
        self.answered: dict[tuple[str, int], float] = {}
        self._thread = threading.Thread(target=self._run, name="reach-watch", daemon=True)

    def start(self) -> ReachWatch:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> tuple[float | None, float | None]:
        """Seconds from ``start()`` until some address answered, and until every one had (None: not
        within ``limit_s``)."""
        self._thread.join(max(0.0, self.started_at + self._limit_s + 1.0 - time.monotonic()))
        times = sorted(self.answered.values())
        first = round(times[0] - self.started_at, 3) if times else None
        every = round(times[-1] - self.started_at, 3) if len(times) == len(self._addresses) else None
        return first, every

    def _run(self) -> None:
        with self._entered, selectors.DefaultSelector() as sel:  # this thread only: the node's namespace
            deadline = self.started_at + self._limit_s
            try:
                while len(self.answered) < len(self._addresses) and time.monotonic() < deadline:
                    for addr in self._addresses:
                        if addr not in self.answered:
                            self._connect(sel, addr)
                    slot_end = time.monotonic() + self._every_s
                    while (left := slot_end - time.monotonic()) > 0:
                        for key, _ in sel.select(left):
                            self._done(sel, key.fileobj, key.data)  # type: ignore[arg-type]
            finally:
                for key in list(sel.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]

    def _connect(self, sel: selectors.BaseSelector, addr: tuple[str, int]) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex(addr) == 0:
            self.answered.setdefault(addr, time.monotonic())
            s.close()
        else:
            sel.register(s, selectors.EVENT_WRITE, addr)

    def _done(self, sel: selectors.BaseSelector, s: socket.socket, addr: tuple[str, int]) -> None:
        """A connect finished: it answered, or failed (refused, no route: tried again next slot)."""
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            self.answered.setdefault(addr, time.monotonic())
        sel.unregister(s)
        s.close()
