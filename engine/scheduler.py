"""Continuous batching with chunked prefill, radix prefix reuse, asynchronous loads and preemption.

Every step the scheduler hands the engine a list of (request, n_tokens) to feed:
  0. loads in flight are polled: a finished one's extension is applied (``apply_extension``) and
     its request may be admitted; an aborted request's load pages are freed once its hook's
     worker has let go of them (``draining``);
  1. every running request that is decoding feeds its one token (pages permitting; when
     the pool is full it evicts radix leaves, then takes back the prefix a queued request
     holds, then preempts the newest running request);
  2. running requests still in prefill take chunks from the step's token budget, in the same fair
     order (of which another tenant's streams, and the step's first prompt, bound what a tenant's
     prompts may take: engine/step_budget.py);
  3. waiting requests are admitted in a fair order (``fair``: first come first served within a
     tenant, and the tenant with the fewest requests in the engine first) while budget and seats
     remain, skipping those still LOADING: each brings the prefix it holds (radix match, then what the
     loading hooks fetched), then each plain admission hook in order proposes what it can add
     and ``apply_extension`` applies it; the rest is prefilled in chunks.
A request's prefix is matched as soon as it is queued, and the loading hooks (the KV connector,
engine/hooks.py ``LoadingHook``) start fetching the rest off the engine thread at once (prefetch):
while it is LOADING the step loop goes on with everyone else. The hook order is the composition
root's; loading hooks come first.
A finished request gives its full pages to the radix cache; a preempted one does too, so its
recompute can hit whatever survives eviction.

The scheduler owns the queues (``waiting``, ``running``) and the step plan; it holds the
CacheManager (engine/cache_manager.py: every page, radix lock and applied proposal) and the
Admitter (engine/admission.py: the hooks and the loads in flight) rather than being either.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping

from engine.admission import Admitter
from engine.cache_manager import CacheManager
from engine.config import EngineConfig
from engine.errors import PromptTooLongError
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import Request, Status
from engine.step_budget import StepBudget, StepCost

log = logging.getLogger(__name__)


def tenant_demand(in_engine: Iterable[Request]) -> Counter[str]:
    """Requests in the engine (running and queued) per tenant: what ``fair`` orders by and what
    engine/step_budget.py ``StepBudget`` bounds by. Counted once a step."""
    return Counter(r.tenant for r in in_engine)


def fair(reqs: Iterable[Request], demand: Mapping[str, int]) -> list[Request]:
    """``reqs`` with the tenants that have the fewest requests in the engine (``demand``:
    ``tenant_demand``) first, each tenant's in arrival order. One tenant (or none: no API keys):
    ``reqs`` as they are. A tenant's one request is not queued behind another tenant's flood of them."""
    reqs = list(reqs)
    if len({r.tenant for r in reqs}) < 2:
        return reqs
    return sorted(reqs, key=lambda r: (demand.get(r.tenant, 0), r.arrival))


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, radix: RadixCache, max_model_len: int) -> None:
        self.cfg = config
        # a load's partial take (PageSource.alloc_upto) leaves a page per running request: the next
        # step's decodes take theirs without preempting anyone
        self.cache = CacheManager(pool, radix, headroom=lambda: len(self.running))
        self.admitter = Admitter(config, self.cache, self._prefill_ahead)
        self.waiting: deque[Request] = deque()  # queued, LOADING ones included, in arrival order
        self.running: list[Request] = []
        self.max_model_len = max_model_len
        self.num_preemptions = 0
        self.step_cost = StepCost()  # learnt from each step (LLMEngine._step): what a prompt token costs a stream

    @property
    def wake(self) -> threading.Event:
        return self.admitter.wake

    # -- queue management ---------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.cache.capacity_tokens()

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
        self.admitter.begin(req)  # prefetch: the loads start now, not when the request reaches the head

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.admitter.draining)

    def waiting_on_loads(self) -> bool:
        """Loads are in flight (a step with nothing to run should wait on ``wake``, not spin)."""
        return self.admitter.busy()

    def _prefill_ahead(self, req: Request) -> list[tuple[int, int]]:
        """(tokens to feed, tokens cached) of the prefill work ahead of ``req``: running prefills and
        the queued requests before it that are not loading (a loading one's share is not known yet)."""
        ahead = [(r.remaining, r.num_computed) for r in self.running if r.remaining > 1]
        for r in fair(self.waiting, tenant_demand([*self.running, *self.waiting])):
            if r is req:
                break
            if r.status is Status.WAITING:
                ahead.append((r.num_tokens - r.num_computed, r.num_computed))
        return ahead

    def _reclaim(self) -> bool:
        """The newest queued request holding a prefix (not a loading one) gives it back."""
        return self.cache.reclaim(r for r in reversed(self.waiting) if r.status is Status.WAITING)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.admitter.cancel(req)  # its hook's worker may still write into the load's pages
        if req.pages:
            self.admitter.on_finish(req)
        if req.pages or req.radix_node is not None:
            self.cache.release(req, cache=True)
        req.admission = None

    def preempt(self, req: Request) -> None:
        log.info("preempting %s (%d tokens computed) to free pages", req.rid, req.num_computed)
        self.running.remove(req)
        self.cache.release(req, cache=True)
        req.num_computed = 0
        req.admission = None
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
        adm, cache = self.admitter, self.cache
        adm.wake.clear()  # a load finishing from here on wakes the next wait
        if adm.busy():
            adm.poll()
        if adm.prefetches:
            adm.prefetch(self.waiting)
        plan: list[tuple[Request, int]] = []
        budget = self.cfg.max_prefill_tokens
        # 1. decodes, oldest first; take back queued prefixes, then preempt the newest, when pages run out
        for req in sorted((r for r in self.running if r.remaining == 1), key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue
            while not cache.grow(req, req.num_tokens):
                if self._reclaim():
                    continue
                victims = [r for r in self.running if r is not req and r.status is Status.RUNNING]
                victim = max(victims, key=lambda r: r.arrival) if victims else req
                self.preempt(victim)
                plan = [(r, n) for r, n in plan if r is not victim]
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                plan.append((req, 1))
        share = self.cfg.cross_tenant_step_share
        cross = self.step_cost.cross_tokens(share, self.cfg.page_size) if share > 0 else None
        demand = tenant_demand([*self.running, *self.waiting])
        prefills = fair(sorted((r for r in self.running if r.remaining > 1), key=lambda r: r.arrival), demand)
        # the tenant first in the fair order of the step's prompts is protected as the decoding ones are
        head = fair([*prefills, *(r for r in self.waiting if r.status is Status.WAITING)], demand)[:1]
        budget = StepBudget(budget - len(plan), cross, [*(r.tenant for r, _ in plan), *(r.tenant for r in head)],
                            demand)
        # 2. running prefills continue, in the fair order
        for req in prefills:
            if budget.total <= 0:
                break
            n = min(req.remaining, budget.allows(req))
            if n <= 0 or not cache.grow(req, req.num_computed + n):
                continue
            plan.append((req, n))
            budget.take(req, n)
        # 3. admit waiting requests in the fair order; a LOADING one is passed over until its load is
        # in, a cross-tenant one (engine/step_budget.py) once the step has no room left for it
        for req in fair(self.waiting, demand):
            if budget.total <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if req.status is Status.LOADING or budget.allows(req) <= 0:
                continue
            if req.radix_node is None and adm.prefetches:
                if not adm.begin(req):
                    break  # no fetch slot: it starts loading when one frees, in order
                if req.status is Status.LOADING:
                    continue
            adm.admit(req)
            n = min(req.remaining, budget.allows(req))
            if not cache.grow(req, req.num_computed + n):
                break  # it keeps its prefix until pages free (or they are reclaimed below)
            self.waiting.remove(req)
            req.admission = None
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, n))
            budget.take(req, n)
        if not plan:  # stuck waiting for pages
            if self._reclaim():
                return plan  # a queued request gave its prefix back: the next step has its pages
            if len(self.running) > 1:  # every running prefill is stuck: preempt the newest
                self.preempt(max(self.running, key=lambda r: r.arrival))
                return self.schedule()
        return plan
