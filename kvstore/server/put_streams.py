"""Put streams: how many may be open at once, and how long each may take to arrive.

Why: gRPC Python runs each call on a worker thread for the call's whole life, and a Put reads its
client's stream on that thread. A client that opens Put streams and never commits held workers
for ever: eight such streams froze all eight workers, and every other client's Lookup waited.
Two bounds, each paid by the client that hits it:

- at most ``max_streams`` Puts at once, fewer than the workers: past it a Put is refused at
  once (UNAVAILABLE, which clients retry with backoff), so reads always find a free worker;
- each Put stream must be read to its commit within ``timeout_s``: past it the call is cancelled
  (``context.cancel()``: the read blocked in the stream returns, the worker is free) and nothing
  of it is stored, since blocks are stored only after the commit. One thread watches every
  deadline; storing after the commit is the daemon's own work and is not cut short.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class PutStream:
    """One admitted Put: ``read_done()`` once its commit (or its end) was read."""

    __slots__ = ("context", "deadline", "expired", "_cv")

    def __init__(self, context: Any, deadline: float, cv: threading.Condition) -> None:
        self.context: Any = context  # None once read (or released): nothing left to cancel
        self.deadline = deadline
        self.expired = False  # its deadline passed before it was read: cancelled
        self._cv = cv

    def read_done(self) -> bool:
        """The stream was read to its end; False when its deadline came first (store nothing)."""
        with self._cv:
            self.context = None
            return not self.expired


class PutStreams:
    def __init__(self, max_streams: int, timeout_s: float) -> None:
        if max_streams < 1 or timeout_s <= 0:
            raise ValueError(f"max_streams must be >= 1 and timeout_s > 0, got {max_streams}, {timeout_s}")
        self.max_streams, self.timeout_s = max_streams, timeout_s
        self._cv = threading.Condition()
        self._open = 0
        self._heap: list[tuple[float, int, PutStream]] = []  # by deadline; read streams left to expire
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.cancelled = 0  # streams cancelled at their deadline

    def admit(self, context: Any) -> PutStream | None:
        """A slot and a deadline for one Put; None when ``max_streams`` are open."""
        with self._cv:
            if self._open >= self.max_streams or self._closed:
                return None
            self._open += 1
            stream = PutStream(context, time.monotonic() + self.timeout_s, self._cv)
            heapq.heappush(self._heap, (stream.deadline, next(self._seq), stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="kvstore-put-deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()
            return stream

    @property
    def open(self) -> int:
        """Put streams admitted and not yet released."""
        return self._open

    def release(self, stream: PutStream) -> None:
        with self._cv:
            stream.context = None
            self._open -= 1

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)

    def _watch(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, stream = heapq.heappop(self._heap)
                context = stream.context
                stream.context = None
                if context is not None:
                    stream.expired = True
                    self.cancelled += 1
            if context is not None:
                log.warning("a Put stream from %s sent no commit within %.0f s: cancelled, nothing of it stored",
                            _peer(context), self.timeout_s)
                context.cancel()


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"
