"""A queue bounded in bytes, with ``join`` — the write-back path between tiers.

Why bytes and not items: blocks range from kilobytes to tens of megabytes, and what must be
bounded is the memory held by blocks waiting to spill. A producer blocks while the queue is
full (backpressure on clients that write faster than the lower tiers absorb), for at most its
``timeout``: a producer is a client's call, and a lower tier that stopped draining must not hold
it for ever (the store then counts the block as not stored below). The worker itself enqueues
cascading spills with ``force=True``, since it must never wait on itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ByteBoundedQueue(Generic[T]):
    def __init__(self, max_bytes: int, size_of: Callable[[T], int]) -> None:
        self._max = max_bytes
        self._size_of = size_of
        self._items: deque[T] = deque()
        self._bytes = 0
        self._unfinished = 0
        self._closed = False
        self._cv = threading.Condition()

    def put(self, item: T, force: bool = False, timeout: float | None = None) -> bool:
        """Queue ``item``, waiting while the queue is full for at most ``timeout`` seconds (None:
        as long as it takes). False, and nothing queued, when the time ran out."""
        n = self._size_of(item)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            # an item larger than the whole bound still passes once the queue is empty
            while not force and not self._closed and self._items and self._bytes + n > self._max:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            self._items.append(item)
            self._bytes += n
            self._unfinished += 1
            self._cv.notify_all()
            return True

    def get(self) -> T | None:
        """Next item, or None once closed and drained."""
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if not self._items:
                return None
            item = self._items.popleft()
            self._bytes -= self._size_of(item)
            self._cv.notify_all()
            return item

    def task_done(self) -> None:
        with self._cv:
            self._unfinished -= 1
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every item put so far was processed. Returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def unfinished(self) -> int:
        """Items queued or being processed (what ``join`` waits for)."""
        return self._unfinished

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
