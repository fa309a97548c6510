"""The circuit breaker of a tier, on a TieredStore over a real redis-server that dies and comes back.

Why: a dead shared tier must cost a few errors, not a timeout per request (detach), must not be
given up for good (probe, attach), and one transient error must not detach it (consecutive
errors, or an error rate over the last calls: tests/kvstore/test_store_limits.py).
A misconfigured tier still stops the store at start; an unreachable one starts detached.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from bench.servers import RedisServer
from kvstore.block import encode_block
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.store.breaker import Breaker, BreakerPolicy
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tier_factory import build_store
from kvstore.store.tiered_store import TieredStore
from tests.kvstore.faults_support import wait_for
from tiers.cpu import CpuTier
from tiers.errors import TierAuthError
from tiers.redis import RedisTier

pytestmark = pytest.mark.timeout(120)

BLOCK = 16 * 1024
SHARED = LevelOptions(shared=True, write_through=True)


def _k(i: int) -> bytes:
    return b"brk-%012d" % i


def _v(i: int) -> bytes:
    return encode_block(_k(i), np.full(BLOCK // 4 - 16, i, np.float32))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def _store(url: str, **kw: object) -> TieredStore:
    tier = RedisTier(url, 64 * BLOCK, socket_timeout_s=1.0, connect_timeout_s=0.5, connect=False)
    return TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (tier, SHARED)], **kw)  # type: ignore[arg-type]


def _redis(s: TieredStore):  # noqa: ANN202
    return s.stats().tiers[1]


def test_detached_after_consecutive_errors_then_probed_back(own_redis: RedisServer) -> None:
    with _store(own_redis.url, tier_retry_s=0.1) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        own_redis.stop()
        assert s.get(_k(0)) is None and _redis(s).errors == 1  # asked once (not again as a shared tier)
        for i in range(1, 4):  # k0, k1 live only in redis now: each read asks it, until it is detached
            assert s.get(_k(i % 2)) is None
        st = _redis(s)
        assert not st.available and st.detaches == 1 and st.errors == 3
        for i in range(4, 8):  # detached: reads skip it (no new errors), writes to it are skipped and counted
            assert s.put(_k(i), _v(i))
            assert s.get(_k(0)) is None
        s.flush()
        st = _redis(s)
        assert st.errors == 3 and st.skipped_writes >= 4 and "cannot reach" in st.last_error
        assert s.lookup([_k(0), _k(7)]).tiers == [None, "cpu"]
        assert s.delete(_k(1)) and _redis(s).errors == 3  # forgotten here; the detached tier is not asked
        own_redis.start()  # back, empty: the prober attaches it
        wait_for(lambda: _redis(s).available, "the prober to attach redis")
        assert _redis(s).attaches == 1
        assert s.put(_k(9), _v(9))
        s.flush()
        raw = redis.Redis.from_url(own_redis.url)
        assert raw.get(b"tierkv:" + _k(9)) == _v(9)  # writes reach it again
        raw.close()
        assert s.get(_k(0)) is None and _redis(s).available  # lost with the restart: a miss, no error


def test_a_success_between_errors_ends_their_run(own_redis: RedisServer) -> None:
    """Error, error, success, three times: never three in a row, and 9 calls are fewer than the
    error rate's min_calls (10), so the tier stays. A tier that goes on failing at that rate is
    detached (tests/kvstore/test_store_limits.py)."""
    with _store(own_redis.url, tier_retry_s=60.0) as s:
        s.put(_k(0), _v(0))
        s.flush()
        for _ in range(3):  # error, error, success: never three in a row
            own_redis.stop()
            assert s.get(_k(1)) is None
            assert s.get(_k(2)) is None
            own_redis.start()
            assert s.get(_k(3)) is None  # answered: a miss
        st = _redis(s)
        assert st.available and st.errors == 6 and st.detaches == 0


def test_a_failed_read_is_not_a_lost_block(own_redis: RedisServer) -> None:
    """A private tier's index forgets a block the tier says it lost, not one it failed to read."""
    tier = RedisTier(own_redis.url, 64 * BLOCK, socket_timeout_s=0.5, prefix=b"private:")
    with TieredStore([(CpuTier(2 * BLOCK), LevelOptions()), (tier, LevelOptions())], tier_retry_s=60.0) as s:
        for i in range(3):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["redis"]
        own_redis.pause()
        try:
            assert s.get(_k(0)) is None  # a timeout: a miss this time
        finally:
            own_redis.resume()
        assert s.get(_k(0)) == _v(0) and _redis(s).errors == 1


