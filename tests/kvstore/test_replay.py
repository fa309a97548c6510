"""Writes skipped while a shared tier was detached are replayed once it is attached again, and a
request that wants a detached tier brings its probe forward (issue #25, bench.cluster's
node_partitioned fault: the blocks a node put while cut off never reached Redis/S3 after the heal,
and the prober's backoff found the healed link seconds late).

On a TieredStore over a real redis-server that is not running yet (the store starts with it
detached) and is started mid-test; the replay is checked in the server itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from bench.servers import RedisServer
from kvstore.block import encode_block
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from kvstore.store.breaker import Breaker, BreakerPolicy
from kvstore.store.replay import Backlog
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tier_factory import build_store
from kvstore.store.tiered_store import TieredStore
from tests.kvstore.faults_support import wait_for
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.errors import ConfigError
from tiers.redis import RedisTier

pytestmark = pytest.mark.timeout(120)

BLOCK = 16 * 1024
SHARED = LevelOptions(shared=True, write_through=True)
HOUR = BreakerPolicy(probe_s=3600.0, probe_max_s=3600.0)  # no probe within any test but one a request brings forward
PREFIX = b"tierkv:"


def _k(i: int) -> bytes:
    return b"rpl-%012d" % i


def _v(i: int) -> bytes:
    return encode_block(_k(i), np.full(BLOCK // 4 - 16, i, np.float32))


@pytest.fixture
def down_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server whose URL exists but which is not running until the test starts it."""
    server = RedisServer(tmp_path, start=False)
    yield server
    server.stop()


def _redis_tier(url: str) -> RedisTier:
    return RedisTier(url, 64 * BLOCK, socket_timeout_s=1.0, connect_timeout_s=0.5, connect=False)


def _store(url: str, cpu_blocks: int = 8, **kw: object) -> TieredStore:
    kw.setdefault("tier_retry_s", 0.1)
    return TieredStore([(CpuTier(cpu_blocks * BLOCK), LevelOptions()), (_redis_tier(url), SHARED)],
                       **kw)  # type: ignore[arg-type]


def _held(url: str, keys: list[int]) -> list[int]:
    """Which of ``keys`` the server holds, with the bytes put."""
    raw = redis.Redis.from_url(url)
    try:
        return [i for i in keys if raw.get(PREFIX + _k(i)) == _v(i)]
    finally:
        raw.close()


def _attached(s: TieredStore, server: RedisServer) -> None:
    server.start()
    wait_for(lambda: s.stats().tiers[1].available, "the prober to attach redis")
    assert s.flush(60.0)  # the replay was queued as redis was attached


# -- the replay ----------------------------------------------------------------------------------


def test_a_block_put_while_the_shared_tier_was_detached_is_written_there_once_it_is_back(
        down_redis: RedisServer) -> None:
    with _store(down_redis.url) as s:
        assert not s.stats().tiers[1].available
        for i in range(3):
            assert s.put(_k(i), _v(i))  # lands in cpu; its write-through to redis is skipped
        s.flush()
        st = s.stats().tiers[1]
        assert st.skipped_writes == 3 and st.replayed == 0
        _attached(s, down_redis)
        assert _held(down_redis.url, [0, 1, 2]) == [0, 1, 2]  # another node finds them there now
        st = s.stats().tiers[1]
        assert st.replayed == 3 and st.replay_dropped == 0 and st.replay_skipped == 0 and st.blocks == 3
        assert s.lookup([_k(0)]).tiers == ["cpu"] and s.get(_k(2)) == _v(2)
        s.put(_k(3), _v(3))  # attached: written through as before, nothing more replayed
        s.flush()
        assert _held(down_redis.url, [3]) == [3] and s.stats().tiers[1].replayed == 3


def _up_then_down(s: TieredStore, server: RedisServer, clean: list[int], dirty: list[int]) -> None:
    """``clean`` put while redis answers (written through), then redis stopped and ``dirty`` put:
    their write-throughs fail, and the third failure detaches redis (no write is *skipped*)."""
    wait_for(lambda: s.stats().tiers[1].available, "the store to attach redis")
    for i in clean:
        s.put(_k(i), _v(i))
    assert s.flush(30.0) and _held(server.url, clean) == clean
    server.stop()
    for i in dirty:
        s.put(_k(i), _v(i))
        assert s.flush(30.0)
    st = s.stats().tiers[1]
    assert not st.available and st.errors >= 3 and st.skipped_writes == 0, st


