"""Blocks in Redis and S3 carry the cluster's MAC; what fails it is never served, is deleted, is counted.

The store is built from a StoreConfig by the daemon's own factory (kvstore/store/tier_factory.py),
over a real redis-server and a real SeaweedFS. Forged values are written straight into the server
with its own client, as anyone who can reach it could: a well-formed block with a valid checksum
and no MAC, one signed with a secret the daemon does not hold, one with a forged tag. Rotation:
a block signed with the previous secret is served while that secret is listed, refused after.
A daemon process over each server is checked the same way through the gRPC client.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.servers import S3Endpoint
from kvstore.block import encode_block
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.server.metrics import StoreMetrics
from kvstore.store.tier_factory import build_store
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_servers import TEST_BUCKET
from tiers.mac import TRAILER_BYTES, BlockMac

pytestmark = pytest.mark.timeout(180)

BLOCK = 64 * 1024
MAX_BLOCK = 1 << 20
SECRETS = {name: name[0].encode() * 43 for name in ("old", "new", "other")}


def _block(key: bytes, seed: int = 1) -> bytes:
    return encode_block(key, np.random.default_rng(seed).integers(0, 256, BLOCK - 128, dtype=np.uint8))


@dataclass
class Server:
    """One shared tier's server: its TierConfig, and raw access to what it stores under a key."""

    kind: str
    tier: TierConfig
    raw_get: Callable[[bytes], bytes | None]
    raw_set: Callable[[bytes, bytes], None]

    def holds(self, key: bytes) -> bool:
        return self.raw_get(key) is not None


