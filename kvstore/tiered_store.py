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
- A tier that raises is counted and skipped for a while (Level.fail): reads fall through to
  the next level, writes go on below. The store never lets a tier error escape.
- The index of a persistent tier is rebuilt from ``tier.scan()`` at start, so the disk tier
  is found again after a restart (even after SIGKILL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore.errors import StoreClosed
from kvstore.level import Level, LevelOptions
from kvstore.spill_queue import ByteBoundedQueue
from kvstore.store_types import LookupResult, NullObserver, Observer, StoreStats, TierStats
from tiers.base import Buffer, Tier
from tiers.errors import BlockTooLarge

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    key: bytes
    value: bytes
    target: int
    move: bool  # True: the block left the level above (tracked in _pending); False: a copy


def _own(data: Buffer) -> bytes:
    """An immutable copy (no copy for bytes): queued blocks must not change under us."""
    return data if isinstance(data, bytes) else bytes(data)


class TieredStore:
    def __init__(
        self,
        levels: Sequence[tuple[Tier, LevelOptions]],
        promote_on_hit: bool = True,
        spill_queue_bytes: int = 256 * 1024**2,
        tier_retry_s: float = 2.0,
        observer: Observer | None = None,
    ) -> None:
        if not levels:
            raise ValueError("TieredStore needs at least one tier")
        self.levels = [Level(t, o, retry_s=tier_retry_s) for t, o in levels]
        self.promote_on_hit = promote_on_hit
        self._obs: Observer = observer or NullObserver()
        self._lock = threading.RLock()
        self._pending: dict[bytes, _Job] = {}
        self._hits: dict[bytes, int] = {}
        self._closed = False
        self._queue: ByteBoundedQueue[_Job] = ByteBoundedQueue(spill_queue_bytes, lambda j: len(j.value))
        for i in range(len(self.levels)):
            self._rebuild(i)
        self._worker = threading.Thread(target=self._work, name="tierkv-spill", daemon=True)
        self._worker.start()

    # -- public API --------------------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> bool:
        """Store a block. Returns False (and writes nothing) when the key is already held."""
        data = value if isinstance(value, bytes | bytearray) else memoryview(value).cast("B")
        with self._lock:
            self._check_open()
            if len(data) > self.max_block_bytes:
                raise BlockTooLarge(f"block of {len(data)} bytes exceeds every tier")
            if self._locate(key) is not None:
                return False
            jobs = self._insert_top(key, data)
            jobs += [_Job(key, _own(data), i, False) for i, lv in enumerate(self.levels) if i > 0
                     and lv.options.write_through and lv.available() and key not in lv.index]  # fmt: skip
        self._enqueue(jobs)
        return True

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def read(self, key: bytes, sink: Callable[[memoryview], T]) -> T | None:
        """Call ``sink`` with the block's bytes (valid only during the call); None on a miss.

        The top tier's bytes are passed without a copy (under the store lock), which lets the
        daemon copy a block straight into shared memory.
        """
        result: list[T] = []

        def consume(mv: memoryview) -> None:
            result.append(sink(mv))

        found = self._find(key, consume)
        return result[0] if found else None

    def get(self, key: bytes) -> bytes | None:
        return self.read(key, bytes)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    @property
    def max_block_bytes(self) -> int:
        """The largest block any level can hold; larger puts raise BlockTooLarge."""
        return max(lv.capacity for lv in self.levels)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """How many leading keys are present (contiguously), and the tier holding each key."""
        names: list[str | None] = []
        with self._lock:
            self._check_open()
            for k in keys:
                loc = self._locate(k)
                if loc == -1:  # on its way down: report the level it is leaving
                    loc = self._pending[k].target - 1
                names.append(None if loc is None else self.levels[loc].name)
        for lv in self.levels:
            missing = [i for i, n in enumerate(names) if n is None]
            if not missing or not lv.options.shared or not lv.available():
                continue
            try:
                flags = lv.tier.contains_many([keys[i] for i in missing])
            except Exception as e:  # noqa: BLE001 - a tier error must never escape
                with self._lock:
                    lv.fail(e)
                continue
            for i, f in zip(missing, flags, strict=True):
                if f:
                    names[i] = lv.name
        prefix = next((i for i, n in enumerate(names) if n is None), len(names))
        return LookupResult(prefix, names)

    def delete(self, key: bytes) -> bool:
        found = False
        lower: list[Level] = []
        with self._lock:
            self._check_open()
            found = self._pending.pop(key, None) is not None
            self._hits.pop(key, None)
            for i, lv in enumerate(self.levels):
                if lv.remove(key) is not None:
                    found = True
                    if i == 0:
                        self._guard(lv, lambda lv=lv: lv.tier.delete(key))
                    else:
                        lower.append(lv)
                elif i > 0 and lv.options.shared:
                    lower.append(lv)
        for lv in lower:
            found = bool(self._guard(lv, lambda lv=lv: lv.tier.delete(key))) or found
        return found

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every spill and write-through queued so far has landed."""
        return self._queue.join(timeout)

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = [TierStats(lv.name, lv.used, lv.capacity, len(lv.index), lv.available(), lv.last_error,
                               **vars(lv.counters)) for lv in self.levels]  # fmt: skip
            return StoreStats(tiers, len(self._pending), self._queue.pending_bytes)

    def close(self, flush: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
        if flush:
            self.flush()
        with self._lock:
            self._closed = True
        self._queue.close()
        self._worker.join(timeout=30)
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

    def _guard(self, lv: Level, fn: Callable[[], T]) -> T | None:
        """Run a tier call; on any error count it, trip the level's breaker, return None."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a tier error must never escape
            with self._lock:
                lv.fail(e)
            return None

    def _locate(self, key: bytes, start: int = 0) -> int | None:
        """First level >= start that holds key (by index); -1 when it is in the spill queue."""
        if start == 0 and key in self._pending:
            return -1
        for i in range(start, len(self.levels)):
            if self.levels[i].has(key):
                return i
        return None

    def _rebuild(self, i: int) -> None:
        lv = self.levels[i]
        if not lv.tier.persistent:
            return
        try:
            for key, size in lv.tier.scan():
                lv.add(key, size)
        except Exception as e:  # noqa: BLE001
            lv.fail(e)
            return
        for key, _ in lv.pick_victims(0):  # config shrank below what the tier holds
            lv.remove(key)
            self._guard(lv, lambda key=key: lv.tier.delete(key))
            lv.counters.evictions += 1
        if lv.index:
            log.info("tier %s: found %d blocks (%d bytes) from a previous run", lv.name, len(lv.index), lv.used)

    def _move_down(self, key: bytes, data: Buffer, target: int) -> list[_Job]:
        """Queue ``key`` to spill into ``target`` (caller holds the lock)."""
        if target >= len(self.levels):
            self.levels[-1].counters.dropped += 1
            return []
        job = _Job(key, _own(data), target, True)
        self._pending[key] = job
        return [job]

    def _insert_top(self, key: bytes, data: Buffer) -> list[_Job]:
        """Write into level 0, evicting to the spill queue (caller holds the lock)."""
        top = self.levels[0]
        if not top.available() or len(data) > top.capacity:
            return self._move_down(key, data, 1)
        jobs: list[_Job] = []
        for vkey, _ in top.pick_victims(len(data)):
            t0 = time.perf_counter()
            try:
                raw = top.tier.get(vkey)
                vdata = None if raw is None else bytes(raw)
                top.tier.delete(vkey)
            except Exception as e:  # noqa: BLE001
                top.fail(e)
                vdata = None
            top.remove(vkey)
            top.counters.evictions += 1
            if vdata is not None:
                self._obs.read(top.name, len(vdata), time.perf_counter() - t0)
                jobs += self._move_down(vkey, vdata, 1)
        t0 = time.perf_counter()
        try:
            top.tier.put(key, data)
        except Exception as e:  # noqa: BLE001
            top.fail(e)
            return jobs + self._move_down(key, data, 1)
        top.add(key, len(data))
        top.counters.write_bytes += len(data)
        self._obs.write(top.name, len(data), time.perf_counter() - t0)
        return jobs

    def _enqueue(self, jobs: list[_Job], force: bool = False) -> None:
        for job in jobs:
            self._queue.put(job, force=force)

    def _find(self, key: bytes, consume: Callable[[memoryview], None]) -> bool:
        """Read ``key`` from the fastest level holding it; falls through on tier errors."""
        start = 0
        for _ in range(2 * len(self.levels) + 2):
            with self._lock:
                self._check_open()
                loc = self._locate(key, start)
                if loc is None:
                    break
                if loc == -1:
                    src = self.levels[self._pending[key].target - 1]
                    src.counters.hits += 1
                    self._hit(key)
                    consume(memoryview(self._pending[key].value))
                    return True
                if loc == 0:
                    top = self.levels[0]
                    t0 = time.perf_counter()
                    raw = self._guard(top, lambda top=top: top.tier.get(key))
                    if raw is not None:
                        top.touch(key)
                        top.counters.hits += 1
                        top.counters.read_bytes += len(raw)
                        self._hit(key)
                        consume(memoryview(raw))
                        self._obs.read(top.name, len(raw), time.perf_counter() - t0)
                        return True
                    start = 1
                    continue
            lv = self.levels[loc]
            t0 = time.perf_counter()
            raw = self._guard(lv, lambda lv=lv: lv.tier.get(key))
            if raw is None:  # error, or moved away meanwhile: look again from here
                start = loc if lv.available() and key in self._pending else loc + 1
                continue
            data = bytes(raw)
            self._obs.read(lv.name, len(data), time.perf_counter() - t0)
            self._after_lower_hit(loc, key, data)
            consume(memoryview(data))
            return True
        return self._find_shared(key, consume)

    def _find_shared(self, key: bytes, consume: Callable[[memoryview], None]) -> bool:
        """Ask shared levels directly: other nodes may have written the block."""
        for i, lv in enumerate(self.levels):
            if not lv.options.shared or not lv.available() or i == 0:
                continue
            raw = self._guard(lv, lambda lv=lv: lv.tier.get(key))
            if raw is not None:
                data = bytes(raw)
                self._after_lower_hit(i, key, data)
                consume(memoryview(data))
                return True
        with self._lock:
            for lv in self.levels:
                lv.counters.misses += 1
        return False

    def _hit(self, key: bytes) -> None:
        self._hits[key] = self._hits.get(key, 0) + 1

    def _after_lower_hit(self, loc: int, key: bytes, data: bytes) -> None:
        jobs: list[_Job] = []
        with self._lock:
            lv = self.levels[loc]
            lv.touch(key)
            lv.counters.hits += 1
            lv.counters.read_bytes += len(data)
            for upper in self.levels[:loc]:
                upper.counters.misses += 1
            self._hit(key)
            if self.promote_on_hit and not self._closed and self._locate(key) not in (0, -1):
                if len(data) <= self.levels[0].capacity and self.levels[0].available():
                    lv.counters.promotions += 1
                    jobs = self._insert_top(key, data)
        self._enqueue(jobs)

    # -- background worker -------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._land(job)
            except Exception:  # noqa: BLE001 - the worker must survive anything
                log.exception("spill of %s failed", job.key.hex()[:16])
            finally:
                self._queue.task_done()

    def _still_wanted(self, job: _Job) -> bool:
        return self._pending.get(job.key) is job if job.move else self._locate(job.key) is not None

    def _land(self, job: _Job) -> None:
        """Write a queued block into its target level (or below, if that level is down)."""
        size = len(job.value)
        for i in range(job.target, len(self.levels) if job.move else job.target + 1):
            lv = self.levels[i]
            with self._lock:
                if not self._still_wanted(job):
                    return
                if job.key in lv.index:  # already there (inclusive chain): nothing to write
                    lv.touch(job.key)
                    break
                if not lv.available() or size > lv.capacity:
                    continue
                if self._hits.get(job.key, 0) < lv.options.admit_min_hits:
                    lv.counters.dropped += 1
                    break
                victims = lv.pick_victims(size)
            for vkey, _ in victims:
                self._evict_lower(i, vkey)
            t0 = time.perf_counter()
            try:
                lv.tier.put(job.key, job.value)
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    lv.fail(e)
                continue
            self._obs.write(lv.name, size, time.perf_counter() - t0)
            with self._lock:
                if self._still_wanted(job):
                    lv.add(job.key, size)
                    lv.counters.spills += 1
                    lv.counters.write_bytes += size
                    if job.move:
                        self._pending.pop(job.key, None)
                    return
            self._guard(lv, lambda lv=lv: lv.tier.delete(job.key))  # deleted meanwhile
            return
        with self._lock:
            if job.move and self._pending.get(job.key) is job:
                del self._pending[job.key]

    def _evict_lower(self, i: int, vkey: bytes) -> None:
        """Move a victim of level i (i > 0) one level down; runs on the worker thread."""
        lv = self.levels[i]
        raw = self._guard(lv, lambda: lv.tier.get(vkey))
        jobs: list[_Job] = []
        with self._lock:
            if lv.remove(vkey) is None:  # deleted meanwhile
                return
            lv.counters.evictions += 1
            if raw is not None and self._locate(vkey) is None:
                jobs = self._move_down(vkey, bytes(raw), i + 1)
        self._guard(lv, lambda: lv.tier.delete(vkey))
        self._enqueue(jobs, force=True)
