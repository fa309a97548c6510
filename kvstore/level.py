"""One level of the TieredStore chain: a tier plus the store's bookkeeping for it.

The tier is a dumb byte store; the level owns what the store knows about it: the index
(key -> size), the bytes it counts as used, the eviction policy, counters, and a small
circuit breaker. A level whose tier raised is skipped for ``retry_s`` seconds, so a dead
Redis costs one timeout, not one per request. Not thread-safe: the store holds its lock.

Ownership: a private level (cpu, disk, or a remote tier with ``shared=False``) belongs to this
store alone: its index is rebuilt from ``scan()`` at start and trimmed to the capacity, and
eviction deletes. A shared level (Redis, S3 used by several nodes) is never scanned or trimmed:
its index, used bytes and capacity cover only the blocks this store wrote since it started, and
evicting one of them only stops tracking it. The shared server enforces the real budget (Redis
``maxmemory`` + an eviction policy, a key TTL, an S3 lifecycle rule), so one node restarting
with a small capacity never deletes blocks other nodes wrote.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvstore.eviction import EvictionPolicy, make_eviction_policy
from tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelOptions:
    eviction: str = "lru"  # name of the eviction policy (kvstore/eviction.py)
    write_through: bool = False  # copy every put here at once (shared remote tiers)
    admit_min_hits: int = 0  # spill here only blocks hit >= N times; others are dropped
    shared: bool = False  # other nodes use this tier: consult it on index misses; never scan/trim it


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # blocks pushed out of this level
    spills: int = 0  # blocks written into this level from the level above
    promotions: int = 0  # blocks copied from this level to the top on a hit
    dropped: int = 0  # blocks refused by admission or falling off the last level
    errors: int = 0
    read_bytes: int = 0
    write_bytes: int = 0


@dataclass
class Level:
    tier: Tier
    options: LevelOptions
    retry_s: float = 2.0
    index: dict[bytes, int] = field(default_factory=dict)
    used: int = 0
    counters: TierCounters = field(default_factory=TierCounters)
    leaving: set[bytes] = field(default_factory=set)  # victims being moved out
    leaving_bytes: int = 0
    down_until: float = 0.0
    last_error: str = ""
    eviction: EvictionPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.eviction = make_eviction_policy(self.options.eviction, self.tier.capacity_bytes)

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def capacity(self) -> int:
        return self.tier.capacity_bytes

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def has(self, key: bytes) -> bool:
        return key in self.index and self.available()

    def fail(self, exc: BaseException) -> None:
        """Count an error and skip this level for a while."""
        self.counters.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.available():
            log.warning("tier %s failed, skipping it for %.1fs: %s", self.name, self.retry_s, self.last_error)
        self.down_until = time.monotonic() + self.retry_s

    def add(self, key: bytes, size: int) -> None:
        if key in self.index:
            self.remove(key)
        self.index[key] = size
        self.used += size
        self.eviction.on_insert(key, size)

    def remove(self, key: bytes) -> int | None:
        size = self.index.pop(key, None)
        if size is None:
            return None
        self.used -= size
        self.eviction.on_remove(key)
        if key in self.leaving:
            self.leaving.discard(key)
            self.leaving_bytes -= size
        return size

    def touch(self, key: bytes) -> None:
        self.eviction.on_access(key)

    def pick_victims(self, size: int) -> list[tuple[bytes, int]]:
        """Mark victims as leaving until ``size`` more bytes fit. They stay readable meanwhile."""
        out: list[tuple[bytes, int]] = []
        while self.used - self.leaving_bytes + size > self.capacity:
            key = self.eviction.victim()
            if key is None:
                break
            self.eviction.on_remove(key)
            vsize = self.index.get(key)
            if vsize is None or key in self.leaving:
                continue
            self.leaving.add(key)
            self.leaving_bytes += vsize
            out.append((key, vsize))
        return out

    def rebuild(self) -> None:
        """Index a persistent private tier's contents from ``scan()`` (after a restart, even a SIGKILL)."""
        if not self.tier.persistent or self.options.shared:
            return
        try:
            for key, size in self.tier.scan():
                self.add(key, size)
            for key, _ in self.pick_victims(0):  # the configured size shrank since the last run
                self.remove(key)
                self.tier.delete(key)
                self.counters.evictions += 1
        except Exception as e:  # noqa: BLE001 - a tier that cannot start is skipped, and counted
            self.fail(e)
            return
        if self.index:
            log.info("tier %s: found %d blocks (%d bytes) from a previous run", self.name, len(self.index), self.used)
