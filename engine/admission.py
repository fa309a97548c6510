"""Admission: the prefix a queued request brings before it runs, and the loads that fetch it.

A request queued here is matched in the local radix cache at once, and each loading hook (the KV
connector, engine/hooks.py ``LoadingHook``) is asked to ``start`` fetching what follows (prefetch):
the request waits in ``Status.LOADING`` while the step loop goes on with everyone else. Each step
``poll`` asks the hooks, on the engine thread, what came in and applies it; the request then holds
its prefix (pages and radix lock) until it is admitted, when the plain hooks (CacheBlend) propose
once, after every load. When pages run short, the scheduler has the newest queued request give its
prefix back (engine/cache_manager.py ``reclaim``) and it matches again when its turn comes.

The admitter owns the hooks (their order and their turns, ``Admission.next_hook``) and the loads in
flight; the queues are the scheduler's, and every page, radix lock and applied proposal goes through
the CacheManager. The pages of a load whose request went away are freed only once the hook's poll
says its worker is done with them (``draining``): a late write never lands in a page someone else owns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from engine.cache_manager import CacheManager
from engine.config import EngineConfig
from engine.hooks import AdmissionHook, LoadingHook, PrefixExtension
from engine.request import Admission, PromptUsage, Request, Status

#: (tokens to feed, tokens cached) of the prefill work queued ahead of a request (the scheduler's)
PrefillAhead = Callable[[Request], list[tuple[int, int]]]


class Admitter:
    """The hooks, the loads in flight, and the record of what each queued request's prefix holds."""

    def __init__(self, config: EngineConfig, cache: CacheManager, prefill_ahead: PrefillAhead) -> None:
        self.cfg = config
        self.cache = cache
        self._prefill_ahead = prefill_ahead
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

    @property
    def prefetches(self) -> bool:
        """Some hook loads: a queued request's prefix is matched and its loads start at queue time."""
        return self._n_loading > 0

    def busy(self) -> bool:
        """Loads are in flight (a step with nothing to run should wait on ``wake``, not spin)."""
        return bool(self.loading or self.draining)

    # -- the prefix a queued request brings -------------------------------------------------
    def _match(self, req: Request) -> None:
        """Match the cached prefix (the request then holds it) and start or update its record."""
        rec = req.admission
        matched = self.cache.match(req, record_stats=req.num_preemptions == 0 and rec is None)
        if rec is None:
            req.admission = Admission(matched)
        else:  # matched again after giving its prefix back: what it loaded then may be a radix hit now
            rec.exact = min(rec.exact, max(matched - rec.radix, 0))
            rec.radix, rec.approx, rec.next_hook = matched - rec.exact, 0, 0

    def begin(self, req: Request) -> bool:
        """Match the prefix of a queued request and start its loading hooks; False (nothing done)
        while every fetch slot is taken (as many loads in flight as requests may run)."""
        if not self._n_loading:
            return True
        if len(self.loading) >= self.cfg.max_num_seqs:
            return False
        self._match(req)
        self._advance(req)
        return True

    def prefetch(self, waiting: Iterable[Request]) -> None:
        """Begin the queued requests that wait for a fetch slot, in order, while slots are free (not
        one that gave its prefix back: it matches again at its turn, not in a loop with the reclaim)."""
        for req in waiting:
            if len(self.loading) >= self.cfg.max_num_seqs:
                return
            if req.status is Status.WAITING and req.admission is None:
                self.begin(req)

    def _advance(self, req: Request) -> None:
        """Start the next loading hook that has something to fetch (the request goes LOADING)."""
        rec = req.admission
        assert rec is not None
        while rec.next_hook < self._n_loading:
            hook = self._hooks[rec.next_hook]
            if hook.start(req, self.cache.pages, self._prefill_ahead(req), self.wake.set):  # type: ignore[union-attr]
                req.status = Status.LOADING
                rec.loading = hook  # type: ignore[assignment]
                self.loading.append(req)
                return
            rec.next_hook += 1

    def poll(self) -> None:
        """Apply the loads that are in; free the pages of aborted requests' loads that are done."""
        for req in list(self.loading):
            rec = req.admission
            assert rec is not None
            assert rec.loading is not None
            res = rec.loading.poll(req, self.cache.pages)
            if not res.done:
                continue
            self.loading.remove(req)
            req.status, rec.loading = Status.WAITING, None
            rec.next_hook += 1
            if res.extension is not None:
                self._apply_counted(req, res.extension)
            self._advance(req)
        for req, hook in list(self.draining):
            res = hook.poll(req, self.cache.pages)
            if res.done:
                self.draining.remove((req, hook))
                if res.extension is not None:
                    self.cache.free(res.extension.pages)

    def _apply_counted(self, req: Request, ext: PrefixExtension) -> None:
        rec = req.admission
        assert rec is not None
        before = req.num_computed
        self.cache.apply_extension(req, ext)
        if ext.exact:
            rec.exact += req.num_computed - before
        else:
            rec.approx += req.num_computed - before

    def admit(self, req: Request) -> None:
        """The prefix the request holds (matched now if it holds none), then each plain hook once."""
        if req.radix_node is None:
            self._match(req)
        rec = req.admission
        assert rec is not None
        if rec.next_hook <= self._n_loading:
            rec.radix += self.cache.rematch(req)
        while rec.next_hook < len(self._hooks):
            hook = self._hooks[rec.next_hook]
            rec.next_hook += 1
            ext = hook.propose(req, self.cache.pages)  # type: ignore[union-attr]
            if ext is not None:
                self._apply_counted(req, ext)
        if req.usage is None:  # usage reports the first admission (a preempted one recomputes)
            req.usage = self._usage(req, rec)

    # -- a request going away ---------------------------------------------------------------
    def cancel(self, req: Request) -> None:
        """A queued request went away: its load in flight (if any) is cancelled, its pages freed once
        the hook's worker is done with them (``draining``)."""
        if req not in self.loading:
            return
        self.loading.remove(req)
        hook = req.admission.loading if req.admission is not None else None
        assert hook is not None
        hook.cancel(req)
        self.draining.append((req, hook))

    def on_finish(self, req: Request) -> None:
        """Every hook is told, before the request's pages are released."""
        for hook in self._hooks:
            hook.on_finish(req)

    @staticmethod
    def _usage(req: Request, rec: Admission) -> PromptUsage:
        """What the scheduler saw (radix match, exact and approximate extensions it applied), refined
        by the plug-ins' states (which tier, what of an approximate extension was reused). The engine
        computed none of an extension's KV, so until a plug-in says otherwise it all counts as reused."""
        usage = PromptUsage(len(req.prompt_ids), radix=rec.radix, loaded=rec.exact, approximate=rec.approx,
                            reused_approx=rec.approx)
        for st in req.extras.values():
            usage = st.account(usage)
        return usage
