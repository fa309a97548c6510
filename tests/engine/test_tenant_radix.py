"""The radix tree with operator-declared shared prefixes (engine/shared_prefix.py): the pages of a
prompt inside a declared prefix are one shared node for every tenant, a tenant's pages after them
hang below it and are never another tenant's, and nothing a request sends lands in the shared
subtree unless the operator declared those very tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.shared_prefix import SharedPrefixes, read_entries

PS = 4
SYSTEM = list(range(100, 114))  # 14 tokens: 3 whole pages are declared; the 4th page's 2 tokens stay private


def make(*prefixes: list[int], num_pages: int = 64, hook=None) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(PS, alloc, on_evict=hook, shared=SharedPrefixes(prefixes, PS)), alloc


def put(cache: RadixCache, alloc: PageAllocator, tokens: list[int], salt: str | None) -> list[int]:
    pages = alloc.alloc(len(tokens) // PS)
    assert pages is not None
    cache.insert(tokens, pages, salt=salt)
    alloc.decref(pages)
    return pages


def test_shared_pages_rule() -> None:
    sp = SharedPrefixes([SYSTEM, [7] * 3], PS)  # a prefix shorter than a page declares nothing
    assert sp.prefixes == (tuple(SYSTEM[:12]),)
    assert sp.shared_pages(SYSTEM + [1, 2, 3]) == 3
    assert sp.shared_pages(SYSTEM[:9]) == 2  # a prompt ending inside the prefix: its whole pages
    assert sp.shared_pages(SYSTEM[:6] + [0] + SYSTEM[7:]) == 1  # one token differs: from its page on, private
    assert sp.shared_pages([0] + SYSTEM) == 0  # the prefix must start the prompt
    two = SharedPrefixes([SYSTEM, SYSTEM[:8] + [5, 5, 5, 5]], PS)  # two prompts with a common head
    assert two.shared_pages(SYSTEM[:8] + [5, 5, 5, 5, 9]) == 3 and two.shared_pages(SYSTEM[:8] + [9] * 4) == 2


def test_two_tenants_share_the_declared_pages_and_nothing_after() -> None:
    cache, alloc = make(SYSTEM)
    a_tail, b_tail = [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 8, 8]
    a_pages = put(cache, alloc, SYSTEM + a_tail[:2], salt="tenant-a")  # 4 pages: 3 shared + 1 of a's
    b = cache.match_prefix(SYSTEM + b_tail, salt="tenant-b")
    assert b.num_tokens == 12 and b.pages == a_pages[:3]  # the very pages a computed
    # a's own continuation (the same tokens) is a's alone
    assert cache.match_prefix(SYSTEM + a_tail[:2], salt="tenant-b").num_tokens == 12
    assert cache.match_prefix(SYSTEM + a_tail[:2], salt="tenant-a").num_tokens == 16
    assert cache.match_prefix(SYSTEM + a_tail[:2]).num_tokens == 12  # no salt: a tenant too ("")
    b_pages = put(cache, alloc, SYSTEM + a_tail[:2], salt="tenant-b")
    assert cache.match_prefix(SYSTEM + a_tail[:2], salt="tenant-b").pages == a_pages[:3] + b_pages[3:]
    assert alloc.refcount(b_pages[0]) == 0 and alloc.refcount(a_pages[0]) == 1  # b's copies not adopted
    (shared,) = cache._roots[None].children.values()
    assert shared.scope is None and len(shared.tokens) == 12 and len(shared.children) == 2
    assert {c.scope for c in shared.children.values()} == {"tenant-a", "tenant-b"}
    cache.check_integrity()


def test_a_prompt_without_the_declared_prefix_stays_in_its_tenants_tree() -> None:
    cache, alloc = make(SYSTEM)
    almost = SYSTEM[:5] + [0] + SYSTEM[6:12]  # differs in the second page
    put(cache, alloc, almost, salt="tenant-a")
    assert cache.match_prefix(almost, salt="tenant-b").num_tokens == 4  # the first page is declared: shared
    assert cache.match_prefix(almost, salt="tenant-a").num_tokens == 12
    assert all(c.scope is None for c in cache._roots[None].children.values())
    put(cache, alloc, [0] + SYSTEM[:11], salt="tenant-a")  # not at the start: nothing shared
    assert cache.match_prefix([0] + SYSTEM[:11], salt="tenant-b").num_tokens == 0
    cache.check_integrity()


def test_no_salt_reaches_the_shared_tree() -> None:
    cache, alloc = make(SYSTEM)
    private = [5, 6, 7, 8] * 3
    for salt in (None, "", "None", "shared", "\x00"):
        put(cache, alloc, private, salt=salt)
    assert None not in cache._roots  # nothing declared was ever inserted: no shared tree at all
    assert cache.match_prefix(private, salt="other").num_tokens == 0
    cache.check_integrity()


def test_locks_hold_the_shared_path_and_eviction_reports_scopes() -> None:
    seen: list = []
    cache, alloc = make(SYSTEM, hook=lambda nodes: seen.extend(nodes))
    put(cache, alloc, SYSTEM + [1, 2], salt="tenant-a")
    put(cache, alloc, SYSTEM + [3, 4], salt="tenant-b")
    m = cache.match_prefix(SYSTEM + [3, 4], salt="tenant-b")
    cache.lock(m.node)
    assert cache.evict(100) == 1  # only a's own page: b's lock holds b's node and the shared one above it
    assert [(n.salt, len(n.prefix_tokens), n.tokens) for n in seen] == [("tenant-a", 12, (*SYSTEM[12:], 1, 2))]
    cache.unlock(m.node)
    seen.clear()
    assert cache.evict(100) == 4
    assert [(n.salt, len(n.prefix_tokens)) for n in seen] == [("tenant-b", 12), ("", 0)]  # the shared node: no salt
    assert alloc.num_free() == alloc.num_pages
    cache.check_integrity()


def test_integrity_check_refuses_a_private_page_in_the_shared_tree() -> None:
    cache, alloc = make(SYSTEM)
    put(cache, alloc, SYSTEM + [1, 2], salt="tenant-a")
    (shared,) = cache._roots[None].children.values()
    (tail,) = shared.children.values()
    tail.scope = None  # pretend a's page were shared
    with pytest.raises(AssertionError):
        cache.check_integrity()
    tail.scope = "tenant-a"
    cache.check_integrity()
    shared.tokens = (0, *shared.tokens[1:])  # a shared node holding tokens nobody declared
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_splits_inside_the_shared_tree() -> None:
    other = SYSTEM[:8] + [5, 5, 5, 5]
    cache, alloc = make(SYSTEM, other)
    put(cache, alloc, SYSTEM + [7, 7], salt="tenant-a")
    pages = put(cache, alloc, other + [1, 2, 3, 4], salt="tenant-b")
    assert cache.match_prefix(other, salt="tenant-c").num_tokens == 12
    assert cache.match_prefix(SYSTEM, salt="tenant-c").num_tokens == 12
    assert cache.match_prefix(other + [1, 2, 3, 4], salt="tenant-b").pages[3] == pages[3]
    cache.check_integrity()


def test_declaration_file(tmp_path: Path) -> None:
    good = tmp_path / "shared.yaml"
    good.write_text("- ids: [1, 2, 3, 4, 5]\n- text: |\n    You are a helpful assistant.\n")
    assert read_entries(good) == [("ids", [1, 2, 3, 4, 5]), ("text", "You are a helpful assistant.\n")]
    for bad in ("[]", "- {ids: []}", "- {ids: [1, -2]}", "- {text: ''}", "- {prompt: x}", "- {ids: [1], text: a}",
                "{ids: [1]}", "- [1, 2"):
        good.write_text(bad)
        with pytest.raises(ConfigError, match="shared prefix file"):
            read_entries(good)
    with pytest.raises(ConfigError, match="fills one page"):
        good.write_text("- ids: [1, 2]\n")
        SharedPrefixes.from_file(good, None, PS)
