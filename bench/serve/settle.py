"""Settling the machine between modes: wait (bounded) until the CPUs are mostly idle and, for a
daemon mode, until the daemon's offload queue has drained, so that one mode's leftovers (offloads
still in flight, a server stopping) do not fall on the next mode's first point.

The CPU signal is the busy share of all cores over a short window from /proc/stat, not the load
average (whose one-minute decay lags a finished mode by minutes). Other engineers share this
machine: their load never falls on command, so the wait is bounded and what it reached is
recorded beside the figures, never assumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Settled:
    waited_s: float
    busy: float  # busy share of all cores over the last window (0..1)
    queue: float | None  # the daemon's offload queue at the end (None: no daemon)
    timed_out: bool


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_share(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Busy share of all cores between two ``cpu_times`` samples."""
    total = b[1] - a[1]
    return (b[0] - a[0]) / total if total > 0 else 0.0


def settle(max_s: float = 30.0, busy_below: float = 0.5, window_s: float = 2.0,
           queue: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic,
           sample: Callable[[], tuple[int, int]] = cpu_times, sleep: Callable[[float], None] = time.sleep) -> Settled:
    """Wait until a ``window_s`` window has the CPUs under ``busy_below`` busy and ``queue()`` (the
    daemon's pending offloads) at 0, or ``max_s`` has passed."""
    t0 = clock()
    while True:
        a = sample()
        sleep(window_s)
        busy = busy_share(a, sample())
        q = queue() if queue is not None else None
        if busy < busy_below and not q:
            return Settled(clock() - t0, busy, q, False)
        if clock() - t0 >= max_s:
            return Settled(clock() - t0, busy, q, True)
