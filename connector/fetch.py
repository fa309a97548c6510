"""One request's load, off the engine thread, in three moves (the connector decides what they do).

  1. lookup + cost-model decision, on the lookup worker (``KVConnector.plan_load``);
  2. pages for the plan, on the engine thread (the allocator and the radix tree are not
     thread-safe): taken at the start for the pages the connector knows the daemon holds, and if
     the plan needs more, in the next poll; when the pool is short, retried every step until the
     load's deadline, then the plan shrinks to the leading pages the pool gives (the rest is
     recomputed);
  3. transfer, verify and write into those pages, on the transfer worker (``KVConnector.load``);
     when the pages taken at the start suffice, the lookup move queues it at once (no step has to
     end in between).

The request waits in LOADING throughout (engine/admission.py). A cancelled fetch (its request
went away) skips the moves it has not begun; pages handed to a transfer come back only in the
poll after the worker has returned, so the scheduler frees them after the last write into them.

Two single-thread workers, on purpose: a lookup never queues behind a transfer, and transfers run
one at a time in arrival order. A Loader is one stream (the daemon already fetches a multi-block
Get in parallel), and with one queue the cost model can price exactly what a new load waits for:
the bytes already queued or moving, per tier (``inflight``, on /metrics too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from connector.cost_model import Decision
from connector.metrics import ConnectorMetrics
from engine.hooks import NOTHING, PENDING, LoadPoll, PageSource, PrefixExtension
from engine.request import Request

if TYPE_CHECKING:
    from connector.connector import LoadPlan

log = logging.getLogger(__name__)

PlanFn = Callable[[Request, Sequence[tuple[int, int]]], "LoadPlan | None"]
LoadFn = Callable[[Request, "LoadPlan", list[int], float], int]


class Fetch:
    """The state of one request's load (in its KVState while the request is LOADING)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake  # tells the engine thread a poll has news (engine/admission.py)
        self.since = time.monotonic()
        self.future: Future | None = None  # the move running on a worker (None: the engine thread's turn)
        self.next: Future | None = None  # the transfer the lookup move queued itself (pages sufficed)
        self.plan: LoadPlan | None = None  # set by the lookup move (None: nothing worth loading)
        self.transferring = False  # the transfer move was handed ``pages``
        self.pages: list[int] = []  # taken for the transfer; the scheduler's again once it is done
        self.pages_ok = 0  # leading pages that arrived intact
        self.deadline_at = float("inf")  # monotonic; a transfer gets what is left of it
        self.cancelled = False


class Fetcher:
    def __init__(self, plan: PlanFn, load: LoadFn, deadline_s: Callable[[Decision], float],
                 metrics: ConnectorMetrics, page_size: int, bytes_per_page: int) -> None:
        self._plan, self._load, self._deadline_s = plan, load, deadline_s
        self.metrics = metrics
        self.page_size, self.bytes_per_page = page_size, bytes_per_page
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="tierkv-lookup")
        self._transfers = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}  # per tier, on the transfer stream (queued or moving)

    def inflight(self) -> dict[str, int]:
        with self._lock:
            return {t: n for t, n in self._bytes.items() if n > 0}

    def _count(self, plan: LoadPlan, sign: int) -> None:
        with self._lock:
            for t in plan.tiers:
                self._bytes[t or "?"] = self._bytes.get(t or "?", 0) + sign * self.bytes_per_page
            for t, n in self._bytes.items():
                self.metrics.inflight_bytes.labels(t).set(n)

    # -- engine thread ------------------------------------------------------------------------
    def start(self, req: Request, prefill_ahead: tuple[tuple[int, int], ...], wake: Callable[[], None],
              pages: list[int]) -> Fetch:
        """``pages``: taken for the transfer already (the scheduler's again in the extension)."""
        f = Fetch(wake)
        f.pages = pages
        f.future = self._lookups.submit(self._lookup_move, req, f, prefill_ahead)
        self.metrics.loads_inflight.inc()
        return f

    def poll(self, req: Request, f: Fetch, pages: PageSource) -> LoadPoll:
        if f.future is not None:
            if not f.future.done():
                return PENDING
            if f.future.cancelled():  # the connector closed before the move ran
                f.future = f.next = None
                return self._done(f)
            err, f.future, f.next = f.future.exception(), f.next, None
            if err is not None:
                log.error("%s: load failed unexpectedly: %r", req.rid, err)
                return self._done(f)
            if f.future is not None:  # the lookup move queued the transfer itself
                return PENDING
        if f.transferring or f.plan is None or f.cancelled:
            return self._done(f)
        need = len(f.plan.keys) - len(f.pages)
        fresh = pages.alloc(need)
        if fresh is None:  # the pool is short now: again next step, until the deadline
            if time.monotonic() < f.deadline_at:
                return PENDING
            # Past it, the leading pages the pool gives now load and only the rest is recomputed.
            # Giving up the whole load would not free the pool: the recompute needs the same pages,
            # and computing them costs far more than loading (bench.serve past its knee: a third of
            # the loads ended here and the engine recomputed whole prompts while loads waited).
            fresh = pages.alloc_upto(need)
            self.metrics.load_failures.labels("no_pages").inc()
            keep = len(f.pages) + len(fresh)
            if not keep:
                return self._done(f)
            f.plan = f.plan._replace(keys=f.plan.keys[:keep], tiers=f.plan.tiers[:keep])
            f.deadline_at = time.monotonic() + self._deadline_s(f.plan.decision)  # the transfer's own
        f.pages += fresh
        self._queue_transfer(req, f)
        f.future, f.next = f.next, None
        return PENDING

    def _queue_transfer(self, req: Request, f: Fetch) -> None:
        assert f.plan is not None
        f.transferring = True
        self._count(f.plan, +1)
        f.next = self._transfers.submit(self._transfer_move, req, f)

    def cancel(self, f: Fetch) -> None:
        if not f.cancelled:
            f.cancelled = True
            self.metrics.fetches.labels("cancelled").inc()

    def _done(self, f: Fetch) -> LoadPoll:
        self.metrics.loads_inflight.dec()
        self.metrics.loading_seconds.observe(time.monotonic() - f.since)
        if not f.cancelled:
            self.metrics.fetches.labels("loaded" if f.pages_ok else "nothing").inc()
        if not f.pages:
            return NOTHING
        return LoadPoll(True, PrefixExtension(f.pages, f.pages_ok * self.page_size, exact=True))

    # -- workers ------------------------------------------------------------------------------
    def _lookup_move(self, req: Request, f: Fetch, prefill_ahead: tuple[tuple[int, int], ...]) -> None:
        try:
            if not f.cancelled:
                f.plan = self._plan(req, prefill_ahead)
                if f.plan is not None:
                    f.deadline_at = time.monotonic() + self._deadline_s(f.plan.decision)
                    if len(f.pages) >= len(f.plan.keys):
                        self._queue_transfer(req, f)  # before this move ends: poll then adopts it
        finally:
            f.wake()

    def _transfer_move(self, req: Request, f: Fetch) -> None:
        assert f.plan is not None
        try:
            left = f.deadline_at - time.monotonic()
            if f.cancelled:
                return
            if left <= 0:  # the deadline passed while it queued for the stream (or for pages)
                self.metrics.load_failures.labels("deadline").inc()
                return
            f.pages_ok = self._load(req, f.plan, f.pages, left)
        finally:
            self._count(f.plan, -1)
            f.wake()

    def close(self) -> None:
        """Wait for the moves already begun (a transfer ends by its deadline); drop queued ones."""
        for pool in (self._lookups, self._transfers):
            pool.shutdown(wait=True, cancel_futures=True)
