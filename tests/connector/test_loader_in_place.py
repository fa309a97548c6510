"""Loads straight from the daemon's cpu arena, located by the lookup: no Get, and never a wrong page.

A lookup with ``in_place=True`` says where the leading blocks lie in the arena the client maps;
the loader copies them from there and verifies each copy as it does any other. Nothing is
pinned, so by the load the bytes may be another block's: that block then fails its checks and a
Get asks for it (and what follows) as before. Runs against a real (in-process) daemon.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from connector.loader import Loader
from engine.kv_pool import KVPool
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.keys import BlockKey
from kvstore.store.results import InPlace
from tests.fixtures_kvstore import WAIT_S, connect, inprocess_daemon

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


class Stored(NamedTuple):
    d: Any  # tests.kvstore.test_shm_safety.InProcessDaemon
    c: KVStoreClient
    pool: KVPool
    keys: list[BlockKey]
    arrays: list[np.ndarray]
    items: list


@contextmanager
def _stored(tiny, seed: int, **client: object) -> Iterator[Stored]:
    """An in-process daemon holding PAGES blocks, and a client of it."""
    pool = _pool(tiny)
    keys, arrays, items = _items(pool, seed)
    with inprocess_daemon() as d, connect(d, retry=Retry(attempts=1), **client) as c:  # type: ignore[arg-type]
        c.put_many(items)
        yield Stored(d, c, pool, keys, arrays, items)


def _assert_pages(pool: KVPool, pages: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
    for page, a in zip(pages, arrays, strict=True):
        assert np.array_equal(_page(pool, page), a)


def test_a_located_load_asks_for_nothing_and_lands_every_block(tiny) -> None:
    with _stored(tiny, 1) as st:
        loader = _mapped(st.c, st.pool, st.keys)
        before = st.d.store.stats().tiers[0].hits
        found = st.c.lookup(st.keys, in_place=True)
        assert found.in_place is not None and all(s is not None for s in found.in_place.spans)
        assert st.d.store.stats().tiers[0].hits == before + PAGES  # the daemon counts them as read
        st.d.store.reads.clear()
        res = loader.load(st.keys, [4, 3, 2, 1], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert st.d.store.reads == {}  # no Get reached the daemon
        _assert_pages(st.pool, [4, 3, 2, 1], st.arrays)


def test_a_plain_lookup_locates_nothing_and_counts_no_read(tiny) -> None:
    with _stored(tiny, 2) as st:
        before = st.d.store.stats().tiers[0].hits
        assert st.c.lookup(st.keys).in_place is None
        assert st.c.lookup(st.keys, read=False, in_place=True).in_place is None  # a writer's check: not a read
        assert st.d.store.stats().tiers[0].hits == before


def test_bytes_reused_since_the_lookup_are_refused_and_fetched_with_a_get(tiny) -> None:
    """Between the lookup and the load, block 1 is deleted and another block takes its arena
    bytes, then block 1 is stored again elsewhere: the in-place copy of block 1 fails its key
    check, and a Get brings the real block 1 and the rest. Every page holds its own block."""
    with _stored(tiny, 3) as st:
        _, _, others = _items(st.pool, 4, prefix=b"squatter")
        loader = _mapped(st.c, st.pool, st.keys)
        found = st.c.lookup(st.keys, in_place=True)
        assert found.in_place is not None
        span = found.in_place.spans[1]
        st.c.delete([st.keys[1]])
        st.c.put_many(others[:1])  # best fit: the freed run of the same size
        assert st.c.lookup([others[0][0]], in_place=True).in_place.spans[0] == span  # type: ignore[union-attr]
        st.c.put_many(st.items[1:2])
        st.d.store.reads.clear()
        res = loader.load(st.keys, [1, 2, 3, 4], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert set(st.d.store.reads) == set(st.keys[1:])  # the Get started at the refused block
        _assert_pages(st.pool, [1, 2, 3, 4], st.arrays)


def test_a_block_gone_since_the_lookup_ends_the_load_there(tiny) -> None:
    with _stored(tiny, 5) as st:
        _, _, others = _items(st.pool, 6, prefix=b"squatter")
        loader = _mapped(st.c, st.pool, st.keys)
        found = st.c.lookup(st.keys, in_place=True)
        st.c.delete([st.keys[2]])
        st.c.put_many(others[:1])
        res = loader.load(st.keys, [1, 2, 3, 4], WAIT_S, in_place=found.in_place)
        assert (res.pages_ok, res.failure) == (2, "missing")
        _assert_pages(st.pool, [1, 2], st.arrays[:2])


@pytest.mark.parametrize("token", [b"", b"another arena...."])
def test_spans_of_another_arena_are_not_read(tiny, token: bytes) -> None:
    """A daemon that restarted has a new arena: spans from it are never read in this mapping."""
    with _stored(tiny, 7) as st:
        loader = _mapped(st.c, st.pool, st.keys)
        found = st.c.lookup(st.keys, in_place=True)
        assert found.in_place is not None and st.c.in_place_views(found.in_place)
        stale = InPlace(token, found.in_place.spans)
        assert st.c.in_place_views(stale) == []
        st.d.store.reads.clear()
        res = loader.load(st.keys, [1, 2, 3, 4], WAIT_S, in_place=stale)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        assert set(st.d.store.reads) == set(st.keys)  # all came with a Get
        assert np.array_equal(_page(st.pool, 3), st.arrays[2])


def test_a_client_without_the_arena_gets_no_views(tiny) -> None:
    with _stored(tiny, 8, use_arena=False) as st:
        Loader(st.c, st.pool, chunk_bytes=64 * st.pool.bytes_per_page).load(st.keys[:1], [PAGES + 1], WAIT_S)
        found = st.c.lookup(st.keys, in_place=True)
        assert found.in_place is not None  # the daemon answers; this client just cannot use it
        assert st.c.in_place_views(found.in_place) == []
