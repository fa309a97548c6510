"""The daemon against remote tiers that are down at boot, stopped, restarted and hung (SIGSTOP).

Each test runs its own redis-server / SeaweedFS on loopback (the session servers stay intact) and
a real ``kvstore serve``: it starts degraded instead of crash-looping, serves misses while a
tier is gone (the engine recomputes), counts the errors, detaches the tier after consecutive
errors and attaches it again once a background probe finds it answering.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.servers import RedisServer, SeaweedS3, free_port, prepare_bucket
from kvstore import cli
from kvstore.client.client import KVStoreClient
from kvstore.errors import KVStoreTimeout
from kvstore.server.health import TIER_SERVICE
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_kvstore import Daemon, connect, fetch, fetch_one
from tests.kvstore.faults_support import block, drained, tier, wait_for
from tiers.cpu import CpuTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.timeout(240)

FAST = {"TIERKV_TIER_RETRY_S": "0.2"}  # first probe after 0.2 s, backoff capped at 2 s
SLACK_S = 5.0  # generous bound past a call's deadline on a loaded 2-core machine


@contextlib.contextmanager
def serving(d: Daemon) -> Iterator[Daemon]:
    d.start()
    try:
        yield d
    finally:
        d.stop()
    assert "Traceback" not in d.log.read_text()


def _get_within(c: KVStoreClient, key: bytes) -> bytes | None:
    """One Get that must come back by its deadline: the block, a miss, or a typed timeout (None)."""
    t0 = time.monotonic()
    try:
        got = fetch_one(c, key)
    except KVStoreTimeout:
        got = None
    assert time.monotonic() - t0 < c.deadline_s + SLACK_S
    return got


def test_redis_down_at_boot_then_stopped_restarted_and_hung(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", start=False)  # the URL exists, the server does not yet
    mport = free_port()
    blocks = [block("red", i) for i in range(12)]  # 64 KiB each; the cpu tier holds 2
    d = Daemon(tmp_path, "--cpu", "160KiB", "--redis", server.url, "--metrics-port", str(mport), env=FAST)
    try:
        with serving(d), connect(d, deadline_s=5) as c:
            # boot: degraded, not down
            assert c.health() and c.health_status(TIER_SERVICE + "cpu") == "SERVING"
            assert c.health_status(TIER_SERVICE + "redis") == "NOT_SERVING"
            assert cli.main(["health", "--address", d.address]) == 0
            assert "SERVING (degraded: redis detached)" in capsys.readouterr().out
            assert cli.main(["stats", "--address", d.address]) == 0
            table = capsys.readouterr().out
            assert "DETACHED" in table and "redis last error: TierUnavailable" in table
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
            assert 'tierkv_tier_available{tier="redis"} 0.0' in metrics
            assert c.put_many(blocks[:2]) == [True, True]  # served from cpu meanwhile
            assert fetch(c, [k for k, _ in blocks[:2]]) == [v for _, v in blocks[:2]]
            st = tier(c, "redis")
            assert not st.available and st.detaches == 1 and st.skipped_writes == 2 and "cannot reach" in st.last_error

            server.start()  # comes up after the daemon: attached by the prober
            wait_for(lambda: tier(c, "redis").available, "redis to be attached")
            assert tier(c, "redis").attaches == 1 and c.health_status(TIER_SERVICE + "redis") == "SERVING"
            assert c.put_many(blocks[2:8]) == [True] * 6
            wait_for(lambda: drained(c), "write-through to redis")
            raw = redis.Redis.from_url(server.url)
            assert raw.exists(*[b"tierkv:" + k for k, _ in blocks[2:8]]) == 6
            raw.close()
            assert c.lookup([blocks[2][0]]).tiers == ["redis"]  # evicted from cpu: lives in redis only

            server.stop()  # stopped while serving: misses within the deadline, errors counted, detached
            for k, _ in blocks[2:6]:
                assert _get_within(c, k) is None
            st = tier(c, "redis")
            assert not st.available and st.detaches == 2 and st.errors >= 3
            assert c.put_many(blocks[8:10]) == [True, True] and fetch_one(c, blocks[9][0]) == blocks[9][1]

            server.start()  # restarted (empty): attached again
            wait_for(lambda: tier(c, "redis").available, "redis to be attached after its restart")
            assert tier(c, "redis").attaches == 2
            assert c.put_many(blocks[10:12]) == [True, True]
            wait_for(lambda: drained(c), "write-through to the restarted redis")
            assert c.lookup([blocks[10][0]]).tiers[0] in ("cpu", "redis")

            server.pause()  # hung: accepts, answers nothing; every call still ends by its deadline
            try:
                with connect(d, deadline_s=1.0, use_shm=False) as quick:
                    # blocks 2..7 are indexed in redis (lost with its restart, which only a read can tell)
                    wait_for(lambda: _get_within(quick, blocks[2][0]) is None and not tier(c, "redis").available,
                             "the hung redis to be detached")  # fmt: skip
                    t0 = time.monotonic()
                    assert fetch_one(quick, blocks[3][0]) is None  # detached: skipped, not waited on
                    assert quick.lookup([blocks[11][0], blocks[3][0]]).prefix_len == 1
                    assert time.monotonic() - t0 < quick.deadline_s + SLACK_S
            finally:
                server.resume()
            wait_for(lambda: tier(c, "redis").available, "redis to be attached once it answers again")
            st = tier(c, "redis")
            assert st.detaches == 3 and st.attaches == 3
    finally:
        server.stop()


def test_s3_down_at_boot_then_stopped_restarted_and_hung(tmp_path: Path) -> None:
    (tmp_path / "weed").mkdir()
    weed = SeaweedS3(tmp_path / "weed", start=False)
    blocks = [block("s3f", i) for i in range(6)]  # 64 KiB each; the cpu tier holds 2
    try:
        _s3_stopped_and_restarted(tmp_path, weed, blocks)
        _s3_hung(weed, blocks)
    finally:
        weed.stop()


def _s3_stopped_and_restarted(tmp_path: Path, weed: SeaweedS3, blocks: list[tuple[bytes, bytes]]) -> None:
    ep = weed.endpoint
    env = {**FAST, "AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key}
    d = Daemon(tmp_path, "--cpu", "160KiB", "--s3", "s3://faults/p/", "--s3-endpoint", ep.url, env=env)
    with serving(d), connect(d, deadline_s=10) as c:
        assert c.health() and c.health_status(TIER_SERVICE + "s3") == "NOT_SERVING"
        assert c.put_many(blocks[:3]) == [True] * 3  # one spill had nowhere to go: counted
        wait_for(lambda: drained(c), "the spill queue")
        assert tier(c, "s3").skipped_writes >= 1

        weed.start()  # comes up after the daemon
        prepare_bucket(ep, "faults")  # its first write grows volumes: seconds, kept out of the tier's timeouts
        wait_for(lambda: tier(c, "s3").available, "s3 to be attached")
        assert c.put_many(blocks[3:]) == [True] * 3
        wait_for(lambda: drained(c), "spills to s3")
        assert c.lookup([blocks[3][0]]).tiers == ["s3"] and fetch_one(c, blocks[3][0]) == blocks[3][1]

        weed.stop()  # reads of blocks that live only in s3 miss (never fail) until it is detached
        wait_for(lambda: all(_get_within(c, k) in (None, v) for k, v in blocks[3:])
                 and not tier(c, "s3").available, "s3 to be detached")  # fmt: skip
        assert tier(c, "s3").errors >= 3

        weed.start()
        wait_for(lambda: tier(c, "s3").available, "s3 to be attached after its restart")
        assert tier(c, "s3").attaches == 2
        assert fetch_one(c, blocks[4][0]) in (None, blocks[4][1])  # what survived the restart, or a miss


def _s3_hung(weed: SeaweedS3, blocks: list[tuple[bytes, bytes]]) -> None:
    """SIGSTOP: a store with short S3 timeouts (the daemon's defaults, 3 s x 2 attempts, are only slower).
    The blocks are written first with the tier's default timeouts: a SeaweedFS just restarted can take
    longer than 0.5 s per write on a loaded machine, and three such writes detached the short-timeout
    tier before the part under test began. The store finds them in the shared server."""
    ep = weed.endpoint
    with S3Tier(ep.url, "faults", 1 << 20, prefix="hung/", access_key=ep.access_key,
                secret_key=ep.secret_key) as patient:
        for k, v in blocks:
            patient.put(k, v)
    s3 = S3Tier(ep.url, "faults", 1 << 20, prefix="hung/", access_key=ep.access_key, secret_key=ep.secret_key,
                connect_timeout_s=0.5, read_timeout_s=0.5, max_attempts=1)  # fmt: skip
    with TieredStore([(CpuTier(160 << 10), LevelOptions()), (s3, LevelOptions(shared=True))], tier_retry_s=0.2) as s:
        assert s.lookup([blocks[0][0]]).tiers == ["s3"]
        weed.pause()
        try:
            t0 = time.monotonic()
            for k, _ in blocks[:4]:  # three timeouts detach it; the fourth read skips it
                assert s.get(k) is None
            assert time.monotonic() - t0 < 3 * 0.5 * 2 + SLACK_S
            assert not s.stats().tiers[1].available
        finally:
            weed.resume()
        wait_for(lambda: s.stats().tiers[1].available, "the resumed s3 to be attached")
        assert s.get(blocks[0][0]) == blocks[0][1]
