"""Writes into the top level (a put, or a promotion): victims out, the new block in, with every
copy made outside the store lock.

Why: a put used to copy its block into the cpu tier, and its victims out of it, while holding the
store lock, so a get of any other key waited behind a slow put (0.45 s in one review). Now the
store lock covers bookkeeping only, as it does for reads:

1. ``plan`` (under the store lock): decide where the block goes and mark the top level's victims
   as leaving. They stay readable from the top level meanwhile.
2. ``land`` (without it): copy each victim out, then switch it under the lock from the level to
   the spill queue (``pending``: readable there until it lands below), then delete it from the
   tier; then copy the new block into the tier, and publish it in the level's index under the
   lock. Until then a get of that key misses, as it would have a moment earlier.

One writer at a time (``lock``, taken before the store lock, never while holding it): writers
never race each other for the top tier's room, and a second put of the same key finds it held
once the first is done. Readers never take it; a promotion only tries to (a hit is served
without waiting for a put, and promoted on a later hit instead).
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from kvstore.store.shared_state import Job, StoreState, frozen_copy
from kvstore.store.tenants import tenant_of
from kvstore.store.tier_bookkeeping import Level
from tiers.base import Buffer


class TopPlan(NamedTuple):
    to_top: bool  # False: the block goes straight to the level below
    victims: list[bytes]  # top-level keys marked leaving, to move down first


class TopWriter:
    def __init__(self, state: StoreState) -> None:
        self._c = state
        self.lock = threading.Lock()  # one writer into the top level at a time

    def plan(self, key: bytes, size: int) -> TopPlan:
        """Where a new block of ``size`` bytes goes; marks the victims that make room for it
        (caller holds ``lock`` and the store lock)."""
        top = self._c.levels[0]
        if not top.available() or size > top.capacity:
            return TopPlan(False, [])
        if top.over_quota(key, size):  # larger than its tenant's whole quota: straight below
            self._quota_spilled(top, key)
            return TopPlan(False, [])
        over = top.quota_victims(key, size)  # the tenant's own oldest blocks first
        for vkey in {k for k, _ in over}:
            self._quota_spilled(top, vkey)
        return TopPlan(True, [k for k, _ in over + top.pick_victims(size)])

    def land(self, key: bytes, data: Buffer, plan: TopPlan, copy: bytes | None = None) -> list[Job]:
        """Carry out ``plan`` (caller holds ``lock``, not the store lock): the spill jobs it made.
        ``copy``: an immutable copy of ``data`` the caller made already (else made here if needed)."""
        c, top = self._c, self._c.levels[0]
        jobs: list[Job] = []
        for vkey in plan.victims:
            jobs += self._move_out(top, vkey)
        if plan.to_top:
            t0 = time.perf_counter()
            ok, _ = c.attempt(top, lambda: top.tier.put(key, data))
            if ok:
                with c.lock:
                    top.add(key, len(data))
                    top.counters.write_bytes += len(data)
                c.obs.write(top.name, len(data), time.perf_counter() - t0)
                return jobs
        frozen = copy if copy is not None else frozen_copy(data)
        with c.lock:
            return jobs + c.move_down(key, frozen, 1)

    def _move_out(self, top: Level, vkey: bytes) -> list[Job]:
        """Move one victim of the top level to the spill queue: its bytes are copied first,
        without the store lock; readers find it in the level, then in the queue, never nowhere."""
        c = self._c
        t0 = time.perf_counter()
        ok, raw = c.attempt(top, lambda: top.tier.get(vkey))
        vdata = bytes(raw) if raw is not None else None
        del raw  # the view pinned the victim's bytes while they were copied
        if vdata is not None and not top.tier.in_process and not c.intact(top, vkey, vdata):
            return []  # a disk top's bad block: deleted and counted, never carried down (and signed there)
        jobs: list[Job] = []
        with c.lock:
            if top.remove(vkey) is None:  # deleted meanwhile (delete() removed it from the tier too)
                return jobs
            c.evicted(top, vkey)
            if vdata is not None:
                c.obs.read(top.name, len(vdata), time.perf_counter() - t0)
                jobs = c.move_down(vkey, vdata, 1)
            c.forget_if_gone(vkey)
        if ok:
            c.guard(top, lambda: top.tier.delete(vkey))
        return jobs

    @staticmethod
    def _quota_spilled(top: Level, key: bytes) -> None:
        top.counters.quota_spills += 1
        top.tenants.quota_spilled(tenant_of(key))
