"""TieredStore and daemon with the remote tiers on real servers (redis-server, SeaweedFS S3):
write-through sharing between nodes, admission to S3, and a Redis killed mid-run."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.servers import RedisServer, S3Endpoint
from kvstore.block import encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_kvstore import Daemon, connect, fetch, fetch_one
from tiers.cpu import CpuTier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

BLOCK = 64 * 1024


def _k(i: int) -> bytes:
    return b"rk-%013d" % i


def _v(i: int) -> bytes:
    """An encoded block of exactly BLOCK bytes: the store verifies what it reads below the top."""
    payload = np.frombuffer((i.to_bytes(4, "little") * (BLOCK // 4))[: BLOCK - 64], dtype=np.uint8)
    return encode_block(_k(i), payload)


@pytest.fixture
def prefix() -> bytes:
    return f"t-{uuid.uuid4().hex[:12]}:".encode()


def _s3(ep: S3Endpoint, prefix: str) -> S3Tier:
    return S3Tier(ep.url, "tierkv-tests", 64 * BLOCK, prefix=prefix, access_key=ep.access_key,
                  secret_key=ep.secret_key, region=ep.region)  # fmt: skip


def test_write_through_is_shared_between_nodes(redis_url: str, prefix: bytes) -> None:
    shared = LevelOptions(write_through=True, shared=True)
    a = TieredStore([(CpuTier(4 * BLOCK), LevelOptions()), (RedisTier(redis_url, 64 * BLOCK, prefix=prefix), shared)])
    b = TieredStore([(CpuTier(4 * BLOCK), LevelOptions()), (RedisTier(redis_url, 64 * BLOCK, prefix=prefix), shared)])
    try:
        for i in range(3):
            a.put(_k(i), _v(i))
        a.flush()  # write-through copies are queued at put time; flush waits for them
        assert a.lookup([_k(0)]).tiers == ["cpu"]  # still in a's cpu tier, and already in redis:
        assert b.lookup([_k(i) for i in range(4)]) == (3, ["redis", "redis", "redis", None], [None] * 4, None)
        assert b.get(_k(1)) == _v(1)  # node b reads it from redis and promotes it locally
        assert b.lookup([_k(1)]).tiers == ["cpu"]
        assert b.delete(_k(2)) and a.lookup([_k(2)]).tiers == ["cpu"] and b.lookup([_k(2)]).tiers == [None]
    finally:
        for s in (a, b):
            for i in range(3):
                s.delete(_k(i))
            s.close()


def test_s3_admission_and_spill(s3_endpoint: S3Endpoint) -> None:
    pre = f"t-{uuid.uuid4().hex[:12]}/"
    s = TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (_s3(s3_endpoint, pre), LevelOptions(admit_min_hits=1))])
    try:
        for i in range(2):
            s.put(_k(i), _v(i))
        assert s.get(_k(0)) == _v(0)  # block 0 hit once -> admitted to s3 on spill; 1 is not
        for i in range(2, 4):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0), _k(1)]).tiers == ["s3", None]
        st = s.stats().tiers[1]
        assert st.spills == 1 and st.dropped >= 1
        assert s.get(_k(0)) == _v(0)
    finally:
        s.close()
    s2 = TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (_s3(s3_endpoint, pre), LevelOptions())])
    try:  # s3 is persistent: its index is rebuilt from a listing
        assert s2.stats().tiers[1].blocks == 1 and s2.get(_k(0)) == _v(0)
        s2.delete(_k(0))
    finally:
        s2.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


def test_redis_killed_mid_run(tmp_path: Path, own_redis: RedisServer) -> None:
    cfg = {
        "tier_retry_s": 30,
        "tiers": [
            {"kind": "cpu", "capacity": "1MiB"},
            {"kind": "redis", "url": own_redis.url, "capacity": "64MiB", "write_through": True},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB", "write_through": True},
        ],
    }
    (tmp_path / "kv.yaml").write_text(yaml.safe_dump(cfg))
    d = Daemon(tmp_path, "--config", str(tmp_path / "kv.yaml")).start()
    try:
        blocks = [(b"blk-%012d" % i, encode_block(b"blk-%012d" % i, np.full(64 * 1024, i, np.float32)))
                  for i in range(10)]  # fmt: skip
        with connect(d, deadline_s=10) as c:
            c.put_many(blocks[:8])
            deadline = time.monotonic() + 20
            while c.stats().pending_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.lookup([blocks[0][0]]).tiers == ["redis"]
            own_redis.stop()  # the shared tier's server dies
            assert fetch(c, [k for k, _ in blocks[:8]]) == [b for _, b in blocks[:8]]  # fell through to disk
            assert c.put_many(blocks[8:]) == [True, True]  # writes go on
            assert fetch_one(c, blocks[9][0]) == blocks[9][1]
            st = {t.name: t for t in c.stats().tiers}
            assert st["redis"].errors >= 1 and not st["redis"].available and st["redis"].last_error
            assert c.lookup([blocks[0][0]]).tiers == ["disk"]
    finally:
        d.stop()
    assert "Traceback" not in d.log.read_text()


def test_daemon_with_every_tier_from_flags(tmp_path: Path, s3_endpoint: S3Endpoint, redis_url: str) -> None:
    pre = f"t-{uuid.uuid4().hex[:12]}"
    env = {"AWS_ACCESS_KEY_ID": s3_endpoint.access_key, "AWS_SECRET_ACCESS_KEY": s3_endpoint.secret_key}
    d = Daemon(tmp_path, "--cpu", "1MiB", "--disk", f"{tmp_path}/disk:2MiB", "--redis", redis_url,
               "--redis-capacity", "3MiB", "--s3", f"s3://tierkv-tests/{pre}", "--s3-endpoint", s3_endpoint.url,
               env=env).start()  # fmt: skip
    blocks = [(b"all-%012d" % i, encode_block(b"all-%012d" % i, np.full(64 * 1024, i, np.float32)))
              for i in range(20)]  # fmt: skip
    try:
        with connect(d, deadline_s=30) as c:
            c.put_many(blocks)
            deadline = time.monotonic() + 30
            while c.stats().pending_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            st = {t.name: t for t in c.stats().tiers}
            assert list(st) == ["cpu", "disk", "redis", "s3"]
            assert st["s3"].spills >= 1 and all(t.used_bytes <= t.capacity_bytes for t in st.values())
            res = c.lookup([k for k, _ in blocks])
            assert res.prefix_len == 20 and "s3" in res.tiers and "cpu" in res.tiers
            assert fetch(c, [k for k, _ in blocks]) == [b for _, b in blocks]
            assert c.delete([k for k, _ in blocks]) == 20
    finally:
        d.stop()


def test_hung_redis_does_not_freeze_the_store(own_redis: RedisServer) -> None:
    shared = LevelOptions(write_through=True, shared=True)
    tier = RedisTier(own_redis.url, 64 * BLOCK, socket_timeout_s=0.5, connect_timeout_s=0.5)
    s = TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (tier, shared)], tier_retry_s=60)
    try:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["redis"]
        own_redis.pause()  # SIGSTOP: the socket accepts, nothing answers
        t = time.monotonic()
        assert s.get(_k(0)) is None  # one socket timeout, then the read falls through to a miss
        for i in range(4, 8):
            assert s.put(_k(i), _v(i))
        s.flush()  # the write-through copies time out too: the third error detaches the tier
        assert s.lookup([_k(0), _k(7)]).tiers == [None, "cpu"]
        assert s.get(_k(1)) is None
        assert time.monotonic() - t < 5
        st = s.stats().tiers[1]
        assert st.errors >= 1 and not st.available
    finally:
        s.close()
