"""Per-salt state of the radix tree is bounded by what it caches: a tenant's tree goes with its last
node and a miss keeps nothing, so 10,000 distinct salts leave no trace and eviction never walks the
salts of the past; a salt whose tree was dropped still shares nothing with any other."""

from __future__ import annotations

import pytest

from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache

PS = 4
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]  # 2 pages


def _put(cache: RadixCache, alloc: PageAllocator, tokens: list[int], salt: str) -> list[int]:
    pages = alloc.alloc(len(tokens) // PS)
    assert pages is not None
    cache.insert(tokens, pages, salt=salt)
    alloc.decref(pages)
    return pages


def test_ten_thousand_salts_leave_only_the_trees_of_cached_pages() -> None:
    """Without the guard every salt ever seen kept its root: 10,001 of them here."""
    alloc = PageAllocator(64)
    cache = RadixCache(PS, alloc)
    for i in range(10_000):
        salt = f"tenant-{i}-" + "s" * 200
        assert cache.match_prefix(TOKENS, salt=salt).num_tokens == 0  # a miss: no tree is made for it
        if alloc.num_free() < 2:
            assert cache.evict(2) == 2
        _put(cache, alloc, TOKENS, salt)
    assert len(cache._roots) <= 64 // 2 + 1  # the trees holding pages, and the unsalted one
    roots = len(cache._roots)
    for i in range(1_000):  # misses of salts that never insert (their requests aborted, say)
        assert cache.match_prefix(TOKENS, salt=f"passer-by-{i}").num_tokens == 0
    assert len(cache._roots) == roots
    assert "" in cache._roots and cache.root is cache._roots[""]
    cache.check_integrity()
    cache.evict(64)
    assert list(cache._roots) == [""] and cache.total_pages() == 0


def test_a_salt_whose_tree_was_dropped_shares_nothing() -> None:
    alloc = PageAllocator(16)
    cache = RadixCache(PS, alloc)
    a_pages = _put(cache, alloc, TOKENS, "a")
    cache.evict(16)  # a's tree goes with its last node
    assert "a" not in cache._roots
    b_pages = _put(cache, alloc, TOKENS, "b")
    assert cache.match_prefix(TOKENS, salt="a").num_tokens == 0
    assert cache.match_prefix(TOKENS, salt="").num_tokens == 0
    a2 = _put(cache, alloc, TOKENS, "a")
    assert set(a2).isdisjoint(b_pages) and cache.match_prefix(TOKENS, salt="a").pages == a2
    assert cache.match_prefix(TOKENS, salt="b").pages == b_pages
    assert a_pages  # (a's first pages went back to the allocator)
    cache.check_integrity()


def test_a_lock_on_a_root_outlives_the_tree() -> None:
    """A request that matched nothing holds its salt's root; unlocking it after the tree went is a no-op,
    while a node of a dropped tree is still refused."""
    alloc = PageAllocator(16)
    cache = RadixCache(PS, alloc)
    miss = cache.match_prefix(TOKENS, salt="c")
    cache.lock(miss.node)
    _put(cache, alloc, TOKENS, "c")
    hit = cache.match_prefix(TOKENS, salt="c")
    root = hit.node.parent
    cache.lock(root)  # the live root this time
    cache.evict(16)
    assert "c" not in cache._roots
    cache.unlock(miss.node)
    cache.unlock(root)
    with pytest.raises(ValueError, match="not in this radix cache"):
        cache.lock(hit.node)