def test_writes_that_failed_as_the_tier_went_down_are_replayed_too(down_redis: RedisServer) -> None:
    """The errors that detach a tier are writes that never reached it: replayed like skipped ones."""
    down_redis.start()
    with _store(down_redis.url) as s:
        _up_then_down(s, down_redis, [9], [0, 1, 2])
        _attached(s, down_redis)
        assert _held(down_redis.url, [0, 1, 2]) == [0, 1, 2]
        assert s.stats().tiers[1].replayed == 3


def test_a_block_waiting_for_its_replay_is_evicted_after_the_others(down_redis: RedisServer) -> None:
    """The cpu tier is full of two blocks redis holds and three it does not (their write-throughs
    failed), the latter least recently used: two more puts evict the two redis holds, so all five
    unreplicated blocks are still there to replay (evicted, they would have had nowhere to go)."""
    down_redis.start()
    with _store(down_redis.url, cpu_blocks=5) as s:
        _up_then_down(s, down_redis, [0, 1], [2, 3, 4])
        assert s.get(_k(0)) == _v(0) and s.get(_k(1)) == _v(1)  # the clean ones used last
        for i in (5, 6):
            s.put(_k(i), _v(i))
        assert s.flush(30.0)
        assert [s.lookup([_k(i)]).tiers[0] for i in range(7)] == [None, None, *["cpu"] * 5]
        _attached(s, down_redis)
        assert _held(down_redis.url, list(range(2, 7))) == [2, 3, 4, 5, 6]
        st = s.stats().tiers[1]
        assert st.replayed == 5 and st.replay_skipped == 0


def test_a_full_backlog_drops_the_oldest_key_and_counts_it(down_redis: RedisServer) -> None:
    with _store(down_redis.url, replay_backlog_keys=2) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        assert s.stats().tiers[1].replay_dropped == 2
        _attached(s, down_redis)
        assert _held(down_redis.url, [0, 1, 2, 3]) == [2, 3]  # the two newest
        st = s.stats().tiers[1]
        assert st.replayed == 2 and st.replay_dropped == 2


def test_no_backlog_replays_nothing(down_redis: RedisServer) -> None:
    with _store(down_redis.url, replay_backlog_keys=0) as s:
        s.put(_k(0), _v(0))
        _attached(s, down_redis)
        assert _held(down_redis.url, [0]) == []
        st = s.stats().tiers[1]
        assert st.skipped_writes == 1 and st.replayed == st.replay_dropped == st.replay_skipped == 0


def test_a_key_deleted_or_lost_while_detached_is_not_replayed(down_redis: RedisServer) -> None:
    """Deleted, or evicted from the cpu tier with nowhere to go (redis, below it, was detached) and
    not parked (``replay_park_bytes=0``): held nowhere, so there is nothing to replay; the blocks
    still held are replayed."""
    with _store(down_redis.url, cpu_blocks=3, replay_park_bytes=0) as s:
        for i in range(5):  # the cpu tier holds 3: blocks 0 and 1 are evicted, and dropped
            s.put(_k(i), _v(i))
        s.flush()
        assert s.delete(_k(2))
        assert [s.lookup([_k(i)]).tiers[0] for i in range(5)] == [None, None, None, "cpu", "cpu"]
        _attached(s, down_redis)
        assert _held(down_redis.url, list(range(5))) == [3, 4]
        st = s.stats().tiers[1]
        assert st.replayed == 2 and st.replay_skipped == 3


