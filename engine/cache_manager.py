"""CacheManager: the one owner of page state.

It holds the page allocator's references and the radix tree, and it alone changes the pages and
the radix lock a request holds: fresh pages (``alloc``, ``grow``; hooks get the two-method
``PageSource`` ``pages``), the hold on a cached prefix (``match``, ``rematch``), giving it back
(``release``, ``reclaim``) and the one place a hook's proposal becomes request state
(``apply_extension``). The queues are the scheduler's (engine/scheduler.py), the loads and the
hooks' turns the admitter's (engine/admission.py); neither touches a refcount or a radix lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from engine.hooks import PrefixExtension
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import Request

log = logging.getLogger(__name__)


class HookPages:
    """The ``PageSource`` (engine/hooks.py) handed to hooks: fresh pages (radix leaves are evicted if
    needed) and giving back the ones not handed over; nothing else of the cache."""

    __slots__ = ("_alloc", "_alloc_upto", "_free")

    def __init__(self, alloc: Callable[[int], list[int] | None], alloc_upto: Callable[[int], list[int]],
                 free: Callable[[Sequence[int]], None]) -> None:
        self._alloc, self._alloc_upto, self._free = alloc, alloc_upto, free

    def alloc(self, n: int) -> list[int] | None:
        return self._alloc(n)

    def alloc_upto(self, n: int) -> list[int]:
        return self._alloc_upto(n)

    def free(self, pages: Sequence[int]) -> None:
        self._free(pages)


class CacheManager:
    def __init__(self, pool: KVPool, radix: RadixCache, headroom: Callable[[], int] = lambda: 0) -> None:
        """``headroom()``: pages ``alloc_upto`` leaves to others (the scheduler's: one per running
        request, so that its next decodes never preempt anyone for a partial load's sake)."""
        self.pool = pool
        self.radix = radix
        self.headroom = headroom
        self.page_size = pool.page_size
        self.pages = HookPages(self.alloc, self.alloc_upto, self.free)  # what hooks get

    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    # -- fresh pages ------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages, evicting radix leaves if needed; None if even that is not enough."""
        alloc = self.pool.allocator
        if n > alloc.num_free():
            self.radix.evict(n - alloc.num_free())
        return alloc.alloc(n)

    def alloc_upto(self, n: int) -> list[int]:
        """At most n fresh pages: as many as the free list and the evictable radix leaves give, less
        ``headroom()`` of them left for others."""
        alloc = self.pool.allocator
        want = min(n, alloc.num_free() + self.radix.evictable_pages() - self.headroom())
        if want <= 0:
            return []
        if want > alloc.num_free():
            self.radix.evict(want - alloc.num_free())
        return alloc.alloc(min(want, alloc.num_free())) or []

    def free(self, pages: Sequence[int]) -> None:
        """Give back pages taken with ``alloc`` and not handed over."""
        self.pool.allocator.decref(list(pages))

    def grow(self, req: Request, upto: int) -> bool:
        """Pages for the request's first ``upto`` tokens; False (nothing taken) if the pool is short."""
        need = max(0, -(-upto // self.page_size) - len(req.pages))
        if need == 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    # -- the hold on a cached prefix ----------------------------------------------------------
    def match(self, req: Request, record_stats: bool) -> int:
        """Match the cached prefix: the request takes refs on those pages and locks the node, and holds
        nothing else (``cache_limit`` cleared). Returns the tokens matched."""
        m = self.radix.match_prefix(req.all_ids[:-1], record_stats=record_stats, salt=req.cache_salt)
        self.pool.allocator.incref(m.pages)
        self.radix.lock(m.node)
        req.radix_node = m.node
        req.pages = list(m.pages)
        req.num_computed = m.num_tokens
        req.cache_limit = None
        return m.num_tokens

    def rematch(self, req: Request) -> int:
        """A request holding an exact, page-aligned prefix takes a longer one if the radix tree has it
        now (a request ahead of it computed the same tokens meanwhile). Returns the tokens gained."""
        ps = self.page_size
        if req.cache_limit is not None or req.num_computed % ps or len(req.pages) * ps != req.num_computed:
            return 0
        m = self.radix.match_prefix(req.all_ids[:-1], record_stats=False, salt=req.cache_salt)
        if m.num_tokens <= req.num_computed:
            return 0
        self.pool.allocator.incref(m.pages)
        self.radix.lock(m.node)
        old_pages, old_node = req.pages, req.radix_node
        assert old_node is not None
        gained = m.num_tokens - req.num_computed
        req.pages, req.radix_node, req.num_computed = list(m.pages), m.node, m.num_tokens
        self.radix.unlock(old_node)
        self.pool.allocator.decref(old_pages)
        return gained

    def release(self, req: Request, cache: bool) -> None:
        """Drop the request's hold on its pages, first giving full exact pages to the radix tree."""
        ps = self.page_size
        if cache:
            n_full = min(req.exact_tokens // ps, len(req.pages))
            if n_full:
                self.radix.insert(req.all_ids[: n_full * ps], req.pages[:n_full], salt=req.cache_salt)
        if req.radix_node is not None:
            self.radix.unlock(req.radix_node)
            req.radix_node = None
        self.pool.allocator.decref(req.pages)
        req.pages = []

    def reclaim(self, queued: Iterable[Request]) -> bool:
        """Pages are short: the first of ``queued`` (the scheduler's newest queued, none loading) that
        holds a prefix gives it back (its KV stays in the radix tree, evictable) and starts over at
        its next admission. False: none holds one."""
        for req in queued:
            if req.radix_node is not None:
                self.release(req, cache=True)
                req.num_computed = 0
                req.cache_limit = None
                return True
        return False

    # -- a hook's proposal ----------------------------------------------------------------------
    def apply_extension(self, req: Request, ext: PrefixExtension) -> bool:
        """The one place a hook's proposal becomes request state: the request takes the pages'
        references (surplus pages go back), exact KV enters the radix tree at once (so requests
        admitted next share it) and the request re-locks the deeper node; approximate KV moves
        the exact/approximate boundary (``cache_limit``), which every later cache or offload honours.

        Nothing may follow a partial page or approximate KV: such an extension is refused (False, its
        pages freed), or a later exact one would put approximate KV into the radix tree. A malformed
        one raises ValueError (its pages freed too)."""
        ps = self.page_size
        used = -(-ext.tokens // ps)
        if ext.tokens < 0 or used > len(ext.pages) or (ext.exact and ext.tokens % ps):
            self.free(ext.pages)
            raise ValueError(f"bad extension: {ext.tokens} tokens ({'exact' if ext.exact else 'approximate'}) "
                             f"in {len(ext.pages)} pages of {ps}")
        if req.cache_limit is not None:
            self.free(ext.pages)
            log.warning("%s: extension after approximate KV (past token %d) dropped", req.rid, req.cache_limit)
            return False
        if req.num_computed % ps or len(req.pages) * ps != req.num_computed:
            self.free(ext.pages)
            log.warning("%s: extension after a non-page-aligned prefix (%d tokens) dropped", req.rid,
                        req.num_computed)
            return False
        self.free(ext.pages[used:])
        if used == 0:
            return True
        start = req.num_computed
        req.pages.extend(ext.pages[:used])
        req.num_computed += ext.tokens
        if not ext.exact:
            req.cache_limit = start + min(ext.exact_head, ext.tokens)
            return True
        ids = req.all_ids[: req.num_computed]
        self.radix.insert(ids, req.pages[: req.num_computed // ps], salt=req.cache_salt)
        m = self.radix.match_prefix(ids, record_stats=False, salt=req.cache_salt)
        self.radix.lock(m.node)
        if req.radix_node is not None:
            self.radix.unlock(req.radix_node)
        req.radix_node = m.node
        return True
