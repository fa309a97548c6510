"""Reads from Redis and S3 are bounded: a value longer than ``max_value_bytes`` is refused before it
is read (StoredValueTooLarge), on a real redis-server and a real SeaweedFS.

Whoever can write to the shared server chooses what is stored there; without the bound a GET of a
512 MiB value is 512 MiB in the daemon. The proof that the value was not read whole is the peak of
Python's allocations during the refused ``get`` (tracemalloc): a plain read allocates the whole value.
"""

from __future__ import annotations

import tracemalloc
import uuid
from collections.abc import Callable, Iterator

import pytest

from bench.servers import S3Endpoint
from tests.fixtures_servers import TEST_BUCKET
from tiers.base import Tier
from tiers.errors import StoredValueTooLarge

pytestmark = pytest.mark.timeout(180)

LIMIT = 1 << 20
HUGE = 32 << 20
KEY, EXACT, ABSENT = b"k-bounded-000001", b"k-bounded-000002", b"k-bounded-000003"
Write = Callable[[bytes, bytes], None]


@pytest.fixture(params=["redis", "s3"])
def bounded(request: pytest.FixtureRequest) -> Iterator[tuple[Tier, Write]]:
    """A tier reading at most LIMIT bytes, and a raw write into its server (as anyone could)."""
    tag = uuid.uuid4().hex[:12]
    if request.param == "redis":
        import redis

        from tiers.redis import RedisTier

        url = request.getfixturevalue("redis_url")
        prefix = f"t-{tag}:".encode()
        tier: Tier = RedisTier(url, 64 << 20, prefix=prefix, max_value_bytes=LIMIT)
        plain = redis.Redis.from_url(url)
        yield tier, lambda k, v: plain.set(prefix + k, v)
        plain.delete(*(prefix + k for k in (KEY, EXACT)))
        plain.close()
    else:
        import boto3

        from tiers.s3 import S3Tier

        ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
        prefix = f"t-{tag}/"
        tier = S3Tier(ep.url, TEST_BUCKET, 64 << 20, prefix=prefix, access_key=ep.access_key,
                      secret_key=ep.secret_key, region=ep.region, max_value_bytes=LIMIT)  # fmt: skip
        plain = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                             aws_secret_access_key=ep.secret_key, region_name=ep.region)  # fmt: skip
        yield tier, lambda k, v: plain.put_object(Bucket=TEST_BUCKET, Key=prefix + k.hex(), Body=v)
        for k in (KEY, EXACT):
            plain.delete_object(Bucket=TEST_BUCKET, Key=prefix + k.hex())
    tier.close()


def test_a_value_over_the_bound_is_refused_unread(bounded: tuple[Tier, Write]) -> None:
    tier, write = bounded
    write(KEY, b"x" * HUGE)
    tracemalloc.start()
    try:
        with pytest.raises(StoredValueTooLarge, match=f"over {LIMIT} bytes"):
            tier.get(KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < HUGE // 4, f"the refused read allocated {peak} bytes: the value was read"
    assert tier.contains_many([KEY]) == [True]  # refused, not deleted: the tier only reads


def test_values_up_to_the_bound_and_misses_are_served_as_before(bounded: tuple[Tier, Write]) -> None:
    tier, write = bounded
    write(EXACT, b"y" * LIMIT)
    assert tier.get(EXACT) == b"y" * LIMIT
    assert tier.get(ABSENT) is None