def test_a_block_evicted_with_nowhere_to_land_is_parked_for_the_replay(down_redis: RedisServer) -> None:
    """bench.cluster's node_partitioned: cut off, a node puts more than its cpu tier holds, every
    block unreplicated, so the oldest are evicted anyway while redis, below, is detached. Room for
    two is parked (readable meanwhile, held: a second put stores nothing); the oldest past that is
    dropped, a deleted one let go; once redis is back the parked ones are written there and let go."""
    size = len(_v(0))
    with _store(down_redis.url, cpu_blocks=3, replay_park_bytes=2 * size) as s:
        for i in range(6):  # the cpu tier holds 3: blocks 0, 1, 2 evicted; 1 and 2 parked, 0 dropped
            s.put(_k(i), _v(i))
        assert s.flush(30.0)
        assert [s.lookup([_k(i)]).tiers[0] for i in range(6)] == [None, *["cpu"] * 5]
        assert s.get(_k(1)) == _v(1) and not s.put(_k(2), _v(2))
        stats = s.stats()
        assert stats.tiers[1].replay_parked == 3 and (stats.parked_blocks, stats.parked_bytes) == (2, 2 * size)
        from kvstore.server.metrics import _StoreCollector

        gauge = next(m for m in _StoreCollector(s).collect() if m.name == "tierkv_replay_parked_bytes")
        assert [x.value for x in gauge.samples] == [2 * size]  # /metrics shows what they hold
        s.put(_k(6), _v(6))  # evicts 3 to park: 1, the oldest parked, is dropped for it
        assert s.flush(30.0) and s._state.parked.bytes == 2 * size
        assert s.lookup([_k(1)]).tiers == [None]
        assert s.delete(_k(5)) and s._state.parked.bytes == 2 * size  # not parked: nothing changes
        assert s.delete(_k(2)) and s._state.parked.bytes == size  # a parked key deleted: let go
        _attached(s, down_redis)
        assert _held(down_redis.url, list(range(7))) == [3, 4, 6]
        st = s.stats().tiers[1]
        assert st.replayed == 3 and st.replay_skipped == 4 and st.replay_parked == 4  # 0, 1, 2, 5 held nowhere
        assert s.stats().parked_blocks == 0 and _k(3) not in s._state.pending  # landed: let go
        assert s.lookup([_k(3)]).tiers == ["redis"] and s.get(_k(3)) == _v(3)


def test_parked_blocks_are_bounded_in_bytes_the_oldest_dropped() -> None:
    from kvstore.store.parked import Parked
    from kvstore.store.shared_state import Job

    p = Parked(10)
    jobs = [Job(b"k%d" % i, b"x" * 4, 1, True) for i in range(4)]
    assert p.park(jobs[0]) == [] and p.park(jobs[1]) == [] and p.bytes == 8
    assert p.park(jobs[2]) == [jobs[0]] and p.bytes == 8 and b"k0" not in p
    big = Job(b"big", b"x" * 11, 1, True)
    assert p.park(big) == [big] and p.bytes == 8  # larger than the bound: never parked
    assert p.unpark(b"k1") is jobs[1] and p.unpark(b"k1") is None and p.bytes == 4 and len(p) == 1
    assert Parked(0).park(jobs[3]) == [jobs[3]]
    with pytest.raises(ValueError, match=">= 0 bytes"):
        Parked(-1)


def test_the_replay_reads_verified_blocks_only(tmp_path: Path, down_redis: RedisServer) -> None:
    """A block that went bad in the level it is replayed from is deleted there and counted, never
    copied to the shared tier (where it would be served to every node)."""
    disk = DiskTier(tmp_path / "disk", 8 * BLOCK)
    with TieredStore([(disk, LevelOptions()), (_redis_tier(down_redis.url), SHARED)], tier_retry_s=0.1) as s:
        s.put(_k(0), _v(0))
        s.put(_k(1), _v(1))
        bad = bytearray(_v(1))
        bad[-100] ^= 0xFF
        disk.put(_k(1), bytes(bad))  # rots on disk while redis is away
        _attached(s, down_redis)
        assert _held(down_redis.url, [0, 1]) == [0]
        raw = redis.Redis.from_url(down_redis.url)
        assert raw.exists(PREFIX + _k(1)) == 0
        raw.close()
        st = s.stats().tiers[1]
        assert st.replayed == 1 and st.replay_skipped == 1
        assert s.lookup([_k(1)]).tiers == [None]  # dropped from the disk level too


# -- probing a detached tier early, on demand ------------------------------------------------------