@pytest.fixture(params=["redis", "s3"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    if request.param == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        plain = redis.Redis.from_url(url)
        yield Server("redis", TierConfig("redis", 64 << 20, url=url, shared=True, write_through=True),
                     lambda k: plain.get(b"tierkv:" + k), lambda k, v: plain.set(b"tierkv:" + k, v))  # fmt: skip
        for k in plain.scan_iter(match=b"tierkv:sig-*"):
            plain.delete(k)
        plain.close()
        return
    import boto3
    import botocore.exceptions

    ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
    prefix = f"signed-{uuid.uuid4().hex[:12]}/"
    plain = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                         aws_secret_access_key=ep.secret_key, region_name=ep.region)  # fmt: skip

    def raw_get(k: bytes) -> bytes | None:
        try:
            return plain.get_object(Bucket=TEST_BUCKET, Key=prefix + k.hex())["Body"].read()
        except botocore.exceptions.ClientError:
            return None

    yield Server("s3", TierConfig("s3", 64 << 20, url=f"s3://{TEST_BUCKET}/{prefix}", endpoint=ep.url,
                                  region=ep.region, access_key_id=ep.access_key, secret_access_key=ep.secret_key,
                                  shared=True, write_through=True),
                 raw_get, lambda k, v: plain.put_object(Bucket=TEST_BUCKET, Key=prefix + k.hex(), Body=v))  # fmt: skip
    for obj in plain.list_objects_v2(Bucket=TEST_BUCKET, Prefix=prefix).get("Contents", []):
        plain.delete_object(Bucket=TEST_BUCKET, Key=obj["Key"])


@pytest.fixture
def secret_files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, secret in SECRETS.items():
        out[name] = tmp_path / f"{name}.secret"
        out[name].write_bytes(secret + b"\n")
    return out


def _open(server: Server, current: Path, previous: tuple[Path, ...] = ()) -> tuple[TieredStore, StoreMetrics]:
    cfg = StoreConfig(tiers=(TierConfig("cpu", BLOCK), server.tier), mac_secret_file=str(current),
                      mac_previous_secret_files=",".join(map(str, previous)), max_block_bytes=MAX_BLOCK)  # fmt: skip
    metrics = StoreMetrics()
    store = build_store(cfg, observer=metrics)
    metrics.bind(store)
    return store, metrics


def _refused(m: StoreMetrics, tier: str, reason: str) -> float:
    return m.registry.get_sample_value("tierkv_tier_corrupt_blocks_total", {"tier": tier, "reason": reason}) or 0.0


def _key() -> bytes:
    return b"sig-" + uuid.uuid4().hex[:12].encode()


def test_own_blocks_are_signed_and_round_trip(server: Server, secret_files: dict[str, Path]) -> None:
    keys = [_key() for _ in range(4)]
    store, metrics = _open(server, secret_files["new"])
    try:
        for i, k in enumerate(keys):
            assert store.put(k, _block(k, i))
        assert store.flush(timeout=60)
        assert store.lookup(keys[:1]).tiers == [server.kind]  # evicted from the one-block cpu tier
        assert [store.get(k) for k in keys] == [_block(k, i) for i, k in enumerate(keys)]
        stored = server.raw_get(keys[0])
        assert stored is not None and len(stored) == len(_block(keys[0], 0)) + TRAILER_BYTES  # block, trailer
        assert BlockMac(SECRETS["new"]).open(keys[0], stored) == (memoryview(_block(keys[0], 0)), None)
        assert _refused(metrics, server.kind, "unsigned") == 0
    finally:
        store.close()


FORGERIES = {
    "unsigned": lambda key: _block(key),  # a valid xxh3 checksum, and no MAC
    "unknown_secret": lambda key: BlockMac(SECRETS["other"]).seal(key, _block(key)),
    "mac": lambda key: BlockMac(SECRETS["new"]).seal(key, _block(key))[:-8] + b"\0" * 8,  # the right id, a forged tag
}


@pytest.mark.parametrize("reason", FORGERIES)
def test_a_forged_block_is_never_served_and_is_deleted(server: Server, secret_files: dict[str, Path],
                                                       reason: str) -> None:  # fmt: skip
    key = _key()
    server.raw_set(key, FORGERIES[reason](key))
    store, metrics = _open(server, secret_files["new"])
    try:
        assert store.lookup([key]).tiers == [server.kind]  # it is there, and looks like a block
        got: list[bytes] = []
        assert store.read(key, lambda mv: got.append(bytes(mv))) is None and got == []
        assert not server.holds(key), "the forged value is still on the server"
        assert _refused(metrics, server.kind, reason) == 1
        assert store.lookup([key]).tiers == [None]
        assert store.put(key, _block(key)) and store.flush(timeout=60)  # the genuine block replaces it
        assert store.get(key) == _block(key)
    finally:
        store.close()


def test_a_damaged_signed_block_counts_as_damaged(server: Server, secret_files: dict[str, Path]) -> None:
    """A bit flipped at rest fails the MAC too; the reason says it is damage, not a forgery."""
    key = _key()
    bad = bytearray(BlockMac(SECRETS["new"]).seal(key, _block(key)))
    bad[BLOCK // 2] ^= 0xFF
    server.raw_set(key, bytes(bad))
    store, metrics = _open(server, secret_files["new"])
    try:
        assert store.get(key) is None and not server.holds(key)
        assert _refused(metrics, server.kind, "checksum") == 1 and _refused(metrics, server.kind, "mac") == 0
    finally:
        store.close()


def test_rotation_previous_secret_accepted_while_listed_then_refused(server: Server,
                                                                    secret_files: dict[str, Path]) -> None:  # fmt: skip
    keys = [_key(), _key()]
    store, _ = _open(server, secret_files["old"])  # a daemon that still signs with the old secret
    for k in keys:
        assert store.put(k, _block(k))
    assert store.flush(timeout=60)
    store.close()
    store, metrics = _open(server, secret_files["new"], (secret_files["old"],))  # mid-rotation
    try:
        assert store.get(keys[0]) == _block(keys[0])
        assert _refused(metrics, server.kind, "unknown_secret") == 0
    finally:
        store.close()
    store, metrics = _open(server, secret_files["new"])  # the old secret dropped
    try:
        assert store.get(keys[1]) is None and not server.holds(keys[1])
        assert _refused(metrics, server.kind, "unknown_secret") == 1
    finally:
        store.close()


def test_a_value_over_the_largest_block_is_refused_and_left(server: Server, secret_files: dict[str, Path]) -> None:
    key = _key()
    server.raw_set(key, b"z" * (MAX_BLOCK + TRAILER_BYTES + 1))
    store, metrics = _open(server, secret_files["new"])
    try:
        assert store.get(key) is None
        assert _refused(metrics, server.kind, "size") == 1
        assert server.holds(key)  # maybe a daemon allowed larger blocks: a re-put of the key replaces it
    finally:
        store.close()


@pytest.mark.parametrize("reason", FORGERIES)
def test_a_forgery_over_the_only_tier_leaves_the_index_so_the_reput_is_stored(
        server: Server, secret_files: dict[str, Path], reason: str) -> None:  # fmt: skip
    """Redis or S3 as the only tier, so the top: the store's own block overwritten in the server
    by a forgery is a miss, deleted, counted, and dropped from the store's index. Kept there, a
    lookup still found the key and the genuine re-put was answered ALREADY_PRESENT until a restart."""
    key = _key()
    cfg = StoreConfig(tiers=(server.tier,), mac_secret_file=str(secret_files["new"]), max_block_bytes=MAX_BLOCK)
    metrics = StoreMetrics()
    store = build_store(cfg, observer=metrics)
    metrics.bind(store)
    try:
        assert store.put(key, _block(key)) and store.get(key) == _block(key)
        assert key in store.levels[0].index
        server.raw_set(key, FORGERIES[reason](key))  # behind the store's back
        assert store.get(key) is None and not server.holds(key)
        assert _refused(metrics, server.kind, reason) == 1
        assert key not in store.levels[0].index and store.lookup([key]).tiers == [None]
        assert store.put(key, _block(key))  # STORED, not ALREADY_PRESENT
        assert store.get(key) == _block(key) and _refused(metrics, server.kind, reason) == 1
    finally:
        store.close()
