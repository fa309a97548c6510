"""Remote tiers fail fast: a stopped, hung or absent server is TierUnavailable within seconds.

Why: the store must fall through to the next tier (or recompute) when a shared tier dies; a
call that hangs for a minute freezes the engine, the top complaint about remote KV caches.
Each test runs its own server instance so the session fixtures used elsewhere survive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.servers import RedisServer, SeaweedS3, free_port, prepare_bucket, redis_cluster
from tiers.base import Tier
from tiers.errors import TierUnavailable
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.timeout(90)

FAST_S = 5.0  # generous bound for "fails fast" on a loaded 2-core CI machine


def assert_fails_fast(op: Callable[[], object], within_s: float = FAST_S) -> None:
    start = time.monotonic()
    with pytest.raises(TierUnavailable):
        op()
    assert time.monotonic() - start < within_s


def assert_every_op_unavailable(tier: Tier) -> None:
    assert_fails_fast(lambda: tier.get(b"k"))
    assert_fails_fast(lambda: tier.put(b"k2", b"v" * 1000))
    assert_fails_fast(lambda: tier.contains_many([b"k", b"k2"]))
    assert_fails_fast(lambda: tier.delete(b"k"))
    assert_fails_fast(lambda: list(tier.scan()))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def test_redis_stopped_mid_run(own_redis: RedisServer) -> None:
    tier = RedisTier(own_redis.url, 64 << 20, socket_timeout_s=1.0)
    tier.put(b"k", b"v" * 1000)
    assert tier.get(b"k") == b"v" * 1000
    own_redis.stop()
    assert_every_op_unavailable(tier)
    tier.close()


def test_redis_hung_server_times_out(own_redis: RedisServer) -> None:
    tier = RedisTier(own_redis.url, 64 << 20, socket_timeout_s=0.5)
    tier.put(b"k", b"v")
    own_redis.pause()  # SIGSTOP: connections stay open, nothing answers
    assert_fails_fast(lambda: tier.get(b"k"), within_s=3.0)
    tier.close()


def test_redis_absent_at_start() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_fails_fast(lambda: RedisTier(url, 1 << 20))


def test_redis_cluster_stopped_mid_run() -> None:
    with redis_cluster(nodes=3) as urls:
        tier = RedisTier(urls[0], 64 << 20, cluster=True, socket_timeout_s=1.0)
        for i in range(30):  # spread over all nodes
            tier.put(b"k%d" % i, b"v")
        assert [tier.get(b"k%d" % i) for i in range(30)] == [b"v"] * 30
        assert tier.contains_many([b"k%d" % i for i in range(30)]) == [True] * 30
    # Leaving the context stopped every node.
    assert_every_op_unavailable(tier)
    tier.close()


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path)
    yield server
    server.stop()


def test_s3_stopped_mid_run(own_s3: SeaweedS3) -> None:
    ep = own_s3.endpoint
    prepare_bucket(ep, "tierkv-failures")
    creds = dict(access_key=ep.access_key, secret_key=ep.secret_key)
    tier = S3Tier(ep.url, "tierkv-failures", 64 << 20, read_timeout_s=1.0, **creds)
    tier.put(b"k", b"v" * 1000)
    assert tier.get(b"k") == b"v" * 1000
    own_s3.stop()
    assert_every_op_unavailable(tier)
    tier.close()


def test_s3_absent_at_start() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_fails_fast(lambda: S3Tier(url, "tierkv-none", 1 << 20, access_key="a", secret_key="b"))


def test_missing_server_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import servers

    monkeypatch.setattr(servers.shutil, "which", lambda *a, **k: None)
    with pytest.raises(servers.ServerError, match="redis-server not found"), servers.redis_server():
        pass
    with pytest.raises(servers.ServerError, match="weed not found"), servers.seaweedfs_s3():
        pass


def test_s3_probe_connects_before_it_asks_and_answers_once_the_endpoint_does(
        s3_endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached S3 tier's probe first checks with a TCP connect (tiers/reach.py, which sees a
    healed link within 0.1 s instead of at the kernel's 1 s SYN resend): while nothing answers it
    fails without a request to the endpoint; once the connect answers, the HEAD decides."""
    import tiers.s3 as s3mod
    from tiers.reach import Reach

    ep = s3_endpoint
    prepare_bucket(ep, "tierkv-probe")
    tier = S3Tier(ep.url, "tierkv-probe", 1 << 20, access_key=ep.access_key, secret_key=ep.secret_key)
    asked: list[tuple[str, int]] = []

    def cut(addresses, timeout_s):  # noqa: ANN001, ANN202 - any_reachable's signature
        asked.extend(addresses)
        return Reach(False, True)

    monkeypatch.setattr(s3mod, "any_reachable", cut)
    with pytest.raises(TierUnavailable, match="no answer to a connect"):
        tier.probe()
    host, port = ep.url.split("//")[1].split(":")
    assert asked == [(host, int(port))]
    monkeypatch.undo()
    tier.probe()  # the real check answers: the HEAD of the bucket succeeds
    tier.close()
