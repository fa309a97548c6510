"""RadixCache: page-aligned matching, splits, ownership refs, locks, LRU eviction, the hook."""

from __future__ import annotations

import random

import pytest

from engine.page_allocator import PageAllocator
from engine.radix_cache import EvictedNode, RadixCache


def make(page_size: int = 2, num_pages: int = 64, hook=None) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc, on_evict=hook), alloc


def put(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """A request that computed ``tokens`` (whole pages) inserts them and finishes."""
    pages = alloc.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    cache.insert(tokens, pages)
    alloc.decref(pages)  # the request is done; only the tree's refs remain on adopted pages
    return pages


def test_insert_then_match_returns_the_pages():
    cache, alloc = make(page_size=2)
    pages = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    r = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (r.pages, r.num_tokens) == (pages, 6)
    assert r.node.tokens == (1, 2, 3, 4, 5, 6)
    assert [alloc.refcount(p) for p in pages] == [1, 1, 1]  # match takes no ref
    miss = cache.match_prefix([9, 9, 9, 9])
    assert (miss.pages, miss.num_tokens, miss.node) == ([], 0, cache.root)
    cache.check_integrity()


def test_partial_page_prefix_does_not_match():
    cache, alloc = make(page_size=4)
    pages = put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    # 7 tokens: only the first page is whole
    r = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (r.pages, r.num_tokens) == (pages[:1], 4)
    # fewer tokens than a page: nothing
    r = cache.match_prefix([1, 2, 3])
    assert (r.pages, r.num_tokens, r.node) == ([], 0, cache.root)
    cache.check_integrity()


def test_match_ending_inside_a_node_splits_it():
    cache, alloc = make(page_size=2)
    pages = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    (original,) = cache.root.children.values()
    cache.lock(original)
    r = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (r.pages, r.num_tokens) == (pages[:2], 4)
    head = r.node
    assert head.tokens == (1, 2, 3, 4) and head.pages == pages[:2]
    assert head.parent is cache.root and cache.root.children[(1, 2)] is head
    # the original object keeps the tail, so lock holders still point at the deep end
    assert head.children == {(5, 6): original}
    assert original.tokens == (5, 6) and original.pages == pages[2:] and original.parent is head
    assert head.lock_ref == original.lock_ref == 1
    assert cache.total_pages() == 3 and cache.evictable_pages() == 0
    cache.check_integrity()
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (full.pages, full.node) == (pages, original)
    cache.unlock(original)
    assert cache.evictable_pages() == 3
    cache.check_integrity()


def test_sequences_diverging_inside_a_page_are_separate_children():
    cache, alloc = make(page_size=4)
    a = put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    b_pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4, 5, 6, 9, 9], b_pages) == 4
    alloc.decref(b_pages)
    assert alloc.refcount(b_pages[0]) == 0  # the duplicate first page was not adopted
    head = cache.root.children[(1, 2, 3, 4)]
    # both children start with token 5: keyed by the whole first page, not the first token
    assert set(head.children) == {(5, 6, 7, 8), (5, 6, 9, 9)}
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9]).pages == [a[0], b_pages[1]]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == a
    # agreeing on 2 tokens of the second page is not a match of that page
    r = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])
    assert (r.pages, r.num_tokens, r.node) == ([a[0]], 4, head)
    # same at the root: two root children sharing a first token
    c = put(cache, alloc, [1, 2, 0, 0])
    assert set(cache.root.children) == {(1, 2, 3, 4), (1, 2, 0, 0)}
    assert cache.match_prefix([1, 2, 0, 0, 1]).pages == c
    assert cache.match_prefix([1, 2, 3, 0]).num_tokens == 0
    cache.check_integrity()
    alloc.check_integrity()


def test_insert_returns_present_count_and_adopts_only_new_pages():
    cache, alloc = make(page_size=2)
    first = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], first) == 0
    assert [alloc.refcount(p) for p in first] == [2, 2]  # request + tree
    second = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], second) == 4
    # only the third page was adopted; the duplicates keep just the request's ref
    assert [alloc.refcount(p) for p in second] == [1, 1, 2]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == first + second[2:]
    assert cache.insert([1, 2, 3, 4], second[:2]) == 4  # fully present: nothing adopted
    assert [alloc.refcount(p) for p in second] == [1, 1, 2]
    assert cache.total_pages() == 3
    cache.check_integrity()


