"""Eviction policies, one per tier, chosen by name in the config.

The TieredStore tells a policy what happens (``on_insert``, ``on_access``, ``on_remove``) and
asks it for a ``victim()`` when a tier is over capacity. A policy only orders keys; it never
touches data, so policies are easy to test and to swap. The store calls ``on_remove`` for
every key that leaves the tier (victim or explicit delete). All methods tolerate unknown keys,
because a key may be removed concurrently between a lookup and an access. Not thread-safe:
the store calls them under its lock.

- LRU: the default; good for recency-heavy chat traffic.
- S3-FIFO (Yang et al., SOSP '23): a small probationary FIFO (10% of bytes) filters one-hit
  wonders (e.g. a prompt that is never repeated) before they can push out reused blocks;
  a ghost FIFO remembers recently dropped keys so they return straight to the main queue.
- ARC: balances recency (T1) and frequency (T2) with ghost lists steering the split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict


class EvictionPolicy(ABC):
    name: str = "policy"

    @abstractmethod
    def on_insert(self, key: bytes, size: int) -> None: ...

    @abstractmethod
    def on_access(self, key: bytes) -> None: ...

    @abstractmethod
    def on_remove(self, key: bytes) -> None: ...

    @abstractmethod
    def victim(self) -> bytes | None:
        """The key to evict next (None when empty). The store then calls ``on_remove``."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_bytes: int = 0) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()

    def on_insert(self, key: bytes, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self) -> bytes | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy(EvictionPolicy):
    """Byte-aware S3-FIFO: small FIFO S, main FIFO M, ghost FIFO G, 2-bit frequency."""

    name = "s3fifo"

    def __init__(self, capacity_bytes: int, small_ratio: float = 0.1) -> None:
        self._cap = max(1, capacity_bytes)
        self._small_target = max(1, int(capacity_bytes * small_ratio))
        self._small: OrderedDict[bytes, int] = OrderedDict()
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0

    def on_insert(self, key: bytes, size: int) -> None:
        self.on_remove(key)
        if key in self._ghost:  # seen recently: it goes straight to main
            del self._ghost[key]
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size
        self._freq[key] = 0

    def on_access(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(3, self._freq[key] + 1)

    def on_remove(self, key: bytes) -> None:
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        elif key in self._main:
            self._main_bytes -= self._main.pop(key)
        self._freq.pop(key, None)

    def _remember_ghost(self, key: bytes) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(16, len(self._small) + len(self._main)):
            self._ghost.popitem(last=False)

    def victim(self) -> bytes | None:
        # bounded loop: each pass either returns or moves/demotes one key
        for _ in range(2 * (len(self._small) + len(self._main)) + 4):
            if self._small and (self._small_bytes >= self._small_target or not self._main):
                key, size = next(iter(self._small.items()))
                if self._freq.get(key, 0) > 0:  # reused while on probation: promote to main
                    del self._small[key]
                    self._small_bytes -= size
                    self._main[key] = size
                    self._main_bytes += size
                    self._freq[key] = 0
                    continue
                self._remember_ghost(key)
                return key
            if self._main:
                key = next(iter(self._main))
                f = self._freq.get(key, 0)
                if f > 0:  # second chance: reinsert at the tail with one less credit
                    self._main.move_to_end(key)
                    self._freq[key] = f - 1
                    continue
                return key
            if self._small:
                return next(iter(self._small))
            return None
        return next(iter(self._main), next(iter(self._small), None))

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha), counted in blocks rather than bytes."""

    name = "arc"

    def __init__(self, capacity_bytes: int = 0) -> None:
        self._t1: OrderedDict[bytes, int] = OrderedDict()
        self._t2: OrderedDict[bytes, int] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0  # target size of T1, in blocks

    def on_insert(self, key: bytes, size: int) -> None:
        c = max(1, len(self))
        if key in self._b1:  # recency ghost hit: grow T1's share
            self._p = min(float(c), self._p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            del self._b1[key]
            self._t2[key] = size
        elif key in self._b2:  # frequency ghost hit: grow T2's share
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            del self._b2[key]
            self._t2[key] = size
        else:
            self.on_remove(key)
            self._t1[key] = size

    def on_access(self, key: bytes) -> None:
        if key in self._t1:
            self._t2[key] = self._t1.pop(key)
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def victim(self) -> bytes | None:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            key = next(iter(self._t1))
            self._b1[key] = None
        elif self._t2:
            key = next(iter(self._t2))
            self._b2[key] = None
        else:
            return None
        limit = max(16, len(self))
        for ghost in (self._b1, self._b2):
            while len(ghost) > limit:
                ghost.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "arc": ARCPolicy}


def make_eviction_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    try:
        cls = EVICTION_POLICIES[name.lower().replace("-", "").replace("_", "")]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None
    return cls(capacity_bytes)
