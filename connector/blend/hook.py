"""Engine integration: an admission hook that fills a blend request's prompt KV at admission.

A request carrying ``req.extra["blend"]`` (a BlendSpec, or the dict form BlendSpec.coerce
takes) gets the KV of all its prompt tokens but the last written into fresh pool pages by the
blender, and ``num_computed = len(prompt) - 1``. The engine's normal step then feeds the last
token over the blended cache and samples — so sampling, stop rules, streaming, TTFT and usage
stay the engine's own, and the last token's forward is exactly what the blender would have
computed for it (it is always recomputed, and attends to the final blended KV of every layer).

Blended KV is approximate, so it must never enter the exact prefix caches: the hook sets
``req.cache_limit`` to the exact prefix (radix hit or BOS + system prompt), which the scheduler
honours whenever it gives pages to the radix tree (finish and preemption), and on finish it
also cuts ``num_computed`` back to it before any later hook (the connector's write-through
offload) sees the request. Attach the blend hook first (``attach`` does).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import torch

from connector.blend.blender import Blender
from connector.blend.chunk_cache import ChunkStore
from connector.blend.errors import InvalidBlendRequestError
from connector.blend.metrics import BlendCollector, BlendMetrics
from connector.blend.ratio import RatioPolicy
from connector.blend.spec import SELECT_MODES, BlendSpec
from engine.request import Request
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlendConfig:
    ratio: float = 0.15  # global default (r_min of the policy); a request's spec.ratio overrides
    select: str = "k"  # deviation measured on K (LMCache) or V (the paper), or "random"
    chunk_store_bytes: int = 1 << 30  # in-process chunk store capacity
    policy: RatioPolicy = field(default_factory=RatioPolicy)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}")
        if self.policy.r_min != self.ratio:
            object.__setattr__(self, "policy", RatioPolicy(self.ratio, self.policy.load_time_s,
                                                           self.policy.recompute_time_s))


class BlendHook:
    def __init__(self, engine, config: BlendConfig | None = None, store: ChunkStore | None = None,
                 metrics: BlendMetrics | None = None) -> None:
        from connector.blend.chunk_cache import InProcessChunkStore

        self.cfg = config or BlendConfig()
        self.engine = engine
        self.pool = engine.pool
        self.metrics = metrics or BlendMetrics()
        store = store if store is not None else InProcessChunkStore(self.cfg.chunk_store_bytes)
        # raises BlendUnsupportedError if the self-check fails: the engine must not start with it
        self.blender = Blender(engine.model, engine.loaded.fingerprint, store, self.metrics)
        self._pending: dict[str, BlendSpec] = {}  # rid -> spec, registered before add_request

    @classmethod
    def attach(cls, engine, config: BlendConfig | None = None, store: ChunkStore | None = None) -> BlendHook:
        hook = cls(engine, config, store)
        engine.scheduler.hooks.insert(0, hook)  # first: it takes over the prompt, and trims on finish
        collectors = getattr(engine, "metric_collectors", None)
        if collectors is not None:
            collectors.append(BlendCollector(hook.metrics))
        engine.blend = hook
        return hook

    # -- AdmissionHook ------------------------------------------------------------------------
    def on_admit(self, req: Request, scheduler) -> None:
        raw = req.extra.get("blend")
        if raw is None:
            raw = self._pending.pop(req.rid, None)
            if raw is None:
                return
            req.extra["blend"] = raw
        try:
            spec = BlendSpec.coerce(raw)
        except InvalidBlendRequestError:
            log.exception("request %s: malformed blend spec; prefilling it in full", req.rid)
            self.metrics.fallback_requests += 1
            return
        if spec.prompt_ids != req.prompt_ids:
            log.error("request %s: blend segments do not spell its prompt; prefilling it in full", req.rid)
            self.metrics.fallback_requests += 1
            return
        ps = self.pool.page_size
        m = req.num_computed  # exact prefix from the radix cache / connector (page-aligned)
        n = min(len(req.prompt_ids), req.num_tokens - 1)
        head = spec.segments[0]
        exact = max(m, 0 if head.document else len(head.ids))
        if m >= n:
            return  # the exact caches already cover the prompt
        if m % ps or len(req.pages) * ps != m:
            log.warning("request %s: cached prefix %d is not page-aligned; prefilling it in full", req.rid, m)
            self.metrics.fallback_requests += 1
            return
        need = -(-n // ps) - len(req.pages)
        pages = scheduler.alloc(need) if need > 0 else []
        if pages is None:
            log.warning("request %s: no free pages for the blended prompt; prefilling it in full", req.rid)
            self.metrics.fallback_requests += 1
            return
        all_pages = req.pages + pages
        pos = torch.arange(m, n)
        pt = torch.tensor(all_pages, dtype=torch.long)
        slots = (pt[pos // ps] * ps + pos % ps).to(self.pool.device)

        def sink(layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
            self.pool.write(layer, slots, K[m:n], V[m:n])

        ratio = spec.ratio if spec.ratio is not None else self.cfg.policy.choose(
            spec.num_document_tokens,
            spec.num_document_tokens * self.engine.arch.kv_bytes_per_token(self.pool.dtype))
        try:
            plan = self.blender.plan(spec, req.cache_salt or "")
            res = self.blender.blend(plan, ratio, spec.select or self.cfg.select, num_tokens=n, sink=sink,
                                     want_logits=False)
        except Exception:  # never take the engine loop down: this request is prefilled in full instead
            log.exception("request %s: blending failed; prefilling it in full", req.rid)
            self.metrics.fallback_requests += 1
            self.pool.allocator.decref(pages)
            return
        req.pages = all_pages
        req.num_computed = n
        req.extra["blend_exact_tokens"] = exact
        req.cache_limit = exact  # the scheduler never gives blended pages to the radix (finish, preempt)
        req.extra["blend_stats"] = {"ratio": ratio, "recomputed": len(res.recompute_idx),
                                    "selected": res.num_selected, "document_tokens": res.num_document_tokens}

    def on_finish(self, req: Request, scheduler) -> None:
        self._pending.pop(req.rid, None)
        exact = req.extra.get("blend_exact_tokens")
        if exact is not None and req.num_computed > exact:
            req.num_computed = exact  # only exact pages may enter the radix tree / be offloaded


    def register(self, rid: str, spec: BlendSpec) -> None:
        """Mark request ``rid`` (not yet queued) as a blend request; for servers that queue requests
        through engine/async_engine.py: register, then ``generate(rid, spec.prompt_ids, ...)``."""
        self._pending[rid] = spec

    def add_request(self, spec: BlendSpec, params: SamplingParams | None = None, rid: str | None = None,
                    cache_salt: str | None = None) -> str:
        """engine.add_request for a blend spec (prompt = the segments' concatenation).

        The spec is registered under the request id before the request is queued, so an engine
        loop running in another thread cannot admit it unblended."""
        rid = rid or uuid.uuid4().hex
        self.register(rid, spec)
        try:
            return self.engine.add_request(spec.prompt_ids, params, rid=rid, cache_salt=cache_salt)
        except Exception:
            self._pending.pop(rid, None)
            raise
