"""Continuous batching with chunked prefill, radix prefix reuse and preemption by recompute.

Every step the scheduler hands the engine a list of (request, n_tokens) to feed:
  1. every running request that is decoding feeds its one token (pages permitting; when
     the pool is full it evicts radix leaves, then preempts the newest running request);
  2. running requests still in prefill take chunks from the step's token budget;
  3. waiting requests are admitted first-come-first-served while budget and seats remain:
     the radix cache supplies the longest cached prefix, then each admission hook in order
     (engine/hooks.py; the order is the composition root's) proposes what it can add and
     ``apply_extension`` applies it; the rest is prefilled in chunks.
A finished request gives its full pages to the radix cache; a preempted one does too, so its
recompute can hit whatever survives eviction.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.errors import PromptTooLongError
from engine.hooks import AdmissionHook, PrefixExtension
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import PromptUsage, Request, Status

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, radix: RadixCache, max_model_len: int) -> None:
        self.cfg = config
        self.pool = pool
        self.radix = radix
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hooks: list[AdmissionHook] = []  # called in this order; set by the composition root
        self.page_size = pool.page_size
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.pool.page_size

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length {self.max_model_len}", "max_tokens")
        if total > self.capacity_tokens():
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV pool "
                f"({self.capacity_tokens()} tokens); raise --kv-memory", "max_tokens")

    def add(self, req: Request) -> None:
        self.check_fits(len(req.prompt_ids), req.params.max_tokens)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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

    # -- lifecycle ----------------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        """Match the cached prefix; the request keeps refs on those pages and locks the node."""
        ids = req.all_ids
        m = self.radix.match_prefix(ids[:-1], record_stats=req.num_preemptions == 0, salt=req.cache_salt)
        self.pool.allocator.incref(m.pages)
        self.radix.lock(m.node)
        req.radix_node = m.node
        req.pages = list(m.pages)
        req.num_computed = m.num_tokens
        req.cache_limit = None
        exact = approx = 0
        for hook in self.hooks:
            ext = hook.propose(req, self)
            if ext is not None:
                before = req.num_computed
                self.apply_extension(req, ext)
                if ext.exact:
                    exact += req.num_computed - before
                else:
                    approx += req.num_computed - before
        if req.num_preemptions == 0:  # usage reports the first admission (a preempted one recomputes)
            req.usage = self._usage(req, m.num_tokens, exact, approx)
        req.status = Status.RUNNING

    @staticmethod
    def _usage(req: Request, radix: int, exact: int, approx: int) -> PromptUsage:
        """What the scheduler saw (radix match, exact and approximate extensions it applied), refined
        by the plug-ins' states (which tier, what of an approximate extension was reused). The engine
        computed none of an extension's KV, so until a plug-in says otherwise it all counts as reused."""
        usage = PromptUsage(len(req.prompt_ids), radix=radix, loaded=exact, approximate=approx, reused_approx=approx)
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

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            for hook in self.hooks:
                hook.on_finish(req)
        if req.pages or req.radix_node is not None:
            self._release(req, cache=True)

    def preempt(self, req: Request) -> None:
        log.info("preempting %s (%d tokens computed) to free pages", req.rid, req.num_computed)
        self.running.remove(req)
        self._release(req, cache=True)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def abort(self, rid: str) -> Request | None:
        for req in list(self.running) + list(self.waiting):
            if req.rid == rid:
                self.finish(req, "abort")
                return req
        return None

    # -- the step plan ------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        plan: list[tuple[Request, int]] = []
        budget = self.cfg.max_prefill_tokens
        # 1. decodes, oldest first; preempt the newest when pages run out
        for req in sorted((r for r in self.running if r.remaining == 1), key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue
            while not self._grow(req, req.num_tokens):
                victims = [r for r in self.running if r is not req and r.status is Status.RUNNING]
                victim = max(victims, key=lambda r: r.arrival) if victims else req
                self.preempt(victim)
                plan = [(r, n) for r, n in plan if r is not victim]
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                plan.append((req, 1))
        budget = max(budget - len(plan), 0)
        # 2. running prefills continue
        for req in sorted((r for r in self.running if r.remaining > 1), key=lambda r: r.arrival):
            if budget <= 0:
                break
            n = min(req.remaining, budget)
            if not self._grow(req, req.num_computed + n):
                continue
            plan.append((req, n))
            budget -= n
        # 3. admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            self._admit(req)
            n = min(req.remaining, budget)
            if not self._grow(req, req.num_computed + n):
                self._release(req, cache=False)
                req.num_computed = 0
                req.status = Status.WAITING
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        if not plan and len(self.running) > 1:
            # every running prefill is stuck waiting for pages: free some by preempting the newest
            self.preempt(max(self.running, key=lambda r: r.arrival))
            return self.schedule()
        return plan
