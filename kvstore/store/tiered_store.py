"""TieredStore: an ordered chain of tiers with write-back spilling, promotion and admission.

Why this shape:
- Writes land in the top tier (fast, in memory) so a client's put costs one memcpy. When a
  level is full its policy picks victims, which move to the next level *asynchronously*
  through a byte-bounded queue worked by one background thread (write-back). While a block
  is on its way down it stays readable from the queue (``_pending``), so it is never missing.
- Only the worker writes to levels below the top, which keeps each level's capacity
  accounting single-writer: victims are deleted from a tier before a new block is written,
  so a tier never holds more than its configured bytes.
- Levels marked ``write_through`` (shared remote tiers such as Redis) also get a copy of
  every put straight away (queued, not waiting for eviction) so other nodes see it.
- A hit below the top is promoted (copied) to the top when ``promote_on_hit``; lower copies
  stay (inclusive), so a later eviction of the promoted copy writes nothing.
- ``admit_min_hits`` lets a slow level (S3) accept only blocks hit at least N times; other
  blocks are dropped when they would spill there.
- ``tenant_quota_bytes``: a tenant at its quota in the top tier has its own least recently used
  blocks spilled down to make room (counted, ``quota_spills``), never another tenant's; a block
  larger than the whole quota goes straight to the next level (kvstore/store/tenants.py).
- A tier that raises is counted; after a few consecutive errors, or a high error rate over its
  recent calls, it is detached (kvstore/store/breaker.py):
  reads fall through to the next level, writes meant for it are skipped (counted) or go on below,
  and a background probe attaches it again once it answers; a request that wanted it (a read that
  missed everywhere else, a skipped write) brings that probe forward, rate-limited per tier. A
  tier unreachable at start begins detached. The store never lets a tier error escape (a
  misconfigured tier stops it at start).
- A shared or write-through tier remembers the keys whose writes it skipped while detached (up to
  ``replay_backlog_keys``) and, once attached again, the spill worker replays them from the levels
  that still hold them (kvstore/store/replay.py): blocks put while a node was cut off from Redis
  or S3 reach them after the heal, so other nodes find them. Such a block pushed out of the cpu
  tier meanwhile, with every level below detached, is parked in memory for that replay (up to
  ``replay_park_bytes``, kvstore/store/parked.py) instead of being dropped.
- The index of a persistent private tier is rebuilt from ``tier.scan()`` at start, so the disk
  tier is found again after a restart (even after SIGKILL). A shared tier (Redis, S3) is never
  scanned or trimmed: its server enforces the budget (see Level and kvstore/README.md).
- A block read from a tier is verified once before it is served, promoted or moved down
  (``StoreState.intact``): ``block_fault``, or the tier's own check where it has one (a shared
  tier's MAC, kvstore/store/signed_tier.py, ``Tier.verifies_reads``). A bad one is deleted from
  that tier and dropped from its index, reported to the observer and is a miss there, so a
  re-put of it is stored. Only a top tier in this process's memory (``Tier.in_process``: the
  cpu tier, which holds only blocks the daemon validated on their way in) is served unverified;
  a disk, Redis or S3 tier on top is verified.
- ``access`` (None unless a trace runs, kvstore/ops/trace.py) is told of every get, put and lookup
  key with the index of the level that held it: one ``is None`` test per call when off.
- Reads copy outside the store lock, which covers bookkeeping only: the cpu tier pins the arena
  run a view points into until the view is dropped, queued blocks are immutable, lower tiers
  return copies. So do writes into the top (kvstore/store/top_writer.py): a get never waits
  behind another key's put or promotion.
- A call that finds the spill queue full waits for room ``spill_put_timeout_s`` at most; what
  it could not queue is not stored below, counted (``spill_timeouts``) (kvstore/store/spiller.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from kvstore.errors import StoreClosed
from kvstore.store.breaker import Breaker, BreakerPolicy
from kvstore.store.miss_reasons import LookupCounts
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT, AccessObserver, Observer
from kvstore.store.parked import MAX_BYTES as PARK_MAX_BYTES
from kvstore.store.replay import MAX_KEYS, Backlog
from kvstore.store.results import LookupResult, StoreStats, TenantStats, TierStats
from kvstore.store.shared_state import Job, StoreState, frozen_copy
from kvstore.store.spiller import Spiller
from kvstore.store.tier_bookkeeping import Level, LevelOptions
from kvstore.store.top_writer import TopWriter
from tiers.base import Arena, Buffer, Tier
from tiers.errors import BlockTooLarge

log = logging.getLogger(__name__)
T = TypeVar("T")
TENANT_ROWS = 1000  # tenants listed per tier by stats() (the rest summed as "_other")


class TieredStore:
    def __init__(
        self,
        levels: Sequence[tuple[Tier, LevelOptions]],
        promote_on_hit: bool = True,
        spill_queue_bytes: int = 256 * 1024**2,
        tier_retry_s: float = 2.0,
        observer: Observer | None = None,
        ghosts_per_tier: int = 16384,
        detach_after: int = 3,
        tenant_quota_bytes: int = 0,
        spill_put_timeout_s: float | None = None,
        breaker: BreakerPolicy | None = None,
        replay_backlog_keys: int = MAX_KEYS,
        replay_park_bytes: int = PARK_MAX_BYTES,
    ) -> None:
        """``tier_retry_s``: first probe of a detached tier (backoff to 10x); ``detach_after``:
        consecutive errors that detach a tier; ``tenant_quota_bytes``: bytes each tenant may hold in
        the top tier (0 = no quota; kvstore/store/tenants.py); ``spill_put_timeout_s``: how long a
        call waits for room in the full spill queue (None: for ever; kvstore/store/spiller.py);
        ``breaker``: the whole circuit-breaker policy (overrides the two above); ``replay_backlog_keys``:
        keys each shared or write-through level remembers of the writes it skipped while detached,
        replayed when it is attached again (0: none; kvstore/store/replay.py); ``replay_park_bytes``:
        bytes of such blocks kept for their replay when they could land nowhere (kvstore/store/parked.py)."""
        if not levels:
            raise ValueError("TieredStore needs at least one tier")
        policy = breaker or BreakerPolicy.from_retry(tier_retry_s, detach_after)
        self._state = StoreState([Level(t, o, breaker=Breaker(policy), quota=tenant_quota_bytes if i == 0 else 0,
                                        backlog=Backlog(replay_backlog_keys))
                                  for i, (t, o) in enumerate(levels)], observer, ghosts_per_tier,
                                 park_bytes=replay_park_bytes)
        self.levels = self._state.levels
        self.promote_on_hit = promote_on_hit
        self._obs = self._state.obs
        self._lock = self._state.lock
        self._pending = self._state.pending
        self._hits = self._state.hits
        self._closed = False
        self.access: AccessObserver | None = None  # set while a trace runs (kvstore/ops/trace.py)
        for i, lv in enumerate(self.levels):
            lv.start()
            below = [low for low in self.levels[i + 1:] if low.replays]
            if below:  # a block whose copy below was skipped is evicted last (Level.pick_victims)
                lv.unreplicated = lambda key, below=below: any(key in low.backlog for low in below)  # type: ignore[misc]
        self._top = TopWriter(self._state)
        self._spill = Spiller(self._state, spill_queue_bytes, spill_put_timeout_s)
        self._state.prober.on_attach = self._spill.replay  # a reattached level's skipped writes
        if not all(lv.available() for lv in self.levels):
            self._state.prober.wake()

    # -- public API --------------------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> bool:
        """Store a block. Returns False (and writes nothing) when the key is already held.

        The copies (into the top tier, victims out of it, write-through copies) run without the
        store lock (kvstore/store/top_writer.py), so reads of other keys go on meanwhile."""
        data = value if isinstance(value, bytes | bytearray) else memoryview(value).cast("B")
        through: list[int] = []
        with self._top.lock:
            with self._lock:
                self._check_open()
                if len(data) > self.max_block_bytes:
                    raise BlockTooLarge(f"block of {len(data)} bytes exceeds every tier")
                if self._state.holds(key):
                    if (access := self.access) is not None:
                        job = self._pending.get(key)
                        access(OP_PUT, key, len(data), job.target - 1 if job else self._state.first_level(key))
                    return False
                plan = self._top.plan(key, len(data))
                if (access := self.access) is not None:
                    access(OP_PUT, key, len(data), None)
                for i, lv in enumerate(self.levels[1:], 1):
                    if not lv.options.write_through or key in lv.index:
                        continue
                    if lv.available():
                        through.append(i)
                    else:
                        self._state.skipped(lv, key)
            copy = frozen_copy(data) if through or not plan.to_top else None
            jobs = self._top.land(key, data, plan, copy)
        jobs += [Job(key, copy, i, False) for i in through if copy is not None]
        self._spill.submit(jobs)
        return True

    def read(self, key: bytes, sink: Callable[[memoryview], T]) -> T | None:
        """Call ``sink`` with the block's bytes (valid only during the call); None on a miss.

        The top tier's bytes are passed without a copy, which lets the daemon copy a block
        straight into shared memory. ``sink`` runs without the store lock, so readers copy in
        parallel; the view stays valid and unchanged during the call even if the block is
        deleted or evicted meanwhile (its source is pinned).
        """
        result: list[T] = []
        size = 0

        def consume(mv: memoryview) -> None:
            nonlocal size
            size = mv.nbytes
            result.append(sink(mv))

        level = self._find(key, consume)
        if (access := self.access) is not None:
            access(OP_GET, key, size, level)
        return result[0] if level is not None else None

    def get(self, key: bytes) -> bytes | None:
        return self.read(key, bytes)

    def read_in_place(self, keys: Sequence[bytes], locate: Callable[[bytes], T | None]) -> list[T | None]:
        """Where the top level holds each key, for a reader that copies the bytes itself (the
        daemon's cpu arena, which same-host clients map): ``locate(key)`` for each key the top
        level holds, None for the others, stopping at the first key it cannot locate. Each located
        key counts as a read of the top level (a hit, its recency, the access trace), as a Get of
        it would; nothing is pinned, so the reader verifies what it copied."""
        out: list[T | None] = [None] * len(keys)
        sizes: list[int] = []
        with self._lock:
            self._check_open()
            top = self.levels[0]
            for i, k in enumerate(keys):
                loc = None if k in self._pending or not top.has(k) else \
                    self._state.guard(top, lambda k=k: locate(k))  # fmt: skip
                if loc is None:
                    break
                out[i] = loc
                size = top.index[k]
                sizes.append(size)
                top.touch(k)
                top.counters.hits += 1
                top.counters.read_bytes += size
                self._state.hit(k)
        if (access := self.access) is not None:
            for k, size in zip(keys, sizes, strict=False):  # sizes: the located leading run
                access(OP_GET, k, size, 0)
        return out

    def arena(self) -> Arena | None:
        """The top tier's arena (tiers/base.py Arena: the cpu tier's memory), None when the top tier
        keeps none. ``arena().share()`` is None when it is private (``--no-shm-arena``, or no memfd):
        clients cannot map it, and reads are not answered in place."""
        return self.levels[0].tier.arena()

    @property
    def max_block_bytes(self) -> int:
        """The largest block any level can hold; larger puts raise BlockTooLarge."""
        return max(lv.capacity for lv in self.levels)

    def lookup(self, keys: Sequence[bytes], read: bool = True) -> LookupResult:
        """How many leading keys are present (contiguously), the tier holding each key, and for an
        absent key the tier that evicted it lately (kvstore/store/miss_reasons.py). ``read``: a reader's lookup,
        counted in ``lookup_counts`` and the access trace (a writer checking what is held passes
        False)."""
        names: list[str | None] = []
        with self._lock:
            self._check_open()
            for k in keys:
                job = self._pending.get(k)  # on its way down: report the level it is leaving
                loc = job.target - 1 if job is not None else self._state.first_level(k)
                names.append(None if loc is None else self.levels[loc].name)
                if read and (access := self.access) is not None:
                    access(OP_LOOKUP, k, 0, loc)
        for lv in self.levels:
            missing = [i for i, n in enumerate(names) if n is None]
            if not missing or not lv.options.shared or not lv.available():
                continue
            asked = [keys[i] for i in missing]
            ok, flags = self._state.attempt(lv, lambda lv=lv, asked=asked: lv.tier.contains_many(asked))
            if not ok or flags is None:
                continue
            for i, f in zip(missing, flags, strict=True):
                if f:
                    names[i] = lv.name
        prefix = next((i for i, n in enumerate(names) if n is None), len(names))
        with self._lock:
            if prefix < len(keys):  # a detached level may hold it: probe that level early
                self._state.wanted(keys[prefix])
            evicted = self._state.ghosts.explain(keys, names)
            if read:
                self._state.ghosts.count(names, evicted)
        return LookupResult(prefix, names, evicted)

    def lookup_counts(self) -> LookupCounts:
        """Keys of read lookups since start: found by tier, evicted lately by tier, absent."""
        with self._lock:
            return self._state.ghosts.counts()

    def delete(self, key: bytes) -> bool:
        found = False
        lower: list[Level] = []
        with self._lock:
            self._check_open()
            self._state.parked.unpark(key)
            found = self._pending.pop(key, None) is not None
            self._hits.pop(key, None)
            self._state.ghosts.forget(key)
            for i, lv in enumerate(self.levels):
                if lv.remove(key) is not None:
                    found = True
                    if i == 0:
                        self._state.guard(lv, lambda lv=lv: lv.tier.delete(key))
                    else:
                        lower.append(lv)
                elif i > 0 and lv.options.shared:
                    lower.append(lv)
            lower = [lv for lv in lower if lv.available()]  # a detached tier keeps it: content-addressed
        for lv in lower:
            found = bool(self._state.guard(lv, lambda lv=lv: lv.tier.delete(key))) or found
        return found

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every spill and write-through queued so far has landed."""
        return self._spill.flush(timeout)

    def stats(self, tenant_rows: int = TENANT_ROWS, only: Collection[str] | None = None) -> StoreStats:
        """Per-tier statistics; per tier, its ``tenant_rows`` largest tenants (the rest summed), or
        with ``only`` the rows of those tenants alone (``tenant_of`` names; one credential's view)."""
        with self._lock:
            tiers = [TierStats(name=lv.name, used_bytes=lv.used, capacity_bytes=lv.capacity, blocks=len(lv.index),
                               available=lv.available(), last_error=lv.last_error, **vars(lv.counters))
                     for lv in self.levels]  # fmt: skip
            tenants = [TenantStats(lv.name, *row) for lv in self.levels
                       for row in (lv.tenants.rows(tenant_rows) if only is None else lv.tenants.rows_of(only))]
            return StoreStats(tiers, self._spill.pending_jobs, self._spill.pending_bytes, tenants,
                              self._spill.timeouts, len(self._state.parked), self._state.parked.bytes)

    def close(self, flush: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
        if flush:
            self.flush()
        with self._top.lock, self._lock:  # a put or promotion in flight lands first
            self._closed = True
        self._spill.close()
        self._state.prober.close()
        for lv in self.levels:
            try:
                lv.tier.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing tier %s: %s", lv.name, e)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("store is closed")

    def _find(self, key: bytes, consume: Callable[[memoryview], None]) -> int | None:
        """Read ``key`` from the fastest level holding it (-> that level's index, None on a miss);
        falls through on tier errors and bad blocks.

        Bookkeeping happens under the lock, ``consume`` runs without it (see the module notes).
        """
        start = 0
        failed: set[int] = set()  # levels that raised during this read: not asked again
        for _ in range(2 * len(self.levels) + 2):
            with self._lock:
                self._check_open()
                job = self._pending.get(key) if start == 0 else None
                loc = None if job is not None else self._state.first_level(key, start)
                if job is not None:  # on its way down: the queued bytes are immutable
                    self.levels[job.target - 1].counters.hits += 1
                    self._state.hit(key)
                elif loc is None:
                    break
                elif loc == 0 and self.levels[0].tier.in_process:  # else verified like the levels below
                    top = self.levels[0]
                    t0 = time.perf_counter()
                    top_view = self._state.guard(top, lambda top=top: top.tier.get(key))  # pins the bytes
                    if top_view is None:
                        start = 1
                        continue
                    top.touch(key)
                    top.counters.hits += 1
                    top.counters.read_bytes += len(top_view)
                    self._state.hit(key)
                    self._obs.read(top.name, len(top_view), time.perf_counter() - t0)
            if job is not None:
                consume(memoryview(job.value))
                return job.target - 1
            if loc == 0 and self.levels[0].tier.in_process:
                consume(memoryview(top_view))
                return 0
            assert loc is not None
            lv = self.levels[loc]
            t0 = time.perf_counter()
            ok, raw = self._state.attempt(lv, lambda lv=lv: lv.tier.get(key))
            if not ok:  # a tier error (counted): look below
                failed.add(loc)
                start = loc + 1
                continue
            if raw is None:  # moved away meanwhile, lost, or refused by the tier (its MAC: deleted there)
                with self._lock:
                    if lv.available() and key in lv.index and key not in lv.leaving:
                        # the tier lost it (another node deleted it, or the tier refused it): drop it
                        lv.remove(key)  # from the index, so a re-put is stored, not ALREADY_PRESENT
                        self._state.forget_if_gone(key)
                start = 0
                continue
            data = bytes(raw)
            self._obs.read(lv.name, len(data), time.perf_counter() - t0)
            if not self._state.intact(lv, key, data):
                start = loc + 1
                continue
            self._after_lower_hit(loc, key, data, from_index=True)
            consume(memoryview(data))
            return loc
        return self._find_shared(key, consume, failed)

    def _find_shared(self, key: bytes, consume: Callable[[memoryview], None], failed: set[int]) -> int | None:
        """Ask shared levels directly: other nodes may have written the block (the top level too: a
        daemon whose only tier is a shared one serves what other nodes wrote, as its lookup says)."""
        for i, lv in enumerate(self.levels):
            if not lv.options.shared or not lv.available() or i in failed:
                continue
            raw = self._state.guard(lv, lambda lv=lv: lv.tier.get(key))
            if raw is not None and self._state.intact(lv, key, data := bytes(raw)):
                self._after_lower_hit(i, key, data, from_index=False)
                consume(memoryview(data))
                return i
        with self._lock:
            for lv in self.levels:
                lv.counters.misses += 1
            self._state.wanted(key)  # a detached level may hold it: probe that level early
        return None

    def _after_lower_hit(self, loc: int, key: bytes, data: bytes, from_index: bool) -> None:
        """Count a hit below the top and promote the block (unless deleted meanwhile).

        A promotion never waits for a put (kvstore/store/top_writer.py): while another write
        into the top is under way this hit is served without one, and a later hit promotes."""
        lv = self.levels[loc]
        with self._lock:
            lv.touch(key)
            lv.counters.hits += 1
            lv.counters.read_bytes += len(data)
            for upper in self.levels[:loc]:
                upper.counters.misses += 1
            self._state.hit(key)
        if not self.promote_on_hit or loc == 0 or not self._top.lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                now = self._state.first_level(key)
                deleted_meanwhile = now is None and from_index
                at_top = now == 0 or key in self._pending  # already in (or just leaving) the top
                top = self.levels[0]
                if self._closed or at_top or deleted_meanwhile or len(data) > top.capacity or \
                        not top.available() or top.over_quota(key, len(data)):  # fmt: skip
                    return
                lv.counters.promotions += 1
                plan = self._top.plan(key, len(data))
            jobs = self._top.land(key, data, plan, data)
        finally:
            self._top.lock.release()
        self._spill.submit(jobs)
