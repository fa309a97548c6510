"""StoreState: what the TieredStore's front (client calls) and back (the spill worker) share.

Both halves work on the same levels, under the same lock, with the same map of blocks on their
way down (``pending``: a block that left a level stays readable from here until it has landed
in the next one, so it is never missing in between) and the same per-key hit counts (for
admission). The lock guards this bookkeeping only: bytes are copied outside it (reads pin
their source instead, see TieredStore._find). Both report tier errors through ``fail``, which
wakes the prober (kvstore/store/breaker.py) when an error detached a tier, and ``skipped`` /
``wanted`` when a request wanted a detached tier (its probe brought forward). Both check bytes read
from a tier before serving or moving them on through ``intact``, the one verification path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.block import block_fault
from kvstore.store.breaker import Prober
from kvstore.store.miss_reasons import Ghosts
from kvstore.store.observers import NullObserver, Observer
from kvstore.store.parked import MAX_BYTES, Parked
from kvstore.store.tier_bookkeeping import Level
from tiers.base import Buffer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Job:
    key: bytes
    value: bytes
    target: int
    move: bool  # True: the block left the level above (tracked in ``pending``); False: a copy


def frozen_copy(data: Buffer) -> bytes:
    """An immutable copy (no copy for bytes): queued blocks must not change under us."""
    return data if isinstance(data, bytes) else bytes(data)


class StoreState:
    """The ordered levels, their lock, blocks in flight, per-key hit counts and recent evictions."""

    def __init__(self, levels: list[Level], observer: Observer | None = None, ghosts_per_tier: int = 16384,
                 park_bytes: int = MAX_BYTES) -> None:
        self.levels = levels
        self.obs: Observer = observer or NullObserver()
        self.lock = threading.RLock()
        self.pending: dict[bytes, Job] = {}
        self.parked = Parked(park_bytes)  # pending jobs that could land nowhere, kept for a replay
        self.hits: dict[bytes, int] = {}
        self.ghosts = Ghosts([lv.name for lv in levels], ghosts_per_tier)  # keys each level evicted lately
        self.prober = Prober(levels, self.lock)

    def guard(self, lv: Level, fn: Callable[[], T]) -> T | None:
        """Run a tier call; on any error count it (``fail``) and return None."""
        return self.attempt(lv, fn)[1]

    def attempt(self, lv: Level, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run a tier call: (True, its result), or (False, None) once an error was counted."""
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a tier error must never escape
            self.fail(lv, e)
            return False, None
        self.ok(lv)
        return True, out

    def fail(self, lv: Level, exc: BaseException) -> None:
        """Count a tier error; wake the prober if it detached the tier."""
        with self.lock:
            detached = lv.fail(exc)
        if detached:
            self.prober.wake()

    def skipped(self, lv: Level, key: bytes) -> None:
        """A write of ``key`` meant for detached ``lv`` was skipped (caller holds the lock): counted,
        kept for replay (kvstore/store/replay.py), and its probe brought forward."""
        lv.skipped(key)
        if lv.breaker.wanted():
            self.prober.wake()

    def wanted(self, key: bytes) -> None:
        """A request missed ``key`` in every available level (caller holds the lock): bring forward the
        probe of each detached level that might hold it (a shared one: any key; a private one: a key
        in its index), at most one per ``BreakerPolicy.demand_s`` (kvstore/store/breaker.py)."""
        woke = False
        for lv in self.levels:
            if not lv.available() and (lv.options.shared or key in lv.index) and lv.breaker.wanted():
                woke = True
        if woke:
            self.prober.wake()

    def ok(self, lv: Level) -> None:
        """A tier call succeeded: its consecutive-error count starts again, and its error rate
        counts one more good call (without the lock when that changes nothing)."""
        if not lv.breaker.settled:
            with self.lock:
                lv.succeeded()

    def first_level(self, key: bytes, start: int = 0) -> int | None:
        """Index of the first available level >= ``start`` whose index holds ``key``."""
        for i in range(start, len(self.levels)):
            if self.levels[i].has(key):
                return i
        return None

    def holds(self, key: bytes) -> bool:
        """Whether some level, or the spill queue, holds ``key`` (caller holds the lock)."""
        return key in self.pending or self.first_level(key) is not None

    def move_down(self, key: bytes, data: Buffer, target: int) -> list[Job]:
        """Queue ``key`` to spill into ``target`` (caller holds the lock)."""
        if target >= len(self.levels):
            self.levels[-1].counters.dropped += 1
            self.forget_if_gone(key)
            return []
        job = Job(key, frozen_copy(data), target, True)
        self.parked.unpark(key)  # a parked block promoted and evicted again: this job replaces it
        self.pending[key] = job
        return [job]

    def park(self, job: Job) -> bool:
        """Keep ``job``, a block that could land nowhere while some level below that skipped it is
        detached, in ``pending`` for that level's replay (caller holds the lock; kvstore/store/parked.py).
        False when it is not kept (no room); the oldest parked blocks may be dropped for it."""
        dropped = self.parked.park(job)
        for old in dropped:
            if self.pending.get(old.key) is old:
                del self.pending[old.key]
                self.forget_if_gone(old.key)
        return not any(old is job for old in dropped)

    def unpark(self, key: bytes) -> None:
        """A level holds ``key`` now (or it was deleted): its parked job, if any, is let go
        (caller holds the lock)."""
        job = self.parked.unpark(key)
        if job is not None and self.pending.get(key) is job:
            del self.pending[key]

    def evicted(self, lv: Level, key: bytes) -> None:
        """``lv`` pushed ``key`` out (caller holds the lock; the key may live on below)."""
        lv.counters.evictions += 1
        self.ghosts.evicted(lv.name, key)

    def hit(self, key: bytes) -> None:
        self.hits[key] = self.hits.get(key, 0) + 1

    def intact(self, lv: Level, key: bytes, data: Buffer) -> bool:
        """Whether ``data``, read from ``lv``'s tier, is the intact block of ``key``; a bad one is
        deleted from that tier and from the level's index, counted (``obs.corrupt``), and False.

        The one check of bytes read from a tier (to serve, promote or move down): ``block_fault``,
        unless the tier verified them itself (``Tier.verifies_reads``: a shared tier's MAC, which
        already deleted and answered as a miss what failed it). A corrupt block is deleted even
        from a shared tier: it is no use to any node, and left there it would keep answering
        lookups, so a fresh copy would never be written.
        """
        if lv.tier.verifies_reads:
            return True
        reason = block_fault(data, key)
        if reason is None:
            return True
        log.warning("tier %s: block %s failed verification (%s): deleted", lv.name, key.hex()[:16], reason)
        with self.lock:
            lv.remove(key)
            self.forget_if_gone(key)
        self.guard(lv, lambda: lv.tier.delete(key))
        self.obs.corrupt(lv.name, reason)
        return False

    def forget_if_gone(self, key: bytes) -> None:
        """Drop the hit count of a key no level holds any more (caller holds the lock).

        Without this the counts of every key ever seen would pile up: a slow leak.
        """
        if not self.holds(key):
            self.hits.pop(key, None)
