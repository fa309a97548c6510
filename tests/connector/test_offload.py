"""Offload and reload through a real daemon (tiny random Llama, so it runs in seconds):
eviction -> offload -> reload round trip, two engines sharing one daemon, blocks the daemon
already holds not sent again, tenants (cache_salt) never sharing, a corrupted block dropped.
"""

from __future__ import annotations

from pathlib import Path

import redis

from connector.state import kv_state
from connector.wiring import install_hook
from engine.hooks import PrefixExtension
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import daemon


def test_evict_offload_reload_round_trip(tiny, tmp_path: Path) -> None:
    ref = make_engine(tiny, num_pages=64)
    a_ids, b_ids = prompt(90, seed=1), prompt(90, seed=2)
    want_a = run(ref, a_ids).output_ids
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = make_engine(tiny, num_pages=8)  # room for one request: the second evicts the first
        conn = attach(eng, d.address)
        try:
            assert run(eng, a_ids).output_ids == want_a
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == 0
            run(eng, b_ids)  # evicts a's 5 pages -> offloaded
            assert conn.flush(30)
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="sent") >= 5
            assert eng.radix.match_prefix(a_ids, record_stats=False).num_tokens == 0
            again = run(eng, a_ids)
            assert again.cached_tokens == 80 and kv_state(again).decision.pages == 5
            assert again.output_ids == want_a
            eng.radix.check_integrity()
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)


def test_second_engine_reuses_first_engines_prefix(tiny, tmp_path: Path) -> None:
    ids = prompt(200, seed=3)  # 12 loadable pages
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        first, second = make_engine(tiny), make_engine(tiny)  # separate pools, one daemon
        c1 = attach(first, d.address, write_through=True)
        c2 = attach(second, d.address, write_through=True)
        try:
            want = run(first, ids).output_ids
            assert c1.flush(30)
            got = run(second, ids)
            assert got.cached_tokens == 192 and got.output_ids == want
            assert c2.metrics.value("tierkv_connector_loaded_tokens_total", tier="cpu") == 192
            # the second engine's write-through sends nothing new: it knows what it loaded,
            # and the first engine's repeat is skipped after a lookup (no bytes resent)
            assert c2.flush(30)
            assert c2.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == 0
            first.radix.reset()
            c1.known.discard(c1.keyspace.keys(ids, None))
            run(first, ids)
            assert c1.flush(30)
            assert c1.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == 12
        finally:
            detach(first)
            detach(second)


def test_tenants_never_share(tiny, tmp_path: Path) -> None:
    ids = prompt(120, seed=4)
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, write_through=True)
        try:
            a1 = run(eng, ids, salt="tenant-a")
            assert conn.flush(30)
            b1 = run(eng, ids, salt="tenant-b")  # same tokens, other tenant: no local, no daemon hit
            assert b1.cached_tokens == 0 and kv_state(b1) is None or kv_state(b1).decision is None
            assert b1.output_ids == a1.output_ids
            keys_a, keys_b = conn.keyspace.keys(ids, "tenant-a"), conn.keyspace.keys(ids, "tenant-b")
            assert not set(keys_a) & set(keys_b)
            assert not set(keys_a) & set(conn.keyspace.keys(ids, None))
            assert conn.flush(30)
            assert conn.loader.lookup(keys_a, 5.0) == ["cpu"] * 7 and conn.loader.lookup(keys_b, 5.0) == ["cpu"] * 7
            assert conn.loader.lookup(conn.keyspace.keys(ids, None), 5.0) == []  # the default namespace: nothing
            a2 = run(eng, ids, salt="tenant-a")  # the same tenant hits its own tree
            assert a2.cached_tokens == 112
            eng.radix.reset()  # and, from the daemon, its own blocks only
            conn.known.discard(keys_a + keys_b)
            plain = run(eng, ids)
            assert plain.cached_tokens == 0
            a3 = run(eng, ids, salt="tenant-a")
            assert a3.cached_tokens == 112 and kv_state(a3).decision.pages == 7
            assert a3.output_ids == a1.output_ids
            eng.radix.check_integrity()
        finally:
            detach(eng)


def test_corrupted_block_is_dropped_and_recomputed(tiny, tmp_path: Path, redis_url: str) -> None:
    ids = prompt(120, seed=5)
    ref = make_engine(tiny)
    want = run(ref, ids).output_ids
    with daemon(tmp_path, "--redis", redis_url) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, write_through=True)
        try:
            run(eng, ids)
            assert conn.flush(30)
            keys = conn.keyspace.keys(ids, None)
            r = redis.Redis.from_url(redis_url)
            (victim,) = [k for k in r.scan_iter(count=1000) if k.endswith(keys[3])]
            size = r.strlen(victim)
            r.setrange(victim, size - 100, bytes([r.getrange(victim, size - 100, size - 100)[0] ^ 0xFF]))
            corrupt = r.get(victim)
            eng.radix.reset()
            conn.known.discard(keys)
            got = run(eng, ids)
            assert got.cached_tokens == 48  # pages 0-2 arrived intact; 3 was refused
            # the daemon refuses it first: the block no longer matches its MAC (kvstore/store/signed_tier.py),
            # so it is a miss there and deleted from Redis (the recomputed page may be offloaded again)
            assert r.get(victim) != corrupt
            assert got.output_ids == want
            eng.pool.allocator.check_integrity()
            eng.radix.check_integrity()
        finally:
            detach(eng)


class _ApproximateTail:
    """Stands in for CacheBlend: proposes the prompt's KV as approximate past token 32 (the pages are
    left unwritten: this test checks what is offloaded, not the output)."""

    def propose(self, req, pages):
        m, n = req.num_computed, len(req.prompt_ids) - 1
        fresh = pages.alloc(-(-n // 16) - len(req.pages))  # make_engine's 16-token pages
        return PrefixExtension(fresh, n - m, exact=False, exact_head=32 - m)

    def on_finish(self, req) -> None:
        pass

    def close(self) -> None:
        pass


def test_write_through_never_offloads_past_cache_limit(tiny, tmp_path: Path) -> None:
    ids = prompt(120, seed=6)
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, write_through=True)
        install_hook(eng, _ApproximateTail())
        try:
            run(eng, ids)
            assert conn.flush(30)
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == 2
            assert conn.loader.lookup(conn.keyspace.keys(ids, None), 5.0) == ["cpu", "cpu"]
        finally:
            detach(eng)
