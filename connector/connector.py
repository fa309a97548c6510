"""KVConnector: the engine-side half of tierkv — offload, lookup, cost model, load.

It plugs into the engine in two places: as a loading hook (engine/hooks.py ``LoadingHook``: as soon
as a request is queued, ``start`` looks up the next full pages in the daemon, lets the load-aware
cost model decide and loads them into fresh pages, all off the engine thread (connector/fetch.py);
``poll`` hands the arrived prefix to the scheduler as an exact extension; ``on_finish`` offloads with
write-through) and as an evict listener of the radix cache (``on_evict``). connector/__init__.py
maps these onto the vLLM KV connector V1 names.

The daemon's answers keep ``KnownKeys`` honest: a key a lookup or a load finds missing is
forgotten (so its page is offloaded again when evicted), and a block that fails its checksum is
deleted from the daemon and forgotten too (the recomputed page replaces it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from connector.attribution import UNAVAILABLE, DaemonView
from connector.config import ConnectorConfig
from connector.cost_model import CostModel, Decision, EngineLoad, PrefillModel
from connector.explore import Explorer
from connector.fetch import Fetcher
from connector.keys import KeySpace
from connector.loader import Loader
from connector.metrics import ConnectorMetrics
from connector.offload import KnownKeys, Offloader
from connector.staging import StagedPages
from connector.state import SLOT, KVState, kv_state
from engine.hooks import NOTHING, EngineView, LoadPoll, PageSource
from engine.radix_cache import EvictedNode
from engine.request import Request
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.keys import BlockKey
from kvstore.store.results import InPlace

log = logging.getLogger(__name__)

EXPLORE_PAGES = 8  # pages an exploring decision loads: enough that the bytes, not one round trip, set its time


class LoadPlan(NamedTuple):
    """Which daemon blocks one request will load, decided before any page is taken."""

    keys: list[BlockKey]  # keys of the pages to load, in order
    tiers: list[str | None]
    decision: Decision
    in_place: InPlace | None = None  # where the lookup found the leading ones in the daemon's cpu arena


class KVConnector:
    def __init__(self, view: EngineView, config: ConnectorConfig, prefill: PrefillModel | None = None) -> None:
        self.view = view
        self.cfg = config
        self.pool = view.pool
        self.page_size = view.pool.page_size
        self.metrics = ConnectorMetrics()
        self.keyspace = KeySpace(view.fingerprint, view.arch.model_type, self.page_size, view.pool.dtype,
                                 shared=view.shared)  # the pages the radix tree shares: keyed shared too
        self.known = KnownKeys(config.known_keys)
        one_try = Retry(attempts=1)
        self._load_client = KVStoreClient(config.address, deadline_s=config.lookup_deadline_s, retry=one_try,
                                          use_shm=config.use_shm, max_message_bytes=8 * 2**20)
        # the lookup worker's own client: a lookup never waits behind a transfer's bulk reads
        self._lookup_client = KVStoreClient(config.address, deadline_s=config.lookup_deadline_s, retry=one_try,
                                            use_shm=False)
        self._explorer = Explorer()  # when a bypassed tier is loaded a little anyway (the lookup worker's)
        self.fetcher = Fetcher(self.plan_load, self.load, self.deadline_s, self.metrics, self.page_size,
                               self.pool.bytes_per_page)
        self._save_client = KVStoreClient(config.address, deadline_s=config.offload_deadline_s,
                                          use_shm=config.use_shm)
        self.loader = Loader(self._load_client, self.pool, config.load_chunk_bytes)
        self.offloader = Offloader(self._save_client, self.metrics, self.known, config.offload_queue_bytes,
                                   config.offload_batch_bytes)
        if prefill is None:
            if config.calibrate:
                from connector.calibrate import calibrate_prefill

                prefill = calibrate_prefill(view, quiet_wait_s=config.calibrate_quiet_wait_s)
            else:
                prefill = PrefillModel(*config.prefill_coeffs)
        self.cost = CostModel(prefill, self.pool.bytes_per_page, self.page_size, config.ewma_alpha,
                              config.load_mode)
        self._down_until = 0.0
        self.probe_result = None  # what the start-up probe measured (connector/probe.py), if it ran
        if config.probe:
            self._probe()

    # -- start-up ---------------------------------------------------------------------------
    def _probe(self) -> None:
        from connector.calibrate import probe_daemon

        try:
            res = probe_daemon(self._load_client, self.loader, self.view, tenant=self.cfg.probe_tenant)
        except KVStoreError as e:
            log.warning("kvstore daemon probe failed (%s); using default tier seeds", e)
            return
        self.probe_result = res
        if res is not None:
            self.cost.seed(res.tier, res.latency_s, res.bandwidth)

    # -- deciding what to load ----------------------------------------------------------------
    def _daemon_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _mark_down(self, why: str) -> None:
        self._down_until = time.monotonic() + self.cfg.down_backoff_s
        log.warning("kvstore daemon unusable (%s); recomputing for %.1fs", why, self.cfg.down_backoff_s)

    def _state(self, req: Request) -> KVState:
        st = kv_state(req)
        if st is None:
            st = req.extras[SLOT] = KVState()
        return st

    def _keys(self, req: Request, n_pages: int) -> list[BlockKey]:
        st = self._state(req)
        if len(st.keys) < n_pages:
            st.keys = self.keyspace.keys(req.all_ids[: n_pages * self.page_size], req.cache_salt)
        return st.keys[:n_pages]

    def plan_load(self, req: Request, prefill_ahead: Sequence[tuple[int, int]] = ()) -> LoadPlan | None:
        """After the local match: look up the next full pages and let the cost model pick how many
        to load, given the transfers in flight and ``prefill_ahead`` (None: nothing to load). What
        the daemon said is kept for the page attribution. Runs on the lookup worker: while a request
        is LOADING the engine thread changes none of the request fields read here."""
        ps = self.page_size
        start = req.num_computed // ps
        loadable = (req.num_tokens - 1) // ps  # leave at least one token to compute (its logits)
        st = self._state(req)
        st.page_size, st.view, st.decision, st.view_page, st.last_loaded = ps, None, None, start, 0
        if loadable <= start:
            return None
        if not self._daemon_up():
            st.view = UNAVAILABLE
            return None
        keys = self._keys(req, loadable)[start:]
        try:
            found = self._lookup_client.lookup(keys, deadline_s=self.cfg.lookup_deadline_s, in_place=True)
        except KVStoreError as e:
            self.metrics.lookups.labels("error").inc()
            st.view = UNAVAILABLE
            if isinstance(e, PermissionDenied):  # this request's tenant, not the daemon: the others go on
                log.warning("%s: the daemon refused this request's keys (%s); recomputing", req.rid, e)
            else:
                self._mark_down(str(e))
            return None
        st.view = DaemonView(found.tiers, found.evicted_from)
        tiers = found.tiers[: found.prefix_len]
        self.known.discard(keys[len(tiers):])  # the daemon lost or never had these: offload them again
        self.metrics.lookups.labels("hit" if tiers else "miss").inc()
        if not tiers:
            return None
        d = st.decision = self._decide(req, tiers, EngineLoad(self.fetcher.inflight(), prefill_ahead))
        log.debug("%s: %d pages cached locally, %d in the daemon (%s): %s %d pages; predicted wait %.4fs + load "
                  "%.4fs + compute %.4fs vs recompute %.4fs (%.4fs of it queued)", req.rid, start, len(tiers), d.tier,
                  d.outcome, d.pages, d.load_wait_s, d.predicted_load_s, d.predicted_compute_s,
                  d.predicted_recompute_s, d.prefill_wait_s)
        if d.pages == 0:
            self._record(req, d, 0.0)
            return None
        return LoadPlan(keys[: d.pages], tiers[: d.pages], d, found.in_place)

    def _decide(self, req: Request, tiers: list[str | None], load: EngineLoad) -> Decision:
        """The load-aware decision, with its inputs and what the load changed counted on /metrics.

        Exploration: a tier the model would bypass is loaded a little anyway (``EXPLORE_PAGES``)
        while no real load ever measured it (its model is the start-up probe's, which a busy moment
        can make look far too slow), and then once it went 32 bypasses and 30 s unmeasured (it may
        have got faster since; connector/explore.py): otherwise a tier once judged slow is never
        measured again."""
        d = self.cost.decide_under_load(req.num_computed, req.num_tokens, tiers, load)
        idle = self.cost.decide(req.num_computed, req.num_tokens, tiers)
        m = self.metrics
        if idle.pages != d.pages:
            m.load_changed.labels(idle.outcome, d.outcome).inc()
        elif d.pages == 0 and self.cfg.load_mode == "auto":  # the tier itself looks slower than recompute
            first = tiers[0] or "?"
            if self._explorer.wants(first, self.cost.tier(first).measured):
                d = self.cost.explore(req.num_computed, req.num_tokens, tiers, load, EXPLORE_PAGES)
        m.decisions.labels(d.tier, d.outcome).inc()
        m.decision_transfer_wait.observe(self.cost.transfer_wait_s(load.inflight_bytes))
        m.decision_prefill_wait.observe(d.prefill_wait_s)
        return d

    def deadline_s(self, d: Decision) -> float:
        """How long a planned load may take from its decision: a multiple of its prediction, never less
        than the recompute it replaces (past that, what has not arrived is recomputed)."""
        saved = max(d.predicted_recompute_s - d.predicted_compute_s, 0.0)
        return max(self.cfg.load_deadline_min_s, self.cfg.load_deadline_factor * (d.load_wait_s + d.predicted_load_s),
                   saved)

    # -- loading ------------------------------------------------------------------------------
    def load(self, req: Request, plan: LoadPlan, pages: list[int], deadline_s: float) -> int:
        """Load ``plan`` into ``pages`` within ``deadline_s``; return how many leading pages arrived
        intact. The whole prefix loads before the forward pass (layer-wise overlap does not pay on
        CPU: docs/architecture.md). Runs on the transfer worker."""
        res = self.loader.load(plan.keys, pages, deadline_s, in_place=plan.in_place)
        self.metrics.load_seconds.observe(res.seconds)
        if res.failure:
            self.metrics.load_failures.labels(res.failure).inc()
            # nothing arrived within a full deadline: the daemon hangs (a deadline mostly spent
            # queueing for the stream says nothing about the daemon)
            hung = res.failure == "deadline" and res.pages_ok == 0 and deadline_s >= self.cfg.load_deadline_min_s
            if res.failure == "unavailable" or hung:
                self._mark_down(res.failure)
            elif res.failure in ("checksum", "missing"):
                self._forget(plan.keys[res.pages_ok:], corrupt=plan.keys[res.pages_ok] if res.failure == "checksum"
                             else None)
        if res.pages_ok == len(plan.keys):
            self.cost.observe(plan.tiers, res.seconds)
            pred = plan.decision.predicted_load_s
            self.metrics.prediction_error.observe(abs(pred - res.seconds) / res.seconds)
        elif res.failure == "deadline":  # the whole plan would take longer than this: learn it
            self.cost.observe(plan.tiers, res.seconds)
        st = self._state(req)
        st.last_loaded = res.pages_ok
        st.loaded_tiers += plan.tiers[: res.pages_ok]
        if res.pages_ok:
            self.known.add(plan.keys[: res.pages_ok])
            for t in plan.tiers[: res.pages_ok]:
                self.metrics.loaded_tokens.labels(t or "?").inc(self.page_size)
        self._record(req, plan.decision, res.seconds)
        return res.pages_ok

    def _forget(self, keys: list[BlockKey], corrupt: BlockKey | None) -> None:
        """Keys past a failed load are not (usably) in the daemon: forget them so that the recomputed
        pages are offloaded again; a corrupt block is deleted first, or the re-offload would be
        skipped as already held."""
        if corrupt is not None:
            try:
                self._load_client.delete([corrupt])
                self.metrics.corrupt_deleted.inc()
            except KVStoreError as e:
                log.warning("could not delete a corrupt block from the daemon (%s)", e)
        self.known.discard(keys)

    def _record(self, req: Request, d: Decision, seconds: float) -> None:
        st = self._state(req)
        st.decision = d
        st.load_s = seconds

    # -- the loading hook (engine thread; the moves are connector/fetch.py's) -----------------
    def start(self, req: Request, pages: PageSource, prefill_ahead: Sequence[tuple[int, int]],
              wake: Callable[[], None]) -> bool:
        """Prefetch: the lookup and decision go to the lookup worker at once. Pages for the leading
        keys this connector knows the daemon holds (it sent or loaded them) are taken now, so that
        the transfer can follow the lookup without waiting for a step to end."""
        st = self._state(req)
        ps = st.page_size = self.page_size
        start, loadable = req.num_computed // ps, (req.num_tokens - 1) // ps
        if loadable <= start:
            return False  # not one full page to look up (what an earlier lookup said still stands)
        if not self._daemon_up():
            st.view = UNAVAILABLE
            return False
        keys = self._keys(req, loadable)[start:]
        known = next((i for i, k in enumerate(keys) if k not in self.known), len(keys))
        st.fetch = self.fetcher.start(req, tuple(prefill_ahead), wake, (pages.alloc(known) or []) if known else [])
        return True

    def poll(self, req: Request, pages: PageSource) -> LoadPoll:
        st = self._state(req)
        if st.fetch is None:
            return NOTHING
        res = self.fetcher.poll(req, st.fetch, pages)
        if res.done:
            st.fetch = None
        return res

    def cancel(self, req: Request) -> None:
        st = self._state(req)
        if st.fetch is not None:
            self.fetcher.cancel(st.fetch)

    def on_finish(self, req: Request) -> None:
        """With write-through, offload the request's full exact pages now (never approximate KV)."""
        if not self.cfg.write_through:
            return
        n = min(req.exact_tokens // self.page_size, len(req.pages))
        if n:
            self.save(self._keys(req, n), req.pages[:n])

    # -- offload ------------------------------------------------------------------------------
    def save(self, keys: list[BlockKey], pages: list[int]) -> None:
        """Copy pages out (they may be freed right after) and queue them for the daemon."""
        todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in self.known]
        if len(todo) < len(keys):
            self.metrics.offload_blocks.labels("skipped_known").inc(len(keys) - len(todo))
        if not todo:
            return
        self.offloader.submit(StagedPages(self.pool, [k for k, _ in todo], [p for _, p in todo]))

    def on_step(self, seqs: list[tuple[int, int]], seconds: float) -> None:
        """The engine's timed step: prefill steps keep the prefill model's correction current."""
        if self.cfg.prefill_learn and self.cost.observe_step(seqs, seconds):
            self.metrics.prefill_scale.set(self.cost.prefill.scale)

    def on_evict(self, nodes: list[EvictedNode]) -> None:
        if not self.cfg.offload_on_evict:
            return
        keys: list[BlockKey] = []
        pages: list[int] = []
        for n in nodes:
            full = n.prefix_tokens + n.tokens
            node_keys = self.keyspace.keys(full, n.salt)[len(n.prefix_tokens) // self.page_size:]
            keys += node_keys
            pages += n.pages
        try:
            self.save(keys, pages)
        except Exception as e:  # noqa: BLE001 - never break eviction
            self.metrics.offload_blocks.labels("failed").inc(len(keys))
            log.warning("offload on evict failed: %s", e)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every staged offload was sent (or dropped); False if ``timeout_s`` passed."""
        return self.offloader.flush(timeout_s)

    def close(self) -> None:
        self.fetcher.close()
        self.offloader.close()
        self._lookup_client.close()
        self._load_client.close()
        self._save_client.close()
