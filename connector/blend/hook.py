"""Engine integration: an admission hook that proposes a blend request's prompt KV at admission.

A request whose ``blend`` slot holds a BlendState gets the KV of all its prompt tokens but the last
written into fresh pages by the blender, proposed as an *approximate* PrefixExtension (its leading
exact part: the exact prefix already loaded, or BOS + system prompt). The engine's normal step then
feeds the last token over the blended cache and samples, so sampling, stop rules, streaming, TTFT
and usage stay the engine's own, and the last token's forward is exactly what the blender would
have computed for it (it is always recomputed, and attends to the final blended KV of every layer).

Blended KV is approximate, so it must never enter the exact prefix caches: the scheduler sets the
exact/approximate boundary from the extension and honours it whenever it gives pages to the radix
tree or a connector offloads (``Request.exact_tokens``). It runs after the exact hooks (the KV
connector): whatever exact prefix they loaded is kept, and only the rest is blended.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import torch

from connector.blend.blender import Blender
from connector.blend.chunk_cache import ChunkStore, InProcessChunkStore
from connector.blend.metrics import BlendMetrics
from connector.blend.ratio import RecomputeRatio
from connector.blend.spec import SELECT_MODES, BlendSpec
from connector.blend.state import BlendState, BlendStats
from engine.hooks import PageSource, PrefixExtension
from engine.request import Request
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlendConfig:
    ratio: float = 0.15  # global default (r_min of ``recompute``); a request's spec.ratio overrides
    select: str = "k"  # deviation measured on K (LMCache) or V (the paper), or "random"
    chunk_store_bytes: int = 1 << 30  # in-process chunk store capacity (the LRU in front of the daemon)
    recompute: RecomputeRatio = field(default_factory=RecomputeRatio)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}")
        if self.recompute.r_min != self.ratio:
            object.__setattr__(self, "recompute", RecomputeRatio(self.ratio, self.recompute.load_time_s,
                                                                 self.recompute.recompute_time_s))


class BlendHook:
    def __init__(self, engine, config: BlendConfig | None = None, store: ChunkStore | None = None,
                 metrics: BlendMetrics | None = None) -> None:
        self.cfg = config or BlendConfig()
        self.arch = engine.arch
        self.pool = engine.pool
        self.metrics = metrics or BlendMetrics()
        store = store if store is not None else InProcessChunkStore(self.cfg.chunk_store_bytes)
        # raises BlendUnsupportedError if the self-check fails: the engine must not start with it
        self.blender = Blender(engine.model, engine.loaded.fingerprint, store, self.metrics)
        self._engine = engine

    def _fallback(self, req: Request, why: str) -> None:
        log.warning("request %s: %s; prefilling it in full", req.rid, why)
        self.metrics.fallback_requests += 1

    # -- admission hook -----------------------------------------------------------------------
    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        st = req.blend
        if not isinstance(st, BlendState):
            return None
        spec = st.spec
        if spec.prompt_ids != req.prompt_ids:
            self._fallback(req, "blend segments do not spell its prompt")
            return None
        ps = pages.page_size
        m = req.num_computed  # exact prefix from the radix cache / connector (page-aligned)
        n = min(len(req.prompt_ids), req.num_tokens - 1)
        if m >= n:
            return None  # the exact caches already cover the prompt
        head = spec.segments[0]
        exact_head = max(0, (0 if head.document else len(head.ids)) - m)
        fresh = pages.alloc(-(-n // ps) - len(req.pages))
        if fresh is None:
            self._fallback(req, "no free pages for the blended prompt")
            return None
        pt = torch.tensor(req.pages + fresh, dtype=torch.long)
        pos = torch.arange(m, n)
        slots = (pt[pos // ps] * ps + pos % ps).to(self.pool.device)

        def sink(layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
            self.pool.write(layer, slots, K[m:n], V[m:n])

        ratio = spec.ratio if spec.ratio is not None else self.cfg.recompute.choose(
            spec.num_document_tokens, spec.num_document_tokens * self.arch.kv_bytes_per_token(self.pool.dtype))
        try:
            plan = self.blender.plan(spec, req.cache_salt or "")
            res = self.blender.blend(plan, ratio, spec.select or self.cfg.select, num_tokens=n, sink=sink,
                                     want_logits=False)
        except Exception:  # never take the engine loop down: this request is prefilled in full instead
            log.exception("request %s: blending failed", req.rid)
            self._fallback(req, "blending failed")
            pages.free(fresh)
            return None
        st.stats = BlendStats(ratio, len(res.recompute_idx), res.num_selected, res.num_document_tokens, m)
        return PrefixExtension(fresh, n - m, exact=False, exact_head=exact_head)

    def on_finish(self, req: Request) -> None:
        """Nothing to do: the scheduler keeps blended pages out of the radix tree and offloads."""

    def close(self) -> None:
        close = getattr(self.blender.chunks.store, "close", None)
        if close is not None:
            close()

    def add_request(self, spec: BlendSpec, params: SamplingParams | None = None, rid: str | None = None,
                    cache_salt: str | None = None) -> str:
        """engine.add_request for a blend spec (prompt = the segments' concatenation)."""
        return self._engine.add_request(spec.prompt_ids, params, rid=rid or uuid.uuid4().hex, cache_salt=cache_salt,
                                        blend=BlendState(spec))
