"""When the network itself lets a node through again after a heal, measured from inside the node.

Why: node_partitioned's recovery (bench/cluster/faults.py) counts rounds from the link coming up to
the node's first whole cross-node read. A link taken down loses its carrier, and after it comes
back the kernel resolves each of the node's neighbours again only at that neighbour's next ARP
resend (up to 1 s, ``net.ipv4.neigh.<dev>.retrans_time_ms``), before which nothing from the node
reaches that address, daemon or not. ``ReachWatch`` times that floor in the same run: from the
heal it connects from the node's namespace to every Redis node at once, afresh every ``every_s``
while none answers, keeping the earlier connects open (``tiers.reach.any_reachable``: a connect
queued behind an unresolved neighbour completes the moment it resolves), and records when the
first completes: the earliest moment the daemon could have read from Redis at all. It starts at
the heal, not before, so during the cut it sends nothing. The fault then reports
``network_back_s`` and the rounds that ended after it, the daemon's own share of the recovery.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from tiers.reach import any_reachable

EVERY_S = 0.02


class ReachWatch:
    """``start()`` at the heal; ``back_at`` is the monotonic time a connect first completed (None:
    not yet); ``stop()`` waits for it, at most until ``limit_s`` after the start."""

    def __init__(self, entered: AbstractContextManager[Any], addresses: Sequence[tuple[str, int]],
                 every_s: float = EVERY_S, limit_s: float = 10.0) -> None:
        self._entered, self._addresses, self._every_s, self._limit_s = entered, list(addresses), every_s, limit_s
        self.started_at = 0.0
        self.back_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="reach-watch", daemon=True)

    def start(self) -> ReachWatch:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """Seconds from ``start()`` to the first completed connect (None: none within ``limit_s``)."""
        self._thread.join(max(0.0, self.started_at + self._limit_s + 1.0 - time.monotonic()))
        return None if self.back_at is None else round(self.back_at - self.started_at, 3)

    def _run(self) -> None:
        with self._entered:  # this thread only: the node's namespace
            deadline = self.started_at + self._limit_s
            while (left := deadline - time.monotonic()) > 0:
                if any_reachable(self._addresses, left, resend_s=self._every_s).answered:
                    self.back_at = time.monotonic()
                    return
                time.sleep(self._every_s)  # every address refused or had no route at once: try again
