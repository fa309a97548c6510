"""Ghosts: the keys each tier evicted recently, and what read lookups found (why a key missed).

A lookup that misses cannot tell "never stored" from "stored, then pushed out" unless someone
remembers what was pushed out. Each tier keeps a bounded, insertion-ordered set of the keys it
evicted last (a ghost list, as in ARC's B1/B2: keys only, no bytes); the oldest ghost goes first
once a tier holds ``per_tier`` of them. An absent key that is a ghost of some tier is reported as
evicted from the *lowest* such tier (the last place it lived: a key that spilled from cpu to disk
and then fell off disk was evicted from disk). An explicit delete is not an eviction: it clears
the key's ghosts.

Read lookups are also counted here (per key: hit by tier, evicted by tier, or absent) for the
dashboard and /metrics; a writer's existence check is not a read and is not counted.
Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple


class LookupCounts(NamedTuple):
    """Keys looked up for reading since start: found (by tier), recently evicted (by tier), absent."""

    hits: dict[str, int]
    evicted: dict[str, int]
    absent: int

    @property
    def keys(self) -> int:
        return sum(self.hits.values()) + sum(self.evicted.values()) + self.absent


class Ghosts:
    def __init__(self, tiers: Sequence[str], per_tier: int) -> None:
        if per_tier < 0:
            raise ValueError(f"ghosts per tier must be >= 0, got {per_tier}")
        self.per_tier = per_tier
        self._order = list(tiers)  # fastest first
        self._sets: dict[str, OrderedDict[bytes, None]] = {t: OrderedDict() for t in tiers}
        self._hits = dict.fromkeys(tiers, 0)
        self._evicted = dict.fromkeys(tiers, 0)
        self._absent = 0

    def evicted(self, tier: str, key: bytes) -> None:
        """``tier`` pushed ``key`` out (it may live on below)."""
        if self.per_tier == 0:
            return
        ghosts = self._sets[tier]
        ghosts[key] = None
        ghosts.move_to_end(key)
        while len(ghosts) > self.per_tier:
            ghosts.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """``key`` was deleted on purpose: not an eviction any more."""
        for ghosts in self._sets.values():
            ghosts.pop(key, None)

    def where(self, key: bytes) -> str | None:
        """The lowest tier that evicted ``key`` recently (None: no tier remembers it)."""
        for tier in reversed(self._order):
            if key in self._sets[tier]:
                return tier
        return None

    def explain(self, keys: Sequence[bytes], tiers: Sequence[str | None]) -> list[str | None]:
        """For each key the lookup found absent (tier None), the tier that evicted it, if any."""
        return [self.where(k) if t is None else None for k, t in zip(keys, tiers, strict=True)]

    def count(self, tiers: Sequence[str | None], evicted_from: Sequence[str | None]) -> None:
        """Count one read lookup's keys (tiers: where each was found; evicted_from: ``explain``)."""
        for t, g in zip(tiers, evicted_from, strict=True):
            if t is not None:
                self._hits[t] = self._hits.get(t, 0) + 1
            elif g is not None:
                self._evicted[g] += 1
            else:
                self._absent += 1

    def counts(self) -> LookupCounts:
        return LookupCounts(dict(self._hits), dict(self._evicted), self._absent)

    def size(self, tier: str) -> int:
        return len(self._sets[tier])