def test_insert_rejects_bad_arguments_before_adopting():
    cache, alloc = make(page_size=2)
    pages = alloc.alloc(2)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], pages)  # 3 tokens for 2 pages of 2
    cache.insert([1, 2], pages[:1])
    with pytest.raises(ValueError, match="already owned"):
        cache.insert([7, 7], pages[:1])  # the same page at a second place
    with pytest.raises(ValueError, match="free"):
        cache.insert([8, 8], [40])  # the caller holds no ref on page 40
    assert alloc.refcount(pages[0]) == 2 and alloc.refcount(40) == 0
    assert cache.total_pages() == 1
    cache.check_integrity()


def test_lock_prevents_eviction_until_unlocked():
    cache, alloc = make(page_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    other = put(cache, alloc, [7, 8])
    r = cache.match_prefix([1, 2, 3, 4])
    cache.lock(r.node)
    assert cache.evictable_pages() == 1
    assert cache.evict(10**6) == 1  # only the unlocked sequence goes
    assert alloc.refcount(other[0]) == 0
    assert cache.match_prefix([1, 2, 3, 4]).pages == r.pages
    assert cache.evict(10**6) == 0 and cache.total_pages() == 2
    cache.unlock(r.node)
    assert cache.evictable_pages() == 2
    with pytest.raises(RuntimeError):
        cache.unlock(r.node)  # below zero
    assert cache.evict(1) == 2  # whole node
    assert cache.total_pages() == 0 and alloc.num_free() == 64
    with pytest.raises(ValueError):
        cache.lock(r.node)  # evicted node is no longer in the tree
    cache.check_integrity()


def test_lock_counts_on_ancestors():
    cache, alloc = make(page_size=1)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    leaf3 = cache.match_prefix([1, 2, 3]).node
    leaf4 = cache.match_prefix([1, 2, 4]).node
    head = leaf3.parent
    cache.lock(leaf3)
    cache.lock(leaf4)
    assert head.lock_ref == 2 and cache.evictable_pages() == 0
    cache.lock(cache.root)  # a miss returns the root; locking it is a no-op
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 0
    cache.unlock(leaf3)
    assert cache.evict(10) == 1 and head.lock_ref == 1  # leaf3 went; head held by leaf4
    cache.check_integrity()


def test_lru_evicts_the_oldest_leaf_and_a_match_refreshes():
    cache, alloc = make(page_size=2)
    a = put(cache, alloc, [1, 1])
    b = put(cache, alloc, [2, 2])
    c = put(cache, alloc, [3, 3])
    assert cache.evict(1) == 1 and alloc.refcount(a[0]) == 0  # oldest insert
    cache.match_prefix([2, 2])  # b is now the newest
    assert cache.evict(1) == 1 and alloc.refcount(c[0]) == 0
    assert cache.match_prefix([2, 2]).pages == b
    cache.check_integrity()


def test_parent_becomes_evictable_after_its_children():
    seen: list[list[EvictedNode]] = []
    cache, alloc = make(page_size=2, hook=seen.append)
    p = put(cache, alloc, [1, 1, 2, 2])
    x = put(cache, alloc, [1, 1, 3, 3])  # splits: [1 1] -> {[2 2], [3 3]}
    cache.match_prefix([1, 1, 3, 3])  # the [3 3] branch is newer
    assert cache.evict(1) == 1
    assert [e.tokens for e in seen[0]] == [(2, 2)]
    assert cache.evict(2) == 2  # [3 3], then its parent, now a leaf, in the same call
    assert [e.tokens for e in seen[1]] == [(3, 3), (1, 1)]
    assert cache.total_pages() == 0 and alloc.num_free() == 64
    assert {p[0], p[1], x[1]} == {n for batch in seen for e in batch for n in e.pages}
    cache.check_integrity()


def test_evict_hook_gets_exact_nodes_while_pages_are_still_allocated():
    calls: list[list[EvictedNode]] = []

    def hook(nodes: list[EvictedNode]) -> None:
        for n in nodes:
            assert all(alloc.refcount(p) > 0 for p in n.pages)
        calls.append(nodes)

    cache, alloc = make(page_size=2, hook=hook)
    base = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    branch = put(cache, alloc, [1, 2, 3, 4, 7, 8, 9, 9])  # splits [1..6] at 4 tokens
    free_before = alloc.num_free()
    assert cache.evict(100) == 5
    assert len(calls) == 1  # once per evict() call
    assert calls[0] == [
        EvictedNode((1, 2, 3, 4), (5, 6), [base[2]]),
        EvictedNode((1, 2, 3, 4), (7, 8, 9, 9), branch[2:]),
        EvictedNode((), (1, 2, 3, 4), base[:2]),
    ]
    assert alloc.num_free() == free_before + 5
    assert cache.evict(100) == 0 and len(calls) == 1  # nothing to evict: no hook call
    alloc.check_integrity()


def test_a_failing_hook_evicts_nothing():
    def hook(nodes: list[EvictedNode]) -> None:
        raise OSError("offload failed")

    cache, alloc = make(page_size=2, hook=hook)
    pages = put(cache, alloc, [1, 2, 3, 4])
    with pytest.raises(OSError):
        cache.evict(1)
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages and cache.total_pages() == 2
    cache.check_integrity()


def test_hit_statistics():
    cache, alloc = make(page_size=2)
    assert cache.hit_rate == 0.0
    put(cache, alloc, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # 4 of 8
    cache.match_prefix([1, 2, 3])  # 2 of 3
    cache.match_prefix([1, 2, 3, 4], record_stats=False)
    assert (cache.tokens_requested, cache.tokens_hit) == (11, 6)
    assert cache.hit_rate == pytest.approx(6 / 11)


def test_reset_releases_everything_and_zeroes_stats():
    cache, alloc = make(page_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    r = cache.match_prefix([1, 2, 5, 6])
    cache.lock(r.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(r.node)
    cache.reset()
    assert alloc.num_free() == 64 and cache.total_pages() == cache.evictable_pages() == 0
    assert (cache.tokens_requested, cache.tokens_hit) == (0, 0)
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    with pytest.raises(ValueError):
        cache.lock(r.node)
    cache.check_integrity()
    alloc.check_integrity()


def test_long_prompt_matches_in_page_chunks():
    cache, alloc = make(page_size=16, num_pages=1024)
    rng = random.Random(0)
    prompt = [rng.randrange(32000) for _ in range(4096)]
    pages = put(cache, alloc, prompt)
    r = cache.match_prefix(prompt[:3000] + [-1] * 100)
    assert r.num_tokens == 2992 and r.pages == pages[:187]  # 3000 // 16 whole pages
    assert len(r.node.tokens) == 2992 and len(next(iter(r.node.children.values())).tokens) == 4096 - 2992
    cache.check_integrity()


def _corrupt_key(c: RadixCache) -> None:
    node = c.root.children.pop((1, 2))
    c.root.children[(1, 9)] = node


def _corrupt_tokens(c: RadixCache) -> None:
    c.root.children[(1, 2)].tokens += (7,)


def _corrupt_pages(c: RadixCache) -> None:
    c.root.children[(1, 2)].pages.pop()


def _corrupt_lock(c: RadixCache) -> None:
    c.root.children[(1, 2)].lock_ref = -1


def _corrupt_parent_lock(c: RadixCache) -> None:
    leaf = next(iter(c.root.children[(1, 2)].children.values()))
    leaf.lock_ref = 1  # child locked but its parent not


def _corrupt_double_owner(c: RadixCache) -> None:
    head = c.root.children[(1, 2)]
    leaf = next(iter(head.children.values()))
    leaf.pages[0] = head.pages[0]


def _corrupt_freed_page(c: RadixCache) -> None:
    c.allocator.decref(c.root.children[(1, 2)].pages[:1])


def _corrupt_counter(c: RadixCache) -> None:
    c._evictable += 1


@pytest.mark.parametrize("corrupt", [
    _corrupt_key, _corrupt_tokens, _corrupt_pages, _corrupt_lock, _corrupt_parent_lock,
    _corrupt_double_owner, _corrupt_freed_page, _corrupt_counter,
])
def test_check_integrity_catches_corruption(corrupt):
    cache, alloc = make(page_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    cache.check_integrity()
    corrupt(cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 2), (2, 3), (3, 2), (4, 4)])
def test_randomized_against_reference_model(seed: int, page_size: int):
    rng = random.Random(seed)
    ps = page_size
    evicted: list[EvictedNode] = []

    def hook(nodes: list[EvictedNode]) -> None:
        assert all(alloc.refcount(p) > 0 for n in nodes for p in n.pages)
        evicted.extend(nodes)

    alloc = PageAllocator(48)
    cache = RadixCache(ps, alloc, on_evict=hook)
    ref: dict[tuple[int, ...], int] = {}  # every cached page-aligned prefix -> its last page
    active: list[tuple[object, list[int], tuple[int, ...]]] = []  # (locked node, held pages, tokens)
    corpus: list[list[int]] = [[]]

    def expected(tokens: list[int]) -> list[int]:
        out: list[int] = []
        while len(out) * ps + ps <= len(tokens) and tuple(tokens[: (len(out) + 1) * ps]) in ref:
            out.append(ref[tuple(tokens[: (len(out) + 1) * ps])])
        return out

    def evict(n: int) -> None:
        evictable, del_before = cache.evictable_pages(), len(evicted)
        got = cache.evict(n)
        batch = evicted[del_before:]
        assert got == sum(len(e.pages) for e in batch)
        assert got >= min(n, evictable) and (got >= n or cache.evictable_pages() == 0)
        for e in batch:
            for i, page in enumerate(e.pages):
                assert ref.pop(e.prefix_tokens + e.tokens[: (i + 1) * ps]) == page
        for _, _, toks in active:  # a locked path survives any eviction
            assert all(toks[: (i + 1) * ps] in ref for i in range(len(toks) // ps))

    def release(i: int) -> None:
        node, pages, _ = active.pop(i)
        cache.unlock(node)
        alloc.decref(pages)

    for _ in range(1000):
        op = rng.random()
        if op < 0.5:  # a request: match, lock, compute the rest, insert, keep it running
            base = rng.choice(corpus)
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(9))]
            corpus.append(tokens)
            r = cache.match_prefix(tokens)
            assert r.pages == expected(tokens) and r.num_tokens == len(r.pages) * ps
            alloc.incref(r.pages)
            cache.lock(r.node)
            need = len(tokens) // ps - len(r.pages)
            if alloc.num_free() < need:
                evict(need - alloc.num_free())
            new = alloc.alloc(need)
            if new is None:  # pool too full of locked pages: give up on this request
                cache.unlock(r.node)
                alloc.decref(r.pages)
                continue
            full = tokens[: len(tokens) // ps * ps]
            assert cache.insert(full, r.pages + new) == r.num_tokens
            for i, page in enumerate(new, start=len(r.pages) + 1):
                ref[tuple(full[: i * ps])] = page
            r2 = cache.match_prefix(full, record_stats=False)
            assert r2.pages == r.pages + new
            cache.lock(r2.node)
            cache.unlock(r.node)
            active.append((r2.node, r2.pages, tuple(full)))
        elif op < 0.75 and active:
            release(rng.randrange(len(active)))
        elif op < 0.85:
            evict(rng.randrange(1, 8))
        elif op < 0.97:
            tokens = rng.choice(corpus)
            assert cache.match_prefix(tokens).pages == expected(tokens)
        else:
            while active:
                release(0)
            cache.reset()
            ref.clear()
            assert alloc.num_free() == alloc.num_pages
        cache.check_integrity()
        alloc.check_integrity()
        assert cache.total_pages() == len(ref)
        held = [p for _, pages, _ in active for p in pages]
        for p in range(alloc.num_pages):  # every ref is accounted for: tree + running requests
            assert alloc.refcount(p) == (p in ref.values()) + held.count(p)
    assert len(evicted) > 10  # the run did exercise eviction
