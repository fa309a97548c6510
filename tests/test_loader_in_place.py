"""Loads straight from the daemon's cpu arena, located by the lookup: no Get, and never a wrong page.

A lookup with ``in_place=True`` says where the leading blocks lie in the arena the client maps;
the loader copies them from there and verifies each copy as it does any other. Nothing is
pinned, so by the load the bytes may be another block's: that block then fails its checks and a
Get asks for it (and what follows) as before. Runs against a real (in-process) daemon.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.loader import Loader
from engine.kv_pool import KVPool
from kvstore.block import encode_block
from kvstore.client import KVStoreClient
from kvstore.keys import BlockKey
from kvstore.retry import Retry
from kvstore.store_types import InPlace
from tests.test_shm_safety import WAIT_S, inprocess_daemon

PAGES = 4


def _pool(tiny) -> KVPool:
    return KVPool(tiny.arch, num_pages=PAGES + 2, page_size=4, dtype=torch.float32, device=torch.device("cpu"))


def _items(pool: KVPool, seed: int, prefix: bytes = b"inplace") -> tuple[list[BlockKey], list[np.ndarray], list]:
    rng = np.random.default_rng(seed)
    keys = [BlockKey(prefix + b"-%09d" % i) for i in range(PAGES)]
    arrays = [rng.standard_normal(pool.block_shape()).astype(np.float32) for _ in keys]
    return keys, arrays, [(k, encode_block(k, a, layout="LKTHD")) for k, a in zip(keys, arrays, strict=True)]


def _page(pool: KVPool, page: int) -> np.ndarray:
    return pool.read_pages([page])[0].numpy()


def _mapped(c: KVStoreClient, pool: KVPool, keys: list[BlockKey]) -> Loader:
    """A loader whose client has mapped the arena (its first shared-memory call does that)."""
    loader = Loader(c, pool, chunk_bytes=64 * pool.bytes_per_page)
    assert loader.load(keys[:1], [PAGES + 1], WAIT_S).pages_ok == 1
    assert c.arena_active
    return loader


def test_a_located_load_asks_for_nothing_and_lands_every_block(tiny) -> None:
    pool = _pool(tiny)
    keys, arrays, items = _items(pool, 1)
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        loader = _mapped(c, pool, keys)
        before = d.store.stats().tiers[0].hits
        found = c.lookup(keys, in_place=True)
        assert found.in_place is not None and all(s is not None for s in found.in_place.spans)
        assert d.store.stats().tiers[0].hits == before + PAGES  # the daemon counts them as read
        d.store.reads.clear()
        res = loader.load(keys, [4, 3, 2, 1], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert d.store.reads == {}  # no Get reached the daemon
        for page, a in zip([4, 3, 2, 1], arrays, strict=True):
            assert np.array_equal(_page(pool, page), a)


def test_a_plain_lookup_locates_nothing_and_counts_no_read(tiny) -> None:
    pool = _pool(tiny)
    keys, _, items = _items(pool, 2)
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        before = d.store.stats().tiers[0].hits
        assert c.lookup(keys).in_place is None
        assert c.lookup(keys, read=False, in_place=True).in_place is None  # a writer's check: not a read
        assert d.store.stats().tiers[0].hits == before


def test_bytes_reused_since_the_lookup_are_refused_and_fetched_with_a_get(tiny) -> None:
    """Between the lookup and the load, block 1 is deleted and another block takes its arena
    bytes, then block 1 is stored again elsewhere: the in-place copy of block 1 fails its key
    check, and a Get brings the real block 1 and the rest. Every page holds its own block."""
    pool = _pool(tiny)
    keys, arrays, items = _items(pool, 3)
    _, _, others = _items(pool, 4, prefix=b"squatter")
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        loader = _mapped(c, pool, keys)
        found = c.lookup(keys, in_place=True)
        assert found.in_place is not None
        span = found.in_place.spans[1]
        c.delete(keys[1])
        c.put_many(others[:1])  # best fit: the freed run of the same size
        assert c.lookup([others[0][0]], in_place=True).in_place.spans[0] == span  # type: ignore[union-attr]
        c.put_many(items[1:2])
        d.store.reads.clear()
        res = loader.load(keys, [1, 2, 3, 4], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert set(d.store.reads) == set(keys[1:])  # the Get started at the refused block
        for page, a in zip([1, 2, 3, 4], arrays, strict=True):
            assert np.array_equal(_page(pool, page), a)


def test_a_block_gone_since_the_lookup_ends_the_load_there(tiny) -> None:
    pool = _pool(tiny)
    keys, arrays, items = _items(pool, 5)
    _, _, others = _items(pool, 6, prefix=b"squatter")
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        loader = _mapped(c, pool, keys)
        found = c.lookup(keys, in_place=True)
        c.delete(keys[2])
        c.put_many(others[:1])
        res = loader.load(keys, [1, 2, 3, 4], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (2, "missing")
        for page, a in zip([1, 2], arrays[:2], strict=True):
            assert np.array_equal(_page(pool, page), a)


@pytest.mark.parametrize("token", [b"", b"another arena...."])
def test_spans_of_another_arena_are_not_read(tiny, token: bytes) -> None:
    """A daemon that restarted has a new arena: spans from it are never read in this mapping."""
    pool = _pool(tiny)
    keys, arrays, items = _items(pool, 7)
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        loader = _mapped(c, pool, keys)
        found = c.lookup(keys, in_place=True)
        assert found.in_place is not None and c.in_place_views(found.in_place)
        stale = InPlace(token, found.in_place.spans)
        assert c.in_place_views(stale) == []
        d.store.reads.clear()
        res = loader.load(keys, [1, 2, 3, 4], WAIT_S, in_place=stale)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert set(d.store.reads) == set(keys)  # all came with a Get
        assert np.array_equal(_page(pool, 3), arrays[2])


def test_a_client_without_the_arena_gets_no_views(tiny) -> None:
    pool = _pool(tiny)
    keys, _, items = _items(pool, 8)
    with inprocess_daemon() as d, KVStoreClient(d.address, retry=Retry(attempts=1), use_arena=False) as c:
        c.put_many(items)
        Loader(c, pool, chunk_bytes=64 * pool.bytes_per_page).load(keys[:1], [PAGES + 1], WAIT_S)
        found = c.lookup(keys, in_place=True)
        assert found.in_place is not None  # the daemon answers; this client just cannot use it
        assert c.in_place_views(found.in_place) == []
