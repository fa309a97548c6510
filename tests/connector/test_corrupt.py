"""A block the connector finds corrupt is deleted from the daemon and replaced by the recomputed page.

The daemon does not re-verify blocks in its top (cpu) tier on reads, so the engine's loader is the
check that catches them: the daemon runs in this process so the test can flip bytes inside the
cpu tier's own memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.state import kv_state
from kvstore.server.daemon import Daemon
from tests.connector.support import attach, detach, flip_in_place, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, served


@pytest.fixture
def inproc_daemon(tmp_path: Path) -> Iterator[Daemon]:
    with served(tmp_path, "--cpu", "64MiB") as d:
        yield d


def test_corrupt_block_is_deleted_and_offloaded_again(tiny, inproc_daemon: Daemon) -> None:
    ids = prompt(120, seed=7)  # 7 loadable pages
    want = run(make_engine(tiny), ids).output_ids
    eng = make_engine(tiny)
    conn = attach(eng, inproc_daemon.address)  # offloads on eviction
    try:
        run(eng, ids)
        eng.radix.evict(eng.pool.num_pages)  # offloaded: the connector now knows the daemon holds them
        assert conn.flush(30)
        keys = conn.keyspace.keys(ids, None)
        assert all(k in conn.known for k in keys[:7])
        flip_in_place(inproc_daemon.store.levels[0].tier, keys[3])

        got = run(eng, ids)
        assert got.cached_tokens == 48  # pages 0-2 intact; page 3 failed its checksum
        assert got.output_ids == want
        assert conn.metrics.value("tierkv_connector_load_failures_total", reason="checksum") == 1
        assert conn.metrics.value("tierkv_connector_corrupt_blocks_deleted_total") == 1
        with connect(inproc_daemon) as c:
            assert c.lookup([keys[3]]).tiers == [None]  # the bad block is gone
            eng.radix.evict(eng.pool.num_pages)  # the recomputed pages are offloaded again
            assert conn.flush(30)
            assert c.get_blocks([keys[3]], verify=True)[0] is not None  # repaired: verifies again
        again = run(eng, ids)
        assert again.cached_tokens == 112 and kv_state(again).decision.pages == 7  # hits the repaired block
        assert again.output_ids == want
        eng.radix.check_integrity()
        eng.pool.allocator.check_integrity()
    finally:
        detach(eng)
