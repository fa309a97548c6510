"""A block corrupted at rest in any tier below the daemon's top never reaches the engine's KV.

Request level, one case per lower tier (disk, redis, s3): the engine offloads a prompt's pages to
an in-process daemon whose small cpu tier spills them down; bytes of one block are then changed
inside the lower tier itself (through the tier, behind the store's back). The same prompt must
give the tokens of a cold run, the daemon must drop the bad block (counted by tier and reason),
and once the engine offloads the recomputed page again the next identical request loads every
page from the daemon.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.server.daemon import Daemon
from kvstore.store.signed_tier import SignedTier
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, served
from tests.fixtures_servers import TEST_BUCKET

pytestmark = pytest.mark.timeout(300)
PAGES = 7  # loadable pages of a 120-token prompt (16-token pages, the last token always computed)


@pytest.fixture(params=["disk", "redis", "s3"])
def daemon_with_lower(request: pytest.FixtureRequest, tmp_path: Path, tiny) -> Iterator[tuple[Daemon, str]]:
    kind = request.param
    block = make_engine(tiny, num_pages=8).pool.bytes_per_page + 4096  # payload + header, rounded up
    flags = ["--cpu", str(2 * block)]
    env: dict[str, str] = {}
    if kind == "disk":
        flags += ["--disk", f"{tmp_path / 'disk'}:64MiB"]
    elif kind == "redis":
        flags += ["--redis", request.getfixturevalue("redis_url"), "--redis-capacity", "64MiB"]
    else:
        ep = request.getfixturevalue("s3_endpoint")
        flags += ["--s3", f"s3://{TEST_BUCKET}/c-{uuid.uuid4().hex[:10]}", "--s3-endpoint", ep.url,
                  "--s3-capacity", "64MiB"]
        env.update(AWS_ACCESS_KEY_ID=ep.access_key, AWS_SECRET_ACCESS_KEY=ep.secret_key,
                   AWS_DEFAULT_REGION=ep.region)
    with served(tmp_path, *flags, env=env) as d:
        yield d, kind


def _corrupt_in_tier(daemon: Daemon, kind: str, key: bytes) -> None:
    """Overwrite ``key``'s stored block inside the lower tier with one flipped payload byte. Redis and
    S3 values are changed in the server itself, under the daemon's SignedTier: written through it,
    the bad bytes would be signed as the daemon's own, which no daemon does (it signs only blocks
    it verified), and the MAC is the daemon's one check of what it reads from Redis and S3."""
    (level,) = [lv for lv in daemon.store.levels if lv.name == kind]
    tier = level.tier.inner if isinstance(level.tier, SignedTier) else level.tier
    good = bytes(tier.get(key))
    bad = bytearray(good)
    bad[-100] ^= 0xFF
    tier.delete(key)
    tier.put(key, bytes(bad))
    assert bytes(tier.get(key)) != good


def test_block_corrupted_in_a_lower_tier_is_recomputed_dropped_and_repaired(tiny, daemon_with_lower) -> None:
    daemon, kind = daemon_with_lower
    ids = prompt(120, seed=11)
    want = run(make_engine(tiny), ids).output_ids
    eng = make_engine(tiny)
    conn = attach(eng, daemon.address)
    try:
        run(eng, ids)
        eng.radix.evict(eng.pool.num_pages)  # offload every page
        assert conn.flush(60)
        assert daemon.store.flush(60)
        keys = conn.keyspace.keys(ids, None)[:PAGES]
        with connect(daemon) as c:
            tiers = c.lookup(keys).tiers
        assert tiers[2] == kind, tiers  # the small cpu tier spilled the early pages down
        _corrupt_in_tier(daemon, kind, keys[2])

        got = run(eng, ids)
        assert got.output_ids == want  # never a wrong token
        assert got.cached_tokens == 32  # pages 0-1 loaded; page 2 was dropped by the daemon
        corrupt = daemon.metrics.registry.get_sample_value("tierkv_tier_corrupt_blocks_total",
                                                           {"tier": kind, "reason": "checksum"})
        assert corrupt == 1
        with connect(daemon) as c:
            assert c.lookup([keys[2]]).tiers == [None]  # the bad block is gone from every tier
        eng.radix.evict(eng.pool.num_pages)  # the recomputed page is offloaded again
        assert conn.flush(60)
        again = run(eng, ids)
        assert again.output_ids == want
        assert again.cached_tokens == PAGES * 16  # every page from the daemon, the repaired one included
        eng.radix.check_integrity()
        eng.pool.allocator.check_integrity()
    finally:
        detach(eng)
