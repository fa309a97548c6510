"""The replay backlog of a shared tier: the keys whose writes to it were skipped while it was detached.

Why: a detached tier is skipped (kvstore/store/breaker.py), so the write-through copies of the
blocks a node puts while cut off from Redis or S3 never reached them, and once the link healed
other nodes still could not find those blocks there. So a level other nodes read (``shared``, or
``write_through``: it is meant to hold every put) remembers each key whose write it skipped: the
key only, never the bytes (the block stays where it was put and is read from there at replay),
at most ``max_keys`` of them; past that the oldest key is dropped (counted, ``replay_dropped``).
A write that failed is remembered too: the errors that detach a tier are writes that never
reached it. A write that failed while the tier stayed attached (the first writes after a heal,
before the network answers again) is handed over again by the tier's prober every ``probe_s``
(kvstore/store/breaker.py) rather than waiting for a detach that may never come. A refusal for
lack of room (TierFull) is not remembered: the tier chose not to hold the block. Until the
replay, the level above keeps such a block over the others when it must evict
(``Level.unreplicated``): evicted while the tier below is detached, it could land nowhere, and
bench.cluster's partitioned node had evicted every block it put while cut off before its link
came back.

When the prober attaches the tier again it hands the backlog to the spill worker
(kvstore/store/spiller.py), which replays it a batch at a time between its other jobs: for each
key that the spill queue or some other level still holds, the block is read from there (verified
like any read, ``StoreState.intact``) and written through the worker's own path, so the tier's
capacity accounting stays single-writer; a key held nowhere any more (deleted, or evicted with
nowhere to go) is skipped (``replay_skipped``). Neither step holds the store lock during I/O, and
no request waits on a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_KEYS = 65536  # the default bound of a level's backlog (StoreConfig.replay_backlog_keys)
BATCH = 64  # keys replayed per turn of the spill worker, before the jobs queued meanwhile


class Backlog:
    """Keys in the order their writes were skipped, each once, at most ``max_keys`` (0: none kept).
    Not thread-safe: the store holds its lock."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 0:
            raise ValueError(f"a replay backlog holds >= 0 keys, got {max_keys}")
        self.max_keys = max_keys
        self._keys: dict[bytes, None] = {}  # insertion-ordered: the oldest first

    def add(self, key: bytes) -> int:
        """Remember ``key`` (again: it moves to the newest); the keys dropped to make room (0 or 1)."""
        if not self.max_keys:
            return 0
        if self._keys.pop(key, 0) is None:  # held already: just newer now
            self._keys[key] = None
            return 0
        self._keys[key] = None
        if len(self._keys) <= self.max_keys:
            return 0
        del self._keys[next(iter(self._keys))]
        return 1

    def take(self) -> list[bytes]:
        """Every key, the oldest first; the backlog is empty after."""
        keys, self._keys = list(self._keys), {}
        return keys

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys


@dataclass(eq=False)
class Replay:
    """A spill-queue item: replay ``keys[start:]`` into level ``target`` (one batch a turn)."""

    target: int
    keys: list[bytes]
    start: int = 0
