"""Calls that must answer within a deadline whatever the library does inside: ``BoundedCalls``.

Why: a per-socket timeout bounds one recv, not a call. redis-py's cluster pipeline (the tier's
``contains_many``) writes to every node, then reads the nodes one after the other, each read
waiting the full socket timeout, and then resends each failed command alone, the first one
running a topology refresh through every node: cut off from the cluster, one lookup took 8.2 s
with a 2 s socket timeout. A small reply (a lookup's booleans) has no reason to take longer than
one node's connect and read, so such a call runs on a worker thread and the caller waits at most
``timeout_s``; past it the caller gets ``DeadlineExceeded`` (a TimeoutError) at once. The worker is
not interrupted: redis-py finishes (or fails) the call on its own and keeps its client consistent;
its result is dropped. Not for bulk reads: their time grows with their size, not with faults.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """The call did not answer within its deadline (it may still finish on its worker)."""


class BoundedCalls:
    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"BoundedCalls needs at least one worker, got {workers}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()``'s result or exception, or DeadlineExceeded after ``timeout_s`` (queueing included)."""
        future: Future[T] = self._pool.submit(fn)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()  # still queued behind stuck calls: never run it
            raise DeadlineExceeded(f"no answer within {timeout_s} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
