"""Helpers shared by the asynchronous-load tests (no tests here): an in-process daemon, a loader
whose transfer a test holds on an Event, a prompt put into the daemon only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from connector.connector import KVConnector
from connector.loader import Loader
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvstore.config import load_config
from kvstore.server import Daemon
from tests.test_connector_support import run

PS = 16


@contextmanager
def inproc_daemon(tmp: Path, *flags: str) -> Iterator[Daemon]:
    # --no-stream: loads go through shared memory (the raw Get channel's stop waits out a 5 s accept() join)
    d = Daemon(load_config(["--listen", "127.0.0.1:0", "--no-stream", "--cpu", "64MiB", *flags],
                           env={"TIERKV_CACHE_DIR": str(tmp)}))
    d.start()
    try:
        yield d
    finally:
        d.stop()


def engine(loaded, num_pages: int = 64, max_prefill_tokens: int = 4096) -> LLMEngine:
    return LLMEngine(EngineConfig(num_pages=num_pages, page_size=PS, num_threads=2,
                                  max_prefill_tokens=max_prefill_tokens), loaded=loaded)


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
