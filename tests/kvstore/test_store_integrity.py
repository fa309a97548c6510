"""A block read from a tier below the top is verified before it is served or promoted, and so is
one read from a top tier outside this process (disk, Redis): only the cpu tier is trusted.

Bytes are flipped inside a stored block in each lower tier, with that tier's own client (a raw
lmdb write, redis-py SET, boto3 put_object, a stray write into the cpu arena): the read is a
miss, the bad block is gone from that tier, the metric counted it by tier and reason, and a
re-put of the key is accepted (a lookup no longer finds it) and then served.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import pytest

from bench.servers import S3Endpoint
from kvstore.block import encode_block
from kvstore.server.metrics import StoreMetrics
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_kvstore import connect, fetch_one
from tests.fixtures_servers import TEST_BUCKET
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

pytestmark = pytest.mark.timeout(120)

BLOCK = 64 * 1024
KEY, OTHER = b"k-integrity-0000", b"k-integrity-0001"


def _block(key: bytes, seed: int) -> bytes:
    payload = np.random.default_rng(seed).integers(0, 256, BLOCK - 64, dtype=np.uint8)
    return encode_block(key, payload)


def _flip(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF  # inside the payload
    return bytes(bad)


@dataclass
class Case:
    """A store whose block KEY sits in a lower tier, and a way to corrupt it there."""

    store: TieredStore
    metrics: StoreMetrics
    lower: Tier
    corrupt: Callable[[bytes], None]  # overwrite KEY's stored bytes in the lower tier
    reopen: Callable[[], None]  # some corruptions are made while the store is closed


def _fill(store: TieredStore) -> None:
    """KEY then OTHER into a one-block top tier: KEY spills to the lower tier."""
    assert store.put(KEY, _block(KEY, 1)) and store.put(OTHER, _block(OTHER, 2))
    store.flush()
    assert store.lookup([KEY]).tiers[0] != store.levels[0].name


def _open(levels: list[tuple[Tier, LevelOptions]]) -> tuple[TieredStore, StoreMetrics]:
    metrics = StoreMetrics()
    store = TieredStore(levels, observer=metrics)
    metrics.bind(store)
    return store, metrics


@pytest.fixture(params=["disk", "redis", "s3", "cpu"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    kind = request.param
    if kind == "disk":
        path = tmp_path / "lmdb"
        store, _ = _open([(CpuTier(BLOCK), LevelOptions()), (DiskTier(path, 64 * BLOCK), LevelOptions())])
        _fill(store)
        store.close()  # one process may open an lmdb environment once: write it while closed

        def corrupt(bad: bytes) -> None:
            env = lmdb.open(str(path), map_size=1 << 30, subdir=True)
            with env.begin(write=True) as txn:
                txn.put(KEY, bad)
            env.close()

        def reopen() -> None:
            c.store, c.metrics = _open([(CpuTier(BLOCK), LevelOptions()), (DiskTier(path, 64 * BLOCK), LevelOptions())])
            c.lower = c.store.levels[1].tier

        c = Case(store, StoreMetrics(), store.levels[1].tier, corrupt, reopen)
        yield c
        c.store.close()
        return
    if kind == "redis":
        import redis

        url, prefix = request.getfixturevalue("redis_url"), f"t-{uuid.uuid4().hex[:12]}:".encode()
        from tiers.redis import RedisTier

        lower: Tier = RedisTier(url, 64 * BLOCK, prefix=prefix)
        plain = redis.Redis.from_url(url)
        store, metrics = _open([(CpuTier(BLOCK), LevelOptions()), (lower, LevelOptions(shared=True, write_through=True))])
        _fill(store)
        yield Case(store, metrics, lower, lambda bad: plain.set(prefix + KEY, bad), lambda: None)
        plain.delete(prefix + KEY, prefix + OTHER)
        plain.close()
    elif kind == "s3":
        import boto3

        ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
        prefix = f"t-{uuid.uuid4().hex[:12]}/"
        from tiers.s3 import S3Tier

        lower = S3Tier(ep.url, TEST_BUCKET, 64 * BLOCK, prefix=prefix, access_key=ep.access_key,
                       secret_key=ep.secret_key, region=ep.region)  # fmt: skip
        plain = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                             aws_secret_access_key=ep.secret_key, region_name=ep.region)  # fmt: skip
        store, metrics = _open([(CpuTier(BLOCK), LevelOptions()), (lower, LevelOptions(shared=True))])
        _fill(store)
        yield Case(store, metrics, lower,
                   lambda bad: plain.put_object(Bucket=TEST_BUCKET, Key=prefix + KEY.hex(), Body=bad), lambda: None)
        for k in (KEY, OTHER):
            plain.delete_object(Bucket=TEST_BUCKET, Key=prefix + k.hex())
    else:  # cpu below a disk top tier: the cpu tier is verified as any lower tier is
        lower = CpuTier(64 * BLOCK)
        store, metrics = _open([(DiskTier(tmp_path / "top", BLOCK), LevelOptions()), (lower, LevelOptions())])
        _fill(store)

        def stray_write(bad: bytes) -> None:
            run = lower._blocks[KEY]  # a stray write into the arena, as a buggy DMA or pointer would
            assert lower._arena is not None and run.offset >= 0
            lower._arena[run.offset : run.offset + len(bad)] = np.frombuffer(bad, dtype=np.uint8)

        yield Case(store, metrics, lower, stray_write, lambda: None)
    store.close()


def _corrupt_count(m: StoreMetrics, tier: str, reason: str) -> float:
    return m.registry.get_sample_value("tierkv_tier_corrupt_blocks_total", {"tier": tier, "reason": reason}) or 0.0


def test_flipped_bytes_in_a_lower_tier_are_a_miss_then_repaired(case: Case) -> None:
    case.corrupt(_flip(_block(KEY, 1)))
    case.reopen()
    name = case.lower.name
    got: list[bytes] = []
    assert case.store.read(KEY, lambda mv: got.append(bytes(mv))) is None and not got
    assert case.lower.contains_many([KEY]) == [False]  # deleted from that tier
    assert case.store.lookup([KEY]).tiers == [None]  # so a Put is not answered ALREADY_PRESENT
    assert _corrupt_count(case.metrics, name, "checksum") == 1
    assert case.store.get(KEY) is None and _corrupt_count(case.metrics, name, "checksum") == 1  # nothing left to count
    assert case.store.put(KEY, _block(KEY, 1)) is True  # the re-put is accepted
    case.store.flush()
    assert case.store.get(KEY) == _block(KEY, 1)


def test_a_valid_block_of_another_key_is_refused(case: Case) -> None:
    case.corrupt(_block(OTHER, 2))  # intact bytes, wrong key: would serve another request's KV
    case.reopen()
    assert case.store.get(KEY) is None
    assert case.lower.contains_many([KEY]) == [False]
    assert _corrupt_count(case.metrics, case.lower.name, "key") == 1


def test_daemon_answers_a_miss_then_stores_the_reput(tmp_path: Path, redis_url: str) -> None:
    """End to end: a real daemon over a real Redis; the re-put is STORED, not ALREADY_PRESENT."""
    import time
    import urllib.request

    import redis

    from bench.servers import free_port, running_daemon

    tag = uuid.uuid4().hex[:8].encode()
    keys = [b"%s-%07d" % (tag, i) for i in range(8)]
    blocks = [(k, encode_block(k, np.full(64 * 1024, i, dtype=np.float32))) for i, k in enumerate(keys)]
    port = free_port()
    flags = ["--cpu", "1MiB", "--redis", redis_url, "--metrics-port", str(port)]
    plain = redis.Redis.from_url(redis_url)
    with running_daemon(tmp_path, *flags, log_path=tmp_path / "daemon.log") as address, \
            connect(address, deadline_s=30) as c:  # fmt: skip
        assert c.put_many(blocks) == [True] * 8
        deadline = time.monotonic() + 60
        while c.stats().pending_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        key, good = blocks[0]
        assert c.lookup([key]).tiers == ["redis"]  # evicted from the 1 MiB cpu tier
        plain.set(b"tierkv:" + key, _flip(good))
        assert fetch_one(c, key) is None
        assert plain.exists(b"tierkv:" + key) == 0
        assert c.put_many([(key, good)]) == [True]  # STORED
        assert fetch_one(c, key) == good
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'tierkv_tier_corrupt_blocks_total{reason="checksum",tier="redis"} 1.0' in scrape
        c.delete([k for k, _ in blocks])
    plain.close()

@pytest.mark.parametrize("top", ["disk", "redis"])
def test_a_corrupt_block_in_a_top_tier_outside_this_process_is_a_miss_and_deleted(
        top: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:  # fmt: skip
    if top == "disk":
        tier: Tier = DiskTier(tmp_path / "top", 64 * BLOCK)
    else:
        from tiers.redis import RedisTier

        tier = RedisTier(request.getfixturevalue("redis_url"), 64 * BLOCK, prefix=f"t-{uuid.uuid4().hex[:12]}:".encode())
    store, metrics = _open([(tier, LevelOptions())])
    try:
        assert store.put(KEY, _block(KEY, 1)) and store.get(KEY) == _block(KEY, 1)
        tier.put(KEY, _flip(_block(KEY, 1)))  # behind the store's back, as a disk or a peer could
        assert store.get(KEY) is None and _corrupt_count(metrics, tier.name, "checksum") == 1
        assert tier.contains_many([KEY]) == [False] and store.lookup([KEY]).tiers == [None]
        assert store.put(KEY, _block(KEY, 1)) and store.get(KEY) == _block(KEY, 1)  # a fresh copy is served
        store.delete(KEY)
    finally:
        store.close()