@pytest.mark.parametrize("want", ["get", "lookup", "put"])
def test_a_request_that_wants_the_detached_tier_brings_its_probe_forward(down_redis: RedisServer, want: str) -> None:
    """The backoff would probe redis an hour after it was detached; a read that missed everywhere
    else (get, lookup) or a write skipped for it has it probed ``demand_s`` after the last probe."""
    with _store(down_redis.url, breaker=HOUR) as s:
        b = s.levels[1].breaker
        assert not b.attached and b.next_probe >= b.probed_at + 3600.0
        down_redis.start()
        {"get": lambda: s.get(_k(0)), "lookup": lambda: s.lookup([_k(0)]),
         "put": lambda: s.put(_k(0), _v(0))}[want]()  # fmt: skip
        assert b.next_probe == b.probed_at + HOUR.demand_s
        wait_for(lambda: s.stats().tiers[1].available, "a probe brought forward by a request")
        st = s.stats().tiers[1]
        assert st.attaches == 1 and st.errors == 1  # unreachable at start; the probe attached it


def test_a_request_brings_forward_only_the_probe_of_a_tier_that_may_hold_the_key(down_redis: RedisServer) -> None:
    """A private detached tier may hold only what its index says (a shared one anything): a read
    missing a key it indexed brings its probe forward, a read of any other key does not."""
    down_redis.start()
    tier = RedisTier(down_redis.url, 64 * BLOCK, socket_timeout_s=1.0, connect_timeout_s=0.5, prefix=b"private:")
    with TieredStore([(CpuTier(BLOCK), LevelOptions()), (tier, LevelOptions())], breaker=HOUR) as s:
        s.put(_k(0), _v(0))
        s.put(_k(1), _v(1))  # block 0 spills to the private redis level
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["redis"]
        down_redis.stop()
        for _ in range(3):  # three errors in a row detach it
            assert s.get(_k(0)) is None
        b = s.levels[1].breaker
        assert not b.attached
        # the last of those reads missed a key it indexes: its probe came forward, ran and failed
        wait_for(lambda: b.next_probe >= b.probed_at + 3600.0, "the probe brought forward to fail")
        planned = b.next_probe
        assert s.get(_k(9)) is None and s.lookup([_k(9)]).prefix_len == 0
        assert b.next_probe == planned  # not indexed there: not asked for
        assert s.get(_k(0)) is None
        assert b.next_probe == b.probed_at + HOUR.demand_s


def test_demand_never_probes_a_tier_more_often_than_demand_s() -> None:
    """However many requests want a detached tier, its next probe is never sooner than ``demand_s``
    after the last one ended: a down server gets no probe storm; without demand the backoff rules."""
    b = Breaker(BreakerPolicy(failures=1, probe_s=10.0, probe_max_s=40.0, demand_s=0.5))
    assert not b.wanted()  # attached: nothing to probe
    assert b.failed() and not b.attached
    assert b.next_probe == b.probed_at + 10.0
    assert b.wanted() and b.next_probe == b.probed_at + 0.5  # brought forward: the prober is woken
    assert not any(b.wanted() for _ in range(1000))  # already planned: nobody wakes it again
    assert b.next_probe == b.probed_at + 0.5
    b.probe_failed()  # that probe failed: the backoff goes on (doubling), demand brings it forward again
    assert b.wait_s == 20.0 and b.next_probe == b.probed_at + 20.0
    assert b.wanted() and b.next_probe == b.probed_at + 0.5 and not b.wanted()
    b.attach()
    assert not b.wanted()


def test_a_backlog_keeps_each_key_once_newest_last() -> None:
    log = Backlog(3)
    assert [log.add(k) for k in (b"a", b"b", b"c", b"a", b"d")] == [0, 0, 0, 0, 1]  # a again: newest
    assert log.take() == [b"c", b"a", b"d"] and len(log) == 0 and log.take() == []
    off = Backlog(0)
    assert off.add(b"a") == 0 and len(off) == 0
    with pytest.raises(ValueError):
        Backlog(-1)


