"""Blocks parked for a replay: pushed out of a level while every level below that should take them
was detached, so that they could land nowhere.

Why: a node cut off from Redis and S3 keeps putting; its cpu tier fills with blocks whose
write-through copies were skipped (their keys wait in the shared tiers' replay backlogs,
kvstore/store/replay.py). ``Level.unreplicated`` makes the tier evict those last, but once it holds
nothing else the oldest are evicted anyway, and with every level below detached they were
dropped: held nowhere, the replay after the heal skipped them. In bench.cluster's node_partitioned
fault the heal takes about a second (the kernel's ARP resend after a carrier loss), each round
puts 1 MiB into a 4 MiB cpu tier, and ``cut_puts_shared_after`` (the share of the blocks put
while cut off that another node later finds) was 0.0 when the heal took 4 rounds.

How: such a block is kept where blocks on their way down already live, the store's ``pending``
map (kvstore/store/shared_state.py): readable there, held (a put of its key stores nothing new),
and the replay reads it from there like any block in flight. ``Parked`` bounds those blocks to
``max_bytes`` in all (``StoreConfig.replay_park_bytes``); past it the oldest parked block is
dropped (then held nowhere: the replay counts it ``replay_skipped``, as before). A parked block is
unparked once any level holds it (the replay landed it) or when its key is deleted or moved again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.store.shared_state import Job

MAX_BYTES = 64 * 1024**2  # the default bound (StoreConfig.replay_park_bytes)


class Parked:
    """Parked jobs by key, the oldest first, at most ``max_bytes`` of blocks (0: none parked).
    Not thread-safe: the store holds its lock."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"parked blocks take >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._jobs: dict[bytes, Job] = {}  # insertion-ordered: the oldest first

    def park(self, job: Job) -> list[Job]:
        """Park ``job``; the jobs dropped to make room, the oldest first (``job`` itself when it
        does not fit at all)."""
        size = len(job.value)
        if size > self.max_bytes:
            return [job]
        self.unpark(job.key)
        dropped: list[Job] = []
        while self.bytes + size > self.max_bytes:
            dropped.append(self._pop(next(iter(self._jobs))))
        self._jobs[job.key] = job
        self.bytes += size
        return dropped

    def unpark(self, key: bytes) -> Job | None:
        """The job parked for ``key``, no longer counted (None: none was)."""
        return self._pop(key) if key in self._jobs else None

    def _pop(self, key: bytes) -> Job:
        job = self._jobs.pop(key)
        self.bytes -= len(job.value)
        return job

    def __contains__(self, key: bytes) -> bool:
        return key in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)
