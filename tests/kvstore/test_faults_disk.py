"""The disk tier under faults: a full lmdb map, and the daemon SIGKILLed in the middle of Puts and Gets.

Why: a full disk must cost evictions or counted refusals, never an error that detaches the tier
or a crash; a SIGKILL must lose at most what was not committed. With the disk as the only tier a
Put is acknowledged only after its lmdb transaction committed (one fsync), so "committed" is
observable: after a restart every acknowledged block is served, byte for byte, and nothing else
but the one Put in flight (whole, or absent: lmdb commits are atomic).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstore.client.client import KVStoreClient
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.errors import KVStoreError
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_kvstore import Daemon, connect, fetch, fetch_one
from tests.kvstore.faults_support import block, wait_for
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

pytestmark = pytest.mark.timeout(180)

BLOCK = 64 * 1024


def test_full_lmdb_map_evicts_or_refuses_and_keeps_serving(tmp_path: Path) -> None:
    # the store may hold 64 blocks on disk, but the map only has room for about 14
    disk = DiskTier(tmp_path / "disk", 64 * BLOCK, map_bytes=1 << 20)
    blocks = [block("full", i, floats=BLOCK // 4 - 32) for i in range(40)]
    # no promotion: it would evict a cpu block into the full disk while we check what the lookup reported
    with TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (disk, LevelOptions())], promote_on_hit=False) as s:
        for k, v in blocks:
            assert s.put(k, v)
        s.flush()
        st = s.stats().tiers[1]
        assert st.refused >= 1 and "map full" in st.last_error  # counted...
        assert st.available and st.errors == 0 and st.detaches == 0  # ...and not a failure
        assert st.evictions >= 1 and st.blocks >= 5  # room was made: it keeps taking blocks
        where = s.lookup([k for k, _ in blocks]).tiers
        got = [s.get(k) for k, _ in blocks]
        assert all(g is None or g == v for g, (_, v) in zip(got, blocks, strict=True))  # a miss, never wrong
        assert where.count("disk") == st.blocks and where.count("cpu") == 2
        assert all(g == v for g, (_, v), t in zip(got, blocks, where, strict=True) if t is not None)


def _writer(c: KVStoreClient, acked: list[int], sent: list[int], stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        sent.append(i)
        try:
            c.put_many([block("kill", i)])
        except KVStoreError:
            return
        acked.append(i)
        i += 1


def _reader(c: KVStoreClient, keys: list[bytes], want: list[bytes], rounds: list[int],
            errors: list[object]) -> None:  # fmt: skip
    while True:
        try:
            got = fetch(c, keys)
        except KVStoreError as e:  # typed, never a hang: the daemon is gone
            errors.append(e)
            return
        if got != want:
            errors.append("wrong bytes")
            return
        rounds.append(1)


def test_sigkill_mid_put_and_mid_get_keeps_exactly_the_committed_blocks(tmp_path: Path) -> None:
    d = Daemon(tmp_path, "--disk", f"{tmp_path}/disk:64MiB").start()  # the disk is the top: a Put commits
    port = d.address.rpartition(":")[2]
    retry = Retry(attempts=40, backoff=ExponentialBackoff(0.05, 0.5))
    try:
        acked: list[int] = []
        sent: list[int] = []
        stop = threading.Event()
        with connect(d, deadline_s=5, retry=Retry(attempts=1)) as c:
            t = threading.Thread(target=_writer, args=(c, acked, sent, stop))
            t.start()
            wait_for(lambda: len(acked) >= 20, "20 acknowledged puts")
            d.kill()  # SIGKILL while the writer is in the middle of its Puts
            t.join(timeout=30)
            stop.set()
            assert not t.is_alive()
        d.start(listen=f"127.0.0.1:{port}")
        with connect(d, deadline_s=10, retry=retry) as c:
            assert fetch(c, [block("kill", i)[0] for i in acked]) == [block("kill", i)[1] for i in acked]
            in_flight = [i for i in sent if i not in acked]
            assert len(in_flight) <= 1
            for i in in_flight:  # committed before the kill (acknowledgement lost), or not at all
                assert fetch_one(c, block("kill", i)[0]) in (None, block("kill", i)[1])
            assert fetch_one(c, block("kill", len(sent))[0]) is None  # never sent
            assert len(acked) <= c.stats().tiers[0].blocks <= len(sent)

            keys = [block("kill", i)[0] for i in acked]
            want = [block("kill", i)[1] for i in acked]
            rounds: list[int] = []
            errors: list[object] = []
            with connect(d, deadline_s=5, retry=Retry(attempts=1)) as reader:
                t = threading.Thread(target=_reader, args=(reader, keys, want, rounds, errors))
                t.start()
                wait_for(lambda: len(rounds) >= 2, "two rounds of reads")
                d.kill()  # SIGKILL in the middle of the reader's Gets
                t.join(timeout=30)
                assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], KVStoreError), errors
            d.start(listen=f"127.0.0.1:{port}")
            assert fetch(c, keys) == want  # the same client, reconnected: everything still served
    finally:
        d.stop()
