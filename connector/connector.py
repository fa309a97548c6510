"""KVConnector: the engine-side half of tierkv — offload, lookup, cost model, load.

It plugs into the engine in two places: as an AdmissionHook of the scheduler (``on_admit`` after
the local radix match, ``on_finish`` before a finished request's pages are released) and as an
evict listener of the radix cache. The method names of the vLLM KV connector V1 map onto ours as
documented in connector/__init__.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from connector.config import ConnectorConfig
from connector.cost_model import CostModel, Decision, PrefillModel
from connector.keys import KeySpace
from connector.loader import Loader
from connector.metrics import ConnectorMetrics
from connector.offload import KnownKeys, Offloader
from engine.radix_cache import EvictedNode
from engine.request import Request
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.retry import Retry

log = logging.getLogger(__name__)


class LoadPlan(NamedTuple):
    """What the scheduler side decided for one request (vLLM: the external-token count)."""

    keys: list[BlockKey]  # keys of the pages to load, in order
    tiers: list[str | None]
    decision: Decision
    start_page: int  # index of the first page to load in the request's page table


class KVConnector:
    def __init__(self, engine, config: ConnectorConfig, prefill: PrefillModel | None = None) -> None:
        self.engine = engine
        self.cfg = config
        self.pool = engine.pool
        self.page_size = engine.pool.page_size
        self.metrics = ConnectorMetrics()
        self.keyspace = KeySpace(engine.loaded.fingerprint, engine.arch.model_type, self.page_size, engine.pool.dtype)
        self.known = KnownKeys(config.known_keys)
        one_try = Retry(attempts=1)
        self._load_client = KVStoreClient(config.address, deadline_s=config.lookup_deadline_s, retry=one_try,
                                          use_shm=config.use_shm, max_message_bytes=8 * 2**20)
        self._save_client = KVStoreClient(config.address, deadline_s=config.offload_deadline_s,
                                          use_shm=config.use_shm)
        self.loader = Loader(self._load_client, self.pool, config.load_chunk_bytes)
        self.offloader = Offloader(self._save_client, self.metrics, self.known, config.offload_queue_bytes,
                                   config.offload_batch_bytes)
        if prefill is None:
            if config.calibrate:
                from connector.calibrate import calibrate_prefill

                prefill = calibrate_prefill(engine)
            else:
                prefill = PrefillModel(*config.prefill_coeffs)
        self.cost = CostModel(prefill, self.pool.bytes_per_page, self.page_size, config.ewma_alpha, config.policy)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.decisions: list[tuple[str, Decision, float]] = []  # (rid, decision, measured load s), last 1000
        if config.probe:
            self.probe()

    # -- start-up ---------------------------------------------------------------------------
    def probe(self) -> None:
        from connector.calibrate import probe_daemon

        try:
            res = probe_daemon(self._load_client, self.loader, self.engine)
        except KVStoreError as e:
            log.warning("kvstore daemon probe failed (%s); using default tier seeds", e)
            return
        if res is not None:
            self.cost.seed(*res)

    # -- scheduler side (vLLM: get_num_new_matched_tokens / update_state_after_alloc) --------
    def _daemon_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _mark_down(self, why: str) -> None:
        self._down_until = time.monotonic() + self.cfg.down_backoff_s
        log.warning("kvstore daemon unusable (%s); recomputing for %.1fs", why, self.cfg.down_backoff_s)

    def request_keys(self, req: Request, n_pages: int) -> list[BlockKey]:
        keys = req.extra.get("kv_keys")
        if keys is None or len(keys) < n_pages:
            keys = self.keyspace.keys(req.all_ids[: n_pages * self.page_size], req.cache_salt)
            req.extra["kv_keys"] = keys
        return keys[:n_pages]

    def get_num_new_matched_tokens(self, req: Request) -> LoadPlan | None:
        """After the local match: which of the next full pages to load (None: nothing to do)."""
        ps = self.page_size
        start = req.num_computed // ps
        loadable = (req.num_tokens - 1) // ps  # leave at least one token to compute (its logits)
        if loadable <= start or not self._daemon_up():
            return None
        keys = self.request_keys(req, loadable)[start:]
        try:
            tiers = self.loader.lookup(keys, self.cfg.lookup_deadline_s)
        except KVStoreError as e:
            self.metrics.lookups.labels("error").inc()
            self._mark_down(str(e))
            return None
        self.metrics.lookups.labels("hit" if tiers else "miss").inc()
        if not tiers:
            return None
        d = self.cost.decide(req.num_computed, req.num_tokens, tiers)
        self.metrics.decisions.labels(d.tier, d.outcome).inc()
        log.debug("%s: %d pages cached locally, %d in the daemon (%s): %s %d pages; predicted load %.4fs + "
                  "compute %.4fs vs recompute %.4fs", req.rid, start, len(tiers), d.tier, d.outcome, d.pages,
                  d.predicted_load_s, d.predicted_compute_s, d.predicted_recompute_s)
        if d.pages == 0:
            self._record(req, d, 0.0)
            return None
        return LoadPlan(keys[: d.pages], tiers[: d.pages], d, start)

    def update_state_after_alloc(self, req: Request, plan: LoadPlan, scheduler) -> list[int] | None:
        return scheduler.alloc(len(plan.keys))

    # -- worker side (vLLM: start_load_kv / wait_for_layer_load) ------------------------------
    def start_load(self, req: Request, plan: LoadPlan, pages: list[int]) -> int:
        """Load ``plan`` into ``pages``; return how many leading pages arrived intact. Whole-prefix
        load before the forward pass: on CPU a layer-wise overlap has nothing to overlap with."""
        d = plan.decision
        saved = max(d.predicted_recompute_s - d.predicted_compute_s, 0.0)  # the recompute this load replaces
        deadline = max(self.cfg.load_deadline_min_s, self.cfg.load_deadline_factor * d.predicted_load_s, saved)
        res = self.loader.load(plan.keys, pages, deadline)
        self.metrics.load_seconds.observe(res.seconds)
        if res.failure:
            self.metrics.load_failures.labels(res.failure).inc()
            if res.failure == "unavailable" or (res.failure == "deadline" and res.pages_ok == 0):
                self._mark_down(res.failure)
        if res.pages_ok == len(plan.keys):
            self.cost.observe(plan.tiers, res.seconds)
            pred = plan.decision.predicted_load_s
            self.metrics.prediction_error.observe(abs(pred - res.seconds) / res.seconds)
        elif res.failure == "deadline":  # the whole plan would take longer than this: learn it
            self.cost.observe(plan.tiers, res.seconds)
        if res.pages_ok:
            self.known.add(plan.keys[: res.pages_ok])
            for t in plan.tiers[: res.pages_ok]:
                self.metrics.loaded_tokens.labels(t or "?").inc(self.page_size)
        self._record(req, plan.decision, res.seconds)
        return res.pages_ok

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads complete before the forward pass starts, so every layer is always ready."""

    def _record(self, req: Request, d: Decision, seconds: float) -> None:
        req.extra["kv_decision"] = d
        req.extra["kv_load_s"] = seconds
        with self._lock:
            self.decisions.append((req.rid, d, seconds))
            del self.decisions[:-1000]

    # -- AdmissionHook ----------------------------------------------------------------------
    def on_admit(self, req: Request, scheduler) -> None:
        plan = self.get_num_new_matched_tokens(req)
        if plan is None:
            return
        pages = self.update_state_after_alloc(req, plan, scheduler)
        if pages is None:
            self.metrics.load_failures.labels("no_pages").inc()
            return
        n = self.start_load(req, plan, pages)
        if n < len(pages):
            self.pool.allocator.decref(pages[n:])
        if n == 0:
            return
        ps = self.page_size
        req.pages.extend(pages[:n])
        req.num_computed += n * ps
        # into the radix tree at once, so requests admitted next share these pages
        radix = scheduler.radix
        radix.insert(req.all_ids[: req.num_computed], req.pages[: req.num_computed // ps], salt=req.cache_salt)
        m = radix.match_prefix(req.all_ids[: req.num_computed], record_stats=False, salt=req.cache_salt)
        radix.lock(m.node)
        if req.radix_node is not None:
            radix.unlock(req.radix_node)
        req.radix_node = m.node

    def on_finish(self, req: Request, scheduler) -> None:
        """vLLM: request_finished. With write-through, offload the request's full pages now."""
        if not self.cfg.write_through:
            return
        n = min(req.num_computed // self.page_size, len(req.pages))
        limit = getattr(req, "cache_limit", None)  # CacheBlend: approximate KV past it never leaves
        if limit is not None:
            n = min(n, limit // self.page_size)
        if n:
            self.save(self.request_keys(req, n), req.pages[:n])

    # -- offload (vLLM: save_kv_layer / wait_for_save) -----------------------------------------
    def save(self, keys: list[BlockKey], pages: list[int]) -> None:
        """Copy pages out (they may be freed right after) and queue them for the daemon."""
        todo = [(k, p) for k, p in zip(keys, pages, strict=True) if k not in self.known]
        if len(todo) < len(keys):
            self.metrics.offload_blocks.labels("skipped_known").inc(len(keys) - len(todo))
        if not todo:
            return
        blocks = self.pool.read_pages([p for _, p in todo])
        self.offloader.submit([k for k, _ in todo], blocks)

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

    def wait_for_save(self, timeout: float = 30.0) -> bool:
        return self.offloader.flush(timeout)

    def close(self) -> None:
        self.offloader.close()
        self._load_client.close()
        self._save_client.close()