def test_probe_backoff_doubles_up_to_the_cap() -> None:
    b = Breaker(BreakerPolicy(failures=2, probe_s=1.0, probe_max_s=4.0))
    assert not b.failed() and b.attached
    t0 = time.monotonic()
    assert b.failed() and not b.attached
    assert t0 + 1.0 <= b.next_probe <= time.monotonic() + 1.0
    waits = [b.wait_s]
    for _ in range(3):
        b.probe_failed()
        waits.append(b.wait_s)
    assert waits == [1.0, 2.0, 4.0, 4.0] and b.next_probe > time.monotonic() + 3.0
    b.attach()
    assert b.attached and not b.failed()  # the count starts again


def test_unreachable_at_start_is_detached_but_bad_credentials_stop_the_store(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    server = RedisServer(tmp_path / "a", password="right", start=False)
    cfg = StoreConfig(tiers=(TierConfig("cpu", 1 << 20),
                             TierConfig("redis", 1 << 20, url=server.url, shared=True)), tier_retry_s=0.1)  # fmt: skip
    with build_store(cfg) as s:  # the server does not exist yet: the store starts degraded
        st = _redis(s)
        assert not st.available and st.detaches == 1 and "cannot reach" in st.last_error
        server.start()
        try:
            wait_for(lambda: _redis(s).available, "redis to be attached once it answers")
        finally:
            server.stop()
    wrong = server.url.replace(":right@", ":wrong@")
    server.start()
    try:
        bad = StoreConfig(tiers=(TierConfig("cpu", 1 << 20), TierConfig("redis", 1 << 20, url=wrong, shared=True)))
        with pytest.raises(TierAuthError, match="authentication failed"):
            build_store(bad)
    finally:
        server.stop()


# -- the error rate: a success between errors does not reset it ------------------------------


def test_a_breaker_opens_on_an_error_rate_and_one_success_does_not_reset_it() -> None:
    b = Breaker(BreakerPolicy(failures=3, window=20, rate=0.5, min_calls=10))
    outcomes = []
    for i in range(40):  # every other call fails: never three errors in a row
        if i % 2:
            b.succeeded()
        elif b.failed():
            outcomes.append(i)
            break
    assert outcomes == [10] and not b.attached and b.why == "6 errors in its last 11 calls"
    b.attach()
    quiet = Breaker(BreakerPolicy(failures=3, window=20, rate=0.5, min_calls=10))
    for i in range(200):  # one error in ten calls: the tier stays
        if i % 10:
            quiet.succeeded()
        else:
            assert not quiet.failed()
    assert quiet.attached


def test_a_tier_failing_half_its_calls_is_detached(own_redis: RedisServer) -> None:
    """A redis-server that is down for every other read: never three errors in a row, so only
    the error rate over its last calls can detach it, and it does."""
    tier = RedisTier(own_redis.url, 64 * BLOCK, socket_timeout_s=1.0, connect_timeout_s=0.5, prefix=b"half:")
    policy = BreakerPolicy(failures=3, probe_s=60.0, probe_max_s=60.0, window=8, rate=0.5, min_calls=6)
    with TieredStore([(CpuTier(2 * BLOCK, shared=False), LevelOptions()), (tier, LevelOptions(shared=True))],
                     breaker=policy) as s:  # fmt: skip
        for i in range(8):
            if i % 2:
                own_redis.start()
            else:
                own_redis.stop()
            assert s.get(_k(100 + i)) is None  # asks redis: an error while it is down, else a miss
            if not s.stats().tiers[1].available:
                break
        st = s.stats().tiers[1]
        assert not st.available and st.detaches == 1 and st.errors == 4  # calls 0, 2, 4, 6: 4 of the last 7
