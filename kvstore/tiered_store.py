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
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.chain import Chain, Job, own
from kvstore.errors import StoreClosed
from kvstore.level import Level, LevelOptions
from kvstore.spiller import Spiller
from kvstore.store_types import LookupResult, Observer, StoreStats, TierStats
from tiers.base import Buffer, Tier
from tiers.errors import BlockTooLarge

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        self._chain = Chain([Level(t, o, retry_s=tier_retry_s) for t, o in levels], observer)
        self.levels = self._chain.levels
        self.promote_on_hit = promote_on_hit
        self._obs = self._chain.obs
        self._lock = self._chain.lock
        self._pending = self._chain.pending
        self._hits = self._chain.hits
        self._closed = False
        for lv in self.levels:
            lv.rebuild()
        self._spill = Spiller(self._chain, spill_queue_bytes)

    # -- public API --------------------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> bool:
        """Store a block. Returns False (and writes nothing) when the key is already held."""
        data = value if isinstance(value, bytes | bytearray) else memoryview(value).cast("B")
        with self._lock:
            self._check_open()
            if len(data) > self.max_block_bytes:
                raise BlockTooLarge(f"block of {len(data)} bytes exceeds every tier")
            if self._chain.locate(key) is not None:
                return False
            jobs = self._insert_top(key, data)
            jobs += [Job(key, own(data), i, False) for i, lv in enumerate(self.levels) if i > 0
                     and lv.options.write_through and lv.available() and key not in lv.index]  # fmt: skip
        self._spill.submit(jobs)
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

    def read_many(self, keys: Sequence[bytes], sink: Callable[[int, memoryview], None]) -> list[bool]:
        """``sink(i, view)`` for each block found (view valid during the call only)."""
        found = [False] * len(keys)
        for i, k in enumerate(keys):

            def one(mv: memoryview, i: int = i) -> None:
                found[i] = True
                sink(i, mv)

            self.read(k, one)
        return found

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return sum(1 for k in keys if self.delete(k))

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
                loc = self._chain.locate(k)
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
                        self._chain.guard(lv, lambda lv=lv: lv.tier.delete(key))
                    else:
                        lower.append(lv)
                elif i > 0 and lv.options.shared:
                    lower.append(lv)
        for lv in lower:
            found = bool(self._chain.guard(lv, lambda lv=lv: lv.tier.delete(key))) or found
        return found

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every spill and write-through queued so far has landed."""
        return self._spill.flush(timeout)

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = [TierStats(lv.name, lv.used, lv.capacity, len(lv.index), lv.available(), lv.last_error,
                               **vars(lv.counters)) for lv in self.levels]  # fmt: skip
            return StoreStats(tiers, self._spill.pending_jobs, self._spill.pending_bytes)

    def close(self, flush: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
        if flush:
            self.flush()
        with self._lock:
            self._closed = True
        self._spill.close()
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

    def _insert_top(self, key: bytes, data: Buffer) -> list[Job]:
        """Write into level 0, evicting to the spill queue (caller holds the lock)."""
        top = self.levels[0]
        if not top.available() or len(data) > top.capacity:
            return self._chain.move_down(key, data, 1)
        jobs: list[Job] = []
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
                jobs += self._chain.move_down(vkey, vdata, 1)
            self._chain.forget_if_gone(vkey)
        t0 = time.perf_counter()
        try:
            top.tier.put(key, data)
        except Exception as e:  # noqa: BLE001
            top.fail(e)
            return jobs + self._chain.move_down(key, data, 1)
        top.add(key, len(data))
        top.counters.write_bytes += len(data)
        self._obs.write(top.name, len(data), time.perf_counter() - t0)
        return jobs

    def _find(self, key: bytes, consume: Callable[[memoryview], None]) -> bool:
        """Read ``key`` from the fastest level holding it; falls through on tier errors."""
        start = 0
        for _ in range(2 * len(self.levels) + 2):
            with self._lock:
                self._check_open()
                loc = self._chain.locate(key, start)
                if loc is None:
                    break
                if loc == -1:
                    src = self.levels[self._pending[key].target - 1]
                    src.counters.hits += 1
                    self._chain.hit(key)
                    consume(memoryview(self._pending[key].value))
                    return True
                if loc == 0:
                    top = self.levels[0]
                    t0 = time.perf_counter()
                    raw = self._chain.guard(top, lambda top=top: top.tier.get(key))
                    if raw is not None:
                        top.touch(key)
                        top.counters.hits += 1
                        top.counters.read_bytes += len(raw)
                        self._chain.hit(key)
                        consume(memoryview(raw))
                        self._obs.read(top.name, len(raw), time.perf_counter() - t0)
                        return True
                    start = 1
                    continue
            lv = self.levels[loc]
            t0 = time.perf_counter()
            raw = self._chain.guard(lv, lambda lv=lv: lv.tier.get(key))
            if raw is None:  # error (level now skipped), moved away meanwhile, or lost
                with self._lock:
                    if lv.available() and key in lv.index and key not in lv.leaving:
                        lv.remove(key)  # the tier lost it (e.g. another node deleted it): heal
                start = 0
                continue
            data = bytes(raw)
            self._obs.read(lv.name, len(data), time.perf_counter() - t0)
            self._after_lower_hit(loc, key, data, from_index=True)
            consume(memoryview(data))
            return True
        return self._find_shared(key, consume)

    def _find_shared(self, key: bytes, consume: Callable[[memoryview], None]) -> bool:
        """Ask shared levels directly: other nodes may have written the block."""
        for i, lv in enumerate(self.levels):
            if not lv.options.shared or not lv.available() or i == 0:
                continue
            raw = self._chain.guard(lv, lambda lv=lv: lv.tier.get(key))
            if raw is not None:
                data = bytes(raw)
                self._after_lower_hit(i, key, data, from_index=False)
                consume(memoryview(data))
                return True
        with self._lock:
            for lv in self.levels:
                lv.counters.misses += 1
        return False

    def _after_lower_hit(self, loc: int, key: bytes, data: bytes, from_index: bool) -> None:
        """Count a hit below the top and promote the block (unless deleted meanwhile)."""
        jobs: list[Job] = []
        with self._lock:
            lv = self.levels[loc]
            lv.touch(key)
            lv.counters.hits += 1
            lv.counters.read_bytes += len(data)
            for upper in self.levels[:loc]:
                upper.counters.misses += 1
            self._chain.hit(key)
            now = self._chain.locate(key)
            if self.promote_on_hit and not self._closed and (now is None and not from_index or (now or 0) > 0):
                if len(data) <= self.levels[0].capacity and self.levels[0].available():
                    lv.counters.promotions += 1
                    jobs = self._insert_top(key, data)
        self._spill.submit(jobs)

