"""Admission: the prefix a queued request brings before it runs, and the loads that fetch it.

A request queued here is matched in the local radix cache at once, and each loading hook (the KV
connector, engine/hooks.py ``LoadingHook``) is asked to ``start`` fetching what follows (prefetch):
the request waits in ``Status.LOADING`` while the step loop goes on with everyone else. Each step
``_poll_loads`` asks the hooks, on the engine thread, what came in and applies it; the request
then holds its prefix (pages and radix lock) until it is admitted, when the plain hooks (CacheBlend)
propose once, after every load. When pages run short, the newest queued request gives its prefix
back (``_reclaim``; its loaded KV stays in the radix tree) and matches again when its turn comes.

Every page a request or hook gets comes from here (``alloc``, the hooks' ``PageSource``), and every
proposal becomes request state in ``apply_extension`` alone. The pages of a load whose request went
away are freed only once the hook's poll says its worker is done with them (``draining``): a late
write never lands in a page someone else owns.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence

from engine.config import EngineConfig
from engine.hooks import AdmissionHook, LoadingHook, PrefixExtension
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import Admission, PromptUsage, Request, Status

log = logging.getLogger(__name__)


class Admitter:
    """The queue, its loads in flight, and the pages and prefixes queued requests hold."""

    def __init__(self, config: EngineConfig, pool: KVPool, radix: RadixCache) -> None:
        self.cfg = config
        self.pool = pool
        self.radix = radix
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()  # queued, LOADING ones included, in arrival order
        self.running: list[Request] = []
        self.loading: list[Request] = []  # queued with a loading hook's fetch in flight
        self.draining: list[tuple[Request, LoadingHook]] = []  # finished while loading: pages freed when done
        self._hooks: list[AdmissionHook | LoadingHook] = []
        self._n_loading = 0  # hooks[:_n_loading] are loading hooks
        #: set by a loading hook's worker when a poll has news (and by the AsyncEngine's callers):
        #: a step with nothing to run waits on it instead of spinning
        self.wake = threading.Event()

    @property
    def hooks(self) -> list[AdmissionHook | LoadingHook]:
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: Iterable[AdmissionHook | LoadingHook]) -> None:
        """Called in this order; set by the composition root. Loading hooks must come first: they
        start at queue time, the plain ones propose at admission, after every load is in."""
        hooks = list(hooks)
        kinds = [isinstance(h, LoadingHook) for h in hooks]
        if kinds != sorted(kinds, reverse=True):
            raise ValueError(f"loading hooks must come before plain admission hooks: {hooks}")
        self._hooks, self._n_loading = hooks, sum(kinds)

    # -- pages --------------------------------------------------------------------------
    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.pool.page_size) - len(req.pages))

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages, evicting radix leaves if needed; None if even that is not enough."""
        alloc = self.pool.allocator
        if n > alloc.num_free():
            self.radix.evict(n - alloc.num_free())
        return alloc.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        """Give back pages taken with ``alloc`` and not handed over (PageSource)."""
        self.pool.allocator.decref(list(pages))

    def _grow(self, req: Request, upto: int) -> bool:
        need = self._pages_needed(req, upto)
        if need == 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _release(self, req: Request, cache: bool) -> None:
        """Drop the request's hold on its pages, first giving full computed pages to the radix."""
        ps = self.pool.page_size
        if cache:
            n_full = min(req.exact_tokens // ps, len(req.pages))
            if n_full:
                self.radix.insert(req.all_ids[: n_full * ps], req.pages[:n_full], salt=req.cache_salt)
        if req.radix_node is not None:
            self.radix.unlock(req.radix_node)
            req.radix_node = None
        self.pool.allocator.decref(req.pages)
        req.pages = []

    # -- the prefix a queued request brings -------------------------------------------------
    def _match(self, req: Request) -> None:
        """Match the cached prefix; the request keeps refs on those pages and locks the node."""
        m = self.radix.match_prefix(req.all_ids[:-1], record_stats=req.num_preemptions == 0 and req.admission is None,
                                    salt=req.cache_salt)
        self.pool.allocator.incref(m.pages)
        self.radix.lock(m.node)
        req.radix_node = m.node
        req.pages = list(m.pages)
        req.num_computed = m.num_tokens
        req.cache_limit = None
        rec = req.admission
        if rec is None:
            req.admission = Admission(m.num_tokens)
        else:  # matched again after giving its prefix back: what it loaded then may be a radix hit now
            rec.exact = min(rec.exact, max(m.num_tokens - rec.radix, 0))
            rec.radix, rec.approx, rec.next_hook = m.num_tokens - rec.exact, 0, 0

    def _begin(self, req: Request) -> bool:
        """Match the prefix of a queued request and start its loading hooks; False (nothing done)
        while every fetch slot is taken (as many loads in flight as requests may run)."""
        if not self._n_loading:
            return True
        if len(self.loading) >= self.cfg.max_num_seqs:
            return False
        self._match(req)
        self._advance(req)
        return True

    def _prefetch(self) -> None:
        """Begin the queued requests that wait for a fetch slot, in order, while slots are free (not
        one that gave its prefix back: it matches again at its turn, not in a loop with the reclaim)."""
        for req in self.waiting:
            if len(self.loading) >= self.cfg.max_num_seqs:
                return
            if req.status is Status.WAITING and req.admission is None:
                self._begin(req)

    def _advance(self, req: Request) -> None:
        """Start the next loading hook that has something to fetch (the request goes LOADING)."""
        rec = req.admission
        assert rec is not None
        while rec.next_hook < self._n_loading:
            hook = self._hooks[rec.next_hook]
            if hook.start(req, self, self._prefill_ahead(req), self.wake.set):  # type: ignore[union-attr]
                req.status = Status.LOADING
                rec.loading = hook  # type: ignore[assignment]
                self.loading.append(req)
                return
            rec.next_hook += 1

    def _prefill_ahead(self, req: Request) -> list[tuple[int, int]]:
        """(tokens to feed, tokens cached) of the prefill work ahead of ``req``: running prefills and
        the queued requests before it that are not loading (a loading one's share is not known yet)."""
        ahead = [(r.remaining, r.num_computed) for r in self.running if r.remaining > 1]
        for r in self.waiting:
            if r is req:
                break
            if r.status is Status.WAITING:
                ahead.append((r.num_tokens - r.num_computed, r.num_computed))
        return ahead

    def _poll_loads(self) -> None:
        """Apply the loads that are in; free the pages of aborted requests' loads that are done."""
        for req in list(self.loading):
            rec = req.admission
            assert rec is not None
            assert rec.loading is not None
            res = rec.loading.poll(req, self)
            if not res.done:
                continue
            self.loading.remove(req)
            req.status, rec.loading = Status.WAITING, None
            rec.next_hook += 1
            if res.extension is not None:
                self._apply_counted(req, res.extension)
            self._advance(req)
        for req, hook in list(self.draining):
            res = hook.poll(req, self)
            if res.done:
                self.draining.remove((req, hook))
                if res.extension is not None:
                    self.free(res.extension.pages)

    def _apply_counted(self, req: Request, ext: PrefixExtension) -> None:
        rec = req.admission
        assert rec is not None
        before = req.num_computed
        self.apply_extension(req, ext)
        if ext.exact:
            rec.exact += req.num_computed - before
        else:
            rec.approx += req.num_computed - before

    def _rematch(self, req: Request) -> None:
        """A request queued with its prefix held takes a longer one if the radix tree has it now
        (a request ahead of it computed the same tokens meanwhile)."""
        ps = self.page_size
        if req.cache_limit is not None or req.num_computed % ps or len(req.pages) * ps != req.num_computed:
            return
        m = self.radix.match_prefix(req.all_ids[:-1], record_stats=False, salt=req.cache_salt)
        if m.num_tokens <= req.num_computed:
            return
        self.pool.allocator.incref(m.pages)
        self.radix.lock(m.node)
        old_pages, old_node = req.pages, req.radix_node
        rec = req.admission
        assert rec is not None and old_node is not None
        rec.radix += m.num_tokens - req.num_computed
        req.pages, req.radix_node, req.num_computed = list(m.pages), m.node, m.num_tokens
        self.radix.unlock(old_node)
        self.pool.allocator.decref(old_pages)

    def _admit(self, req: Request) -> None:
        """The prefix the request holds (matched now if it holds none), then each plain hook once."""
        if req.radix_node is None:
            self._match(req)
        rec = req.admission
        assert rec is not None
        if rec.next_hook <= self._n_loading:
            self._rematch(req)
        while rec.next_hook < len(self._hooks):
            hook = self._hooks[rec.next_hook]
            rec.next_hook += 1
            ext = hook.propose(req, self)  # type: ignore[union-attr]
            if ext is not None:
                self._apply_counted(req, ext)
        if req.usage is None:  # usage reports the first admission (a preempted one recomputes)
            req.usage = self._usage(req, rec)

    def _reclaim(self) -> bool:
        """Pages are short: the newest queued request holding a prefix gives it back (loaded KV stays
        in the radix tree, evictable); it matches again when its turn comes. False: none holds one."""
        for req in reversed(self.waiting):
            if req.status is Status.WAITING and req.radix_node is not None:
                self._release(req, cache=True)
                req.num_computed = 0
                req.cache_limit = None
                return True
        return False

    @staticmethod
    def _usage(req: Request, rec: Admission) -> PromptUsage:
        """What the scheduler saw (radix match, exact and approximate extensions it applied), refined
        by the plug-ins' states (which tier, what of an approximate extension was reused). The engine
        computed none of an extension's KV, so until a plug-in says otherwise it all counts as reused."""
        usage = PromptUsage(len(req.prompt_ids), radix=rec.radix, loaded=rec.exact, approximate=rec.approx,
                            reused_approx=rec.approx)
        for st in (req.kv, req.blend):
            if st is not None:
                usage = st.account(usage)
        return usage

    def apply_extension(self, req: Request, ext: PrefixExtension) -> None:
        """The one place a hook's proposal becomes request state: the request takes the pages'
        references (surplus pages go back), exact KV enters the radix tree at once (so requests
        admitted next share it) and the request re-locks the deeper node; approximate KV moves
        the exact/approximate boundary (``cache_limit``), which every later cache or offload honours."""
        ps = self.page_size
        used = -(-ext.tokens // ps)
        if ext.tokens < 0 or used > len(ext.pages) or (ext.exact and ext.tokens % ps):
            self.free(ext.pages)
            raise ValueError(f"bad extension: {ext.tokens} tokens ({'exact' if ext.exact else 'approximate'}) "
                             f"in {len(ext.pages)} pages of {ps}")
        if req.num_computed % ps or len(req.pages) * ps != req.num_computed:
            self.free(ext.pages)  # nothing may follow a partial page or an approximate extension
            log.warning("%s: extension after a non-page-aligned prefix (%d tokens) dropped", req.rid,
                        req.num_computed)
            return
        self.free(ext.pages[used:])
        if used == 0:
            return
        start = req.num_computed
        req.pages.extend(ext.pages[:used])
        req.num_computed += ext.tokens
        if not ext.exact:
            req.cache_limit = start + min(ext.exact_head, ext.tokens)
            return
        ids = req.all_ids[: req.num_computed]
        self.radix.insert(ids, req.pages[: req.num_computed // ps], salt=req.cache_salt)
        m = self.radix.match_prefix(ids, record_stats=False, salt=req.cache_salt)
        self.radix.lock(m.node)
        if req.radix_node is not None:
            self.radix.unlock(req.radix_node)
        req.radix_node = m.node

