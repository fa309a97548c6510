"""The narrow interface every storage tier implements: what the TieredStore calls, and no more.

A tier is a dumb byte store keyed by ``bytes`` keys. It does not evict by itself: the
TieredStore (kvstore/) owns capacity accounting, eviction policy and spilling, and asks
the tier to ``put``/``delete``. ``scan`` lets the store rebuild its index after a restart
(disk, S3 and Redis keep their contents; cpu does not).

The one batched call is ``contains_many``: the store's ``lookup`` asks a shared tier about many
keys at once, which a remote tier answers in one round trip (a Redis pipeline) or in parallel
(S3). Everything else the store does one block at a time.

``probe`` asks "does the backing server answer?" with the cheapest call the tier has; the store
uses it at start and to decide when a detached tier may be attached again (kvstore/store/breaker.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tiers.cpu import ArenaShare

Buffer = bytes | bytearray | memoryview
_PROBE_KEY = b"tierkv-probe"


class Arena(Protocol):
    """Memory a tier keeps its blocks in, addressable from outside it (the cpu tier's arena): what
    the daemon needs to answer reads in place and to say what pages the arena has."""

    #: the arena's pages: "hugetlb", "thp", "4KiB" or "pinned"
    page_kind: str

    def share(self) -> ArenaShare | None:
        """How another process on this host maps it; None when it is private (or closed)."""

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(offset in the shared arena's file, length) of ``key``'s bytes, None when not in it."""

    def arena_offset(self, view: memoryview) -> int | None:
        """Offset in the shared arena's file of the bytes ``view`` (from ``get``) shows, or None."""


class Tier(ABC):
    #: short tier name used in metrics and logs ("cpu", "disk", "s3", "redis")
    name: str = "tier"
    #: whether contents survive a restart of the process that owns the tier
    persistent: bool = False
    #: whether its bytes live in this process's memory, written only through ``put`` (the cpu
    #: tier): a store serves them without verifying them again when this tier is on top. Every
    #: other tier's reads (bytes that sat on a disk or another server) are verified before they
    #: are served.
    in_process: bool = False
    #: whether ``get`` returns only values it verified itself as the intact block stored under
    #: that key, and deletes (and answers as a miss) what fails (kvstore/store/signed_tier.py: a
    #: keyed MAC over the key and every byte). A store does not verify these reads a second time.
    verifies_reads: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{self.name}: capacity must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)

    @abstractmethod
    def put(self, key: bytes, value: Buffer) -> None:
        """Store ``value`` under ``key`` (overwrite allowed). Raises TierError on failure."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | memoryview | None:
        """Return the stored bytes, or None when absent. Raises TierError on failure."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present, in order."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[bytes, int]]:
        """Yield (key, size) of every stored block (used to rebuild indexes after restart)."""

    @abstractmethod
    def close(self) -> None: ...

    def arena(self) -> Arena | None:
        """The memory this tier keeps blocks in, when it can be addressed from outside the tier
        (the cpu tier's arena); None for every other tier."""
        return None

    def probe(self) -> None:
        """Raise TierError (TierUnavailable when it cannot be reached) unless the tier answers."""
        self.contains_many([_PROBE_KEY])

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
