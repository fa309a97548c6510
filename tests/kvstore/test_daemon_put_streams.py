"""Put streams on the real daemon: a deadline each, and a cap on how many are open at once.

Why: gRPC Python runs each call on a worker thread for its whole life, and a Put reads its
client's stream on that thread: eight Put streams that never commit froze all eight workers, and
every other client's Lookup waited (kvstore/server/put_streams.py). Waits are bounded generously
and never asserted as latencies.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.fixtures_kvstore import connect, served
from tests.kvstore.faults_support import wait_for
from tests.kvstore.limits_support import WAIT_S, StalledPuts, blk, code, lookup, settings

pytestmark = pytest.mark.timeout(240)


def test_stalled_put_streams_are_cancelled_at_their_deadline(tmp_path: Path) -> None:
    """Eight Put streams that never commit, on eight workers all allowed to take Puts: each is
    cancelled at put_stream_timeout_s, nothing of it is stored, and another client's Lookup is answered."""
    env = settings(workers=8, max_put_streams=8, put_stream_timeout_s=1.0, grace_s=2)
    with served(tmp_path, "--no-auth", env=env) as d:
        puts = StalledPuts(d.address)
        try:
            keys = [b"stall-%d" % i for i in range(8)]
            for k in keys:
                puts.open(k)
            resp = lookup(d.address, keys)  # waits for a worker: one frees at the first deadline
            assert resp.prefix_len == 0
            assert [code(f) for f in puts.calls] == [grpc.StatusCode.CANCELLED] * 8
            assert list(lookup(d.address, keys).tiers) == [""] * 8  # every byte was sent, none stored
            assert d.servicer.put_streams.cancelled == 8
            with connect(d, use_shm=False, use_stream=False) as c:  # the workers take Puts again
                assert c.put_many([(k, blk(k)) for k in keys]) == [True] * 8
        finally:
            puts.close()


def test_put_streams_past_the_cap_are_refused_so_reads_find_a_worker(tmp_path: Path) -> None:
    env = settings(workers=4, max_put_streams=2, put_stream_timeout_s=600, grace_s=2)
    with served(tmp_path, "--no-auth", env=env) as d:
        puts = StalledPuts(d.address)
        try:
            for i in range(4):
                puts.open(b"cap-%d" % i)
            wait_for(lambda: sum(f.done() for f in puts.calls) == 2, "two Puts to be refused", WAIT_S)
            refused = [f for f in puts.calls if f.done()]  # the other two stay open: they never commit
            assert [f.exception().code() for f in refused] == [grpc.StatusCode.UNAVAILABLE] * 2
            assert "(max_put_streams)" in refused[0].exception().details()
            assert lookup(d.address, [b"cap-0"]).prefix_len == 0  # two workers stay free for reads
            assert d.servicer.put_streams.open == 2
        finally:
            puts.close()
