"""Continuous batching with chunked prefill, radix prefix reuse, asynchronous loads and preemption.

Every step the scheduler hands the engine a list of (request, n_tokens) to feed:
  0. loads in flight are polled: a finished one's extension is applied (``apply_extension``) and
     its request may be admitted; an aborted request's load pages are freed once its hook's
     worker has let go of them (``draining``);
  1. every running request that is decoding feeds its one token (pages permitting; when
     the pool is full it evicts radix leaves, then takes back the prefix a queued request
     holds, then preempts the newest running request);
  2. running requests still in prefill take chunks from the step's token budget;
  3. waiting requests are admitted first-come-first-served while budget and seats remain,
     skipping those still LOADING: each brings the prefix it holds (radix match, then what the
     loading hooks fetched), then each plain admission hook in order proposes what it can add
     and ``apply_extension`` applies it; the rest is prefilled in chunks.
A request's prefix is matched as soon as it is queued, and the loading hooks (the KV connector,
engine/hooks.py ``LoadingHook``) start fetching the rest off the engine thread at once (prefetch):
while it is LOADING the step loop goes on with everyone else. The hook order is the composition
root's; loading hooks come first.
A finished request gives its full pages to the radix cache; a preempted one does too, so its
recompute can hit whatever survives eviction.
"""

from __future__ import annotations

import logging

from engine.admission import Admitter
from engine.config import EngineConfig
from engine.errors import PromptTooLongError
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import Request, Status

log = logging.getLogger(__name__)


class Scheduler(Admitter):
    def __init__(self, config: EngineConfig, pool: KVPool, radix: RadixCache, max_model_len: int) -> None:
        super().__init__(config, pool, radix)
        self.max_model_len = max_model_len
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
        self._begin(req)  # prefetch: the loads start now, not when the request reaches the head

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.draining)

    def waiting_on_loads(self) -> bool:
        """Loads are in flight (a step with nothing to run should wait on ``wake``, not spin)."""
        return bool(self.loading or self.draining)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if req in self.loading:  # its hook's worker may still write into the load's pages
                self.loading.remove(req)
                hook = req.admission.loading if req.admission is not None else None
                assert hook is not None
                hook.cancel(req)
                self.draining.append((req, hook))
        if req.pages:
            for hook in self._hooks:
                hook.on_finish(req)
        if req.pages or req.radix_node is not None:
            self._release(req, cache=True)
        req.admission = None

    def preempt(self, req: Request) -> None:
        log.info("preempting %s (%d tokens computed) to free pages", req.rid, req.num_computed)
        self.running.remove(req)
        self._release(req, cache=True)
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
        self.wake.clear()  # a load finishing from here on wakes the next wait
        if self.loading or self.draining:
            self._poll_loads()
        if self._n_loading:
            self._prefetch()
        plan: list[tuple[Request, int]] = []
        budget = self.cfg.max_prefill_tokens
        # 1. decodes, oldest first; take back queued prefixes, then preempt the newest, when pages run out
        for req in sorted((r for r in self.running if r.remaining == 1), key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue
            while not self._grow(req, req.num_tokens):
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
        # 3. admit waiting requests in order; a LOADING one is passed over until its load is in
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if req.status is Status.LOADING:
                continue
            if req.radix_node is None and self._n_loading:
                if not self._begin(req):
                    break  # no fetch slot: it starts loading when one frees, in order
                if req.status is Status.LOADING:
                    continue
            self._admit(req)
            n = min(req.remaining, budget)
            if not self._grow(req, req.num_computed + n):
                break  # it keeps its prefix until pages free (or they are reclaimed below)
            self.waiting.remove(req)
            req.admission = None
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        if not plan:  # stuck waiting for pages
            if self._reclaim():
                return plan  # a queued request gave its prefix back: the next step has its pages
            if len(self.running) > 1:  # every running prefill is stuck: preempt the newest
                self.preempt(max(self.running, key=lambda r: r.arrival))
                return self.schedule()
        return plan
