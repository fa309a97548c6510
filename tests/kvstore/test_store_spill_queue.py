"""A call that finds the spill queue full waits ``spill_put_timeout_s`` at most.

Why: the queue's bound is backpressure, but a lower tier that stops draining (a disk stalled, a
remote tier hung within its timeouts) made every put that had to evict wait for ever, each
holding a daemon worker. Now the block it could not queue is not stored below, counted, and not
left claimed by the queue (a later put of it is accepted). The stalled tier is a real disk tier
whose put waits on an Event; no wait is asserted as a latency.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.base import Buffer
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

pytestmark = pytest.mark.timeout(120)

BLOCK = 64 * 1024
WAIT_S = 30.0


def _k(i: int) -> bytes:
    return b"spq-%012d" % i


def _v(i: int) -> bytes:
    return encode_block(_k(i), np.full(BLOCK // 4 - 32, i, np.float32))


class Hold:
    """Holds the calls it is asked about until released; says when one entered."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "never released"


class HeldDisk(DiskTier):
    """The disk tier, with its puts held while ``hold`` is set."""

    hold: Hold | None = None

    def put(self, key: bytes, value: Buffer) -> None:
        if self.hold is not None:
            self.hold()
        super().put(key, value)


def _in_thread(fn) -> tuple[threading.Thread, threading.Event, list]:  # type: ignore[no-untyped-def]
    done, out = threading.Event(), []

    def run() -> None:
        out.append(fn())
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out


def test_a_put_that_finds_the_spill_queue_full_gives_up_in_time(tmp_path: Path) -> None:
    disk = HeldDisk(tmp_path / "d", 64 * BLOCK)
    with TieredStore([(CpuTier(2 * BLOCK, shared=False), LevelOptions()), (disk, LevelOptions())],
                     spill_queue_bytes=BLOCK, spill_put_timeout_s=0.2) as s:  # fmt: skip
        disk.hold = hold = Hold()
        s.put(_k(0), _v(0))
        s.put(_k(1), _v(1))
        s.put(_k(2), _v(2))  # k0 goes down: the spiller holds it, inside the disk's put
        assert hold.entered.wait(WAIT_S)
        s.put(_k(3), _v(3))  # k1 waits in the queue, which is now full
        putter, done, out = _in_thread(lambda: s.put(_k(4), _v(4)))  # k2 cannot be queued
        try:
            assert done.wait(WAIT_S), "a put waited on a full spill queue for ever"
        finally:
            hold.release.set()
        assert out == [True] and s.stats().spill_timeouts == 1
        assert s.flush(WAIT_S)
        tiers = s.lookup([_k(i) for i in range(5)]).tiers
        assert tiers == ["disk", "disk", None, "cpu", "cpu"]  # k2 was dropped, and nothing claims it
        assert s.get(_k(2)) is None and s.put(_k(2), _v(2))  # so it can be stored again
