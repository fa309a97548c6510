"""The engine serving through daemon faults: a hung shared tier, and the daemon SIGKILLed mid-offload.

Why: a cache may lose data but must never hang the engine or change its output. Every request
here completes with the tokens of a fresh prefill (an engine without a connector), within
generous bounds, while the fault is on; after the daemon restarts, its disk tier serves again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bench.servers import RedisServer
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, daemon
from tests.kvstore.faults_support import drained, tier, wait_for

pytestmark = pytest.mark.timeout(180)

PROMPTS = [prompt(120, seed=70 + i) for i in range(3)]  # 7 loadable pages each
BOUND_S = 10.0  # generous bound for one short generate on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    """Greedy tokens of a fresh prefill, no connector."""
    eng = make_engine(tiny)
    return [run(eng, ids).output_ids for ids in PROMPTS]


def _fresh(eng, conn, ids: list[int]) -> None:
    """Forget the prompt locally, so the next run asks the daemon."""
    eng.radix.reset()
    conn.known.discard(conn.keyspace.keys(ids, None))


def test_generate_while_the_shared_tier_hangs(tiny, tmp_path: Path, reference: list[list[int]]) -> None:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    try:
        # a 16 KiB cpu tier keeps about one page: the rest of each prompt lives in redis only
        with daemon(tmp_path, "--cpu", "16KiB", "--redis", server.url, env={"TIERKV_TIER_RETRY_S": "0.2"}) as d:
            eng = make_engine(tiny)
            conn = attach(eng, d.address, write_through=True, lookup_deadline_s=0.5, load_deadline_min_s=0.5,
                          down_backoff_s=0.2)  # fmt: skip
            c = connect(d, deadline_s=10, use_shm=False)  # the test's own view of the daemon
            try:
                assert run(eng, PROMPTS[0]).output_ids == reference[0]
                assert conn.flush(30)
                wait_for(lambda: drained(c), "write-through to redis")
                _fresh(eng, conn, PROMPTS[0])
                server.pause()  # hung: the daemon's reads of redis time out after 2 s
                try:
                    for _ in range(3):  # each one completes, identical, whatever the daemon does
                        t0 = time.monotonic()
                        got = run(eng, PROMPTS[0])
                        assert got.output_ids == reference[0] and time.monotonic() - t0 < BOUND_S
                        _fresh(eng, conn, PROMPTS[0])
                    wait_for(lambda: not tier(c, "redis").available, "the hung redis to be detached")
                finally:
                    server.resume()
                wait_for(lambda: tier(c, "redis").available, "redis to be attached again")
                got = run(eng, PROMPTS[0])
                assert got.output_ids == reference[0] and got.cached_tokens > 0  # loaded from redis again
            finally:
                c.close()
                detach(eng)
    finally:
        server.stop()


def test_daemon_sigkilled_mid_offload_then_restarted(tiny, tmp_path: Path, reference: list[list[int]]) -> None:
    with daemon(tmp_path, "--cpu", "16KiB", "--disk", f"{tmp_path}/disk:64MiB") as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, write_through=True, down_backoff_s=0.2)
        try:
            assert run(eng, PROMPTS[0]).output_ids == reference[0]
            assert conn.flush(30)
            with connect(d, deadline_s=10, use_shm=False) as c:
                wait_for(lambda: drained(c), "spills to disk")  # prompt 0 committed on disk
            client = conn.offloader.client
            put_many = client.put_many

            def killed_while_putting(*a: object, **kw: object) -> object:
                client.put_many = put_many  # once
                threading.Thread(target=d.kill).start()  # SIGKILL races this Put
                return put_many(*a, **kw)

            client.put_many = killed_while_putting  # type: ignore[method-assign]
            for i in (1, 2):  # the engine keeps serving: its offload fails, it recomputes
                assert run(eng, PROMPTS[i]).output_ids == reference[i]
            conn.flush(30)
            wait_for(lambda: d.proc is None, "the daemon to be killed")
            address = d.address
            d.start(listen=address)  # restarted on the same address: the disk tier is indexed again

            def served_from_disk() -> bool:  # the connector reconnects within a few requests
                _fresh(eng, conn, PROMPTS[0])
                got = run(eng, PROMPTS[0])
                assert got.output_ids == reference[0]
                return got.cached_tokens > 0

            wait_for(served_from_disk, "prompt 0 to be loaded from the restarted daemon's disk")
            for i in (1, 2):
                _fresh(eng, conn, PROMPTS[i])
                assert run(eng, PROMPTS[i]).output_ids == reference[i]
            eng.radix.check_integrity()
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)
