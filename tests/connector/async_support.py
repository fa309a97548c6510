"""Helpers shared by the asynchronous-load tests (no tests here): the flags of their in-process
daemon, a loader whose transfer a test holds on an Event, a prompt put into the daemon only."""

from __future__ import annotations

import threading

from connector.connector import KVConnector
from connector.loader import Loader
from engine.engine import LLMEngine
from tests.connector.support import run

PS = 16
#: the in-process daemon of these tests (``served(tmp, *DAEMON_FLAGS)``); --no-stream: loads go through
#: shared memory (the raw Get channel's stop waits out a 5 s accept() join)
DAEMON_FLAGS = ("--no-stream", "--cpu", "64MiB")


class HeldLoader(Loader):
    """A test double of the loader's throttle: one page per chunk, and the chunk number ``at`` waits
    until ``gate`` is set (or, unset, until just past the load's deadline). ``entered`` is set when a
    transfer reaches it: from then on the transfer worker holds the load's pages."""

    def __init__(self, base: Loader, at: int = 0) -> None:
        super().__init__(base.client, base.pool, base.pool.bytes_per_page, in_place_chunk_bytes=base.pool.bytes_per_page)
        self.at, self.chunks = at, 0
        self.gate, self.entered = threading.Event(), threading.Event()

    def _throttle(self, n_blocks: int, left: float) -> None:
        held = self.chunks == self.at
        self.chunks += 1
        if held:
            self.entered.set()
            self.gate.wait(left + 0.1)


def in_daemon_only(eng: LLMEngine, conn: KVConnector, ids: list[int]) -> list[int]:
    """Run ``ids`` once (its greedy output is returned), send its pages to the daemon, and empty
    the radix tree: the next run of ``ids`` can only load them."""
    want = run(eng, ids).output_ids
    eng.radix.evict(eng.pool.num_pages)  # offload on evict
    assert conn.flush(60)
    eng.radix.reset()
    return want