def test_the_backlog_bound_is_configured_and_checked(down_redis: RedisServer) -> None:
    cfg = load_config(["--cpu", "1Mi", "--redis", down_redis.url], env={"TIERKV_REPLAY_BACKLOG_KEYS": "5"})
    assert cfg.replay_backlog_keys == 5
    with build_store(cfg) as s:  # redis is down: detached at start
        assert [lv.backlog.max_keys for lv in s.levels] == [5, 5]
        for i in range(7):
            s.put(_k(i), _v(i))
        st = s.stats().tiers[1]
        assert st.skipped_writes == 7 and st.replay_dropped == 2
    assert StoreConfig(tiers=(TierConfig("cpu", 1 << 20),)).replay_backlog_keys == 65536
    for bad in (-1, 16 * 1024**2 + 1):
        with pytest.raises(ConfigError, match="replay_backlog_keys must be in 0..16777216"):
            StoreConfig(tiers=(TierConfig("cpu", 1 << 20),), replay_backlog_keys=bad)


def test_a_hung_probe_of_one_tier_does_not_delay_another_tiers(tmp_path: Path) -> None:
    """Each detached tier is probed on a thread of its own: while the probe of a hung redis (it
    accepts, answers nothing) waits out its 30 s timeout, another redis that comes back is probed
    and attached (before, one prober thread probed the tiers one after the other)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hung, back = RedisServer(tmp_path / "a", start=False), RedisServer(tmp_path / "b", start=False)
    slow = RedisTier(hung.url, 64 * BLOCK, socket_timeout_s=30.0, connect_timeout_s=30.0, connect=False)
    try:
        with TieredStore([(CpuTier(8 * BLOCK), LevelOptions()), (slow, SHARED), (_redis_tier(back.url), SHARED)],
                         breaker=HOUR) as s:  # fmt: skip
            a, b = s.levels[1].breaker, s.levels[2].breaker
            assert not a.attached and not b.attached
            a_detached, b_detached = a.probed_at, b.probed_at
            hung.start()
            hung.pause()
            assert s.get(_k(0)) is None  # wanted both: both probes come forward
            wait_for(lambda: b.probed_at > b_detached, "the probe of the down redis to fail")
            back.start()
            assert s.get(_k(1)) is None  # brings the second one's probe forward again
            wait_for(lambda: s.stats().tiers[2].available, "the redis that came back to be attached")
            assert not a.attached and a.probed_at == a_detached  # the hung probe is still waiting
            hung.resume()  # answers: the hung probe ends, and attaches it
            wait_for(lambda: s.stats().tiers[1].available, "the resumed redis to be attached")
    finally:
        hung.resume()
        hung.stop()
        back.stop()


# -- writes that failed while the tier stayed attached ------------------------------------------


def test_a_write_that_failed_while_the_tier_stayed_attached_is_retried(down_redis: RedisServer) -> None:
    """One write-through times out (redis paused) but one error detaches nothing: the key waits in
    the backlog of an attached tier. The prober hands that backlog over again after ``probe_s``
    (before, it waited for a detach and attach that never came: bench.cluster's partitioned node,
    whose first writes after the heal failed before ARP answered, never shared them)."""
    down_redis.start()
    with _store(down_redis.url, tier_retry_s=0.2) as s:
        wait_for(lambda: s.stats().tiers[1].available, "the store to attach redis")
        down_redis.pause()
        try:
            s.put(_k(0), _v(0))
            wait_for(lambda: s.stats().tiers[1].errors == 1, "the write-through to time out")
        finally:
            down_redis.resume()
        assert s.stats().tiers[1].available  # one error: still attached
        wait_for(lambda: s.stats().tiers[1].replayed == 1, "the failed write to be replayed", timeout_s=30.0)
        assert s.flush(30.0) and _held(down_redis.url, [0]) == [0]
        st = s.stats().tiers[1]
        assert st.available and st.blocks == 1 and len(s.levels[1].backlog) == 0


class _FullTier(CpuTier):
    def put(self, key: bytes, value) -> None:  # type: ignore[no-untyped-def]
        from tiers.errors import TierFull

        raise TierFull(self.name, "no room")


def test_a_refusal_for_room_is_not_kept_for_replay() -> None:
    """A TierFull is the tier's choice, not a lost write: replaying it would only be refused again."""
    full = _FullTier(64 * BLOCK)
    with TieredStore([(CpuTier(8 * BLOCK), LevelOptions()), (full, SHARED)], tier_retry_s=0.1) as s:
        s.put(_k(0), _v(0))
        assert s.flush(30.0)
        st = s.stats().tiers[1]
        assert st.refused >= 1 and st.available
        assert len(s.levels[1].backlog) == 0 and st.replayed == 0
