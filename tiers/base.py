"""The narrow interface every storage tier implements.

A tier is a dumb byte store keyed by ``bytes`` keys. It does not evict by itself: the
TieredStore (kvstore/) owns capacity accounting, eviction policy and spilling, and asks
the tier to ``put``/``delete``. ``scan`` lets the store rebuild its index after a restart
(disk, S3 and Redis keep their contents; cpu does not).

Batched variants default to loops over the single-key calls; a tier overrides them
when it can do better (one lmdb transaction, one Redis pipeline, ...).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

Buffer = bytes | bytearray | memoryview


class Tier(ABC):
    #: short tier name used in metrics and logs ("cpu", "disk", "s3", "redis")
    name: str = "tier"
    #: whether contents survive a restart of the process that owns the tier
    persistent: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{self.name}: capacity must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)

    # -- single-key operations ------------------------------------------------
    @abstractmethod
    def put(self, key: bytes, value: Buffer) -> None:
        """Store ``value`` under ``key`` (overwrite allowed). Raises TierError on failure."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | memoryview | None:
        """Return the stored bytes, or None when absent. Raises TierError on failure."""

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of payload currently stored (as the tier counts them)."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[bytes, int]]:
        """Yield (key, size) of every stored block (used to rebuild indexes after restart)."""

    # -- batched defaults -----------------------------------------------------
    def put_many(self, items: Iterable[tuple[bytes, Buffer]]) -> None:
        for k, v in items:
            self.put(k, v)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        return [self.get(k) for k in keys]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return sum(1 for k in keys if self.delete(k))

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
