"""Engine integration: an admission hook that proposes a blend request's prompt KV at admission.

A request whose CacheBlend state (``Request.extras``, connector/blend/state.py) is a BlendState gets the KV of all its prompt tokens but the last
written into fresh pages by the blender, proposed as an *approximate* PrefixExtension (its leading
exact part: the exact prefix already loaded, or BOS + system prompt). The engine's normal step then
feeds the last token over the blended cache and samples, so sampling, stop rules, streaming, TTFT
and usage stay the engine's own, and the last token's forward is exactly what the blender would
have computed for it (it is always recomputed, and attends to the final blended KV of every layer).

Blended KV is approximate, so it must never enter the exact prefix caches: the scheduler sets the
exact/approximate boundary from the extension and honours it whenever it gives pages to the radix
tree or a connector offloads (``Request.exact_tokens``). It runs after the exact hooks (the KV
connector): whatever exact prefix they loaded is kept, and only the rest is blended.

Usage: the request's ``BlendStats`` split the blended tokens by origin (``reuse_split``): the exact
head and the document tokens reused from chunks stored by earlier requests, the tokens recomputed,
and chunks this request had to compute first; ``BlendState.account`` gives that to the scheduler's
``PromptUsage``, so ``cached_tokens`` never counts a token computed for this request.

Quality gate (connector/blend/quality_gate.py): with ``gate_fraction`` > 0 a share of blend
requests is also answered by full prefill in the background, and while the agreement stays below
``gate_threshold`` the hook proposes nothing (``BlendState.gated``): those requests are prefilled
in full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from connector.blend.blender import CHECK_LAYER, Blender
from connector.blend.chunk_cache import DOC, PREFIX, ChunkStore, InProcessChunkStore
from connector.blend.metrics import BlendMetrics
from connector.blend.quality_gate import ProbeState, QualityGate, ShadowProber
from connector.blend.ratio import RecomputeRatio
from connector.blend.spec import SELECT_MODES, BlendSpec
from connector.blend.state import BlendState, BlendStats, blend_state
from engine.env import EnvDeclaration
from engine.errors import ConfigError
from engine.hooks import EngineView, PageSource, PrefixExtension
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlendConfig:
    # Default recompute ratio (r_min of ``recompute``; a request's blend_ratio overrides): the smallest r
    # whose quality meets bench.blend's bar (continuation LCS-F1 >= 0.8 and answer agreement >= 0.9 against
    # full prefill, bench/blend/figures.py). On the bundled SmolLM2-135M no r < 1 meets it (r = 0.5 gives
    # 0.76 / 0.5: bench/results/blend_quick.json), so the default is exact. A model that passes at a lower
    # r sets TIERKV_BLEND_RATIO from its own `python -m bench.blend` curve; 0.15 is not a safe constant.
    ratio: float = 1.0
    select: str = "k"  # deviation measured on K (LMCache) or V (the paper), or "random"
    chunk_store_bytes: int = 1 << 30  # in-process chunk store capacity (the LRU in front of the daemon)
    recompute: RecomputeRatio = field(default_factory=RecomputeRatio)
    # the quality gate (connector/blend/quality_gate.py): share of blend requests also answered by full
    # prefill in the background (0: no gate), and when blending switches itself off
    gate_fraction: float = 0.0
    gate_threshold: float = 0.8  # LCS-F1 of the first ``gate_tokens`` greedy tokens, window mean
    gate_window: int = 32  # samples in the rolling window
    gate_min_samples: int = 4  # samples before the gate may switch
    gate_tokens: int = 16  # greedy tokens compared per sample
    gate_max_inflight: int = 2  # probes running at once (a sample is skipped beyond)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}")
        if not 0.0 <= self.gate_fraction <= 1.0:
            raise ValueError(f"gate_fraction must be in [0, 1], got {self.gate_fraction}")
        if not 0.0 <= self.gate_threshold <= 1.0:
            raise ValueError(f"gate_threshold must be in [0, 1], got {self.gate_threshold}")
        for name in ("gate_window", "gate_min_samples", "gate_tokens", "gate_max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute.r_min != self.ratio:
            object.__setattr__(self, "recompute", RecomputeRatio(self.ratio, self.recompute.load_time_s,
                                                                 self.recompute.recompute_time_s))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> BlendConfig:
        """Defaults < ``TIERKV_BLEND_*`` environment variables < ``overrides``; a bad value is one line."""
        kw = {**ENV.overrides(environ), **overrides}
        try:
            return cls(**kw)  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError(f"CacheBlend config (TIERKV_BLEND_*): {e}") from None


ENV = EnvDeclaration("TIERKV_BLEND_", BlendConfig, skip=("recompute",))  # what CacheBlend reads from the environment


class _ComputeLog:
    """Wraps the chunk cache's compute function: which chunks one plan computed instead of reusing."""

    def __init__(self, compute: Callable[[list[int], str], torch.Tensor]) -> None:
        self.compute = compute
        self.seen: set[tuple[str, tuple[int, ...]]] = set()

    def __call__(self, ids: list[int], kind: str) -> torch.Tensor:
        self.seen.add((kind, tuple(ids)))
        return self.compute(ids, kind)


def reuse_split(spec: BlendSpec, start: int, end: int, recomputed: torch.Tensor,
                computed: set[tuple[str, tuple[int, ...]]]) -> tuple[int, int, int, int]:
    """Tokens start..end-1 of a blend by origin: (exact head reused, document tokens reused, document
    tokens recomputed, tokens of chunks computed for this request and not recomputed). ``recomputed``
    is a [>= end] bool mask of the positions recomputed after the check layer."""
    head = docs = redo = fresh = 0
    pos = 0
    for i, seg in enumerate(spec.segments):
        lo, hi = max(pos, start), min(pos + len(seg.ids), end)
        pos += len(seg.ids)
        if lo >= hi:
            continue
        re = int(recomputed[lo:hi].sum())
        kept = hi - lo - re
        if seg.document:
            redo += re
        elif i != 0:
            continue  # the question and separators: always recomputed
        if (DOC if seg.document else PREFIX, seg.ids) in computed:
            fresh += kept
        elif seg.document:
            docs += kept
        else:
            head += kept
    return head, docs, redo, fresh


class BlendHook:
    def __init__(self, view: EngineView, config: BlendConfig | None = None, store: ChunkStore | None = None,
                 metrics: BlendMetrics | None = None) -> None:
        self.cfg = config or BlendConfig()
        self.arch = view.arch
        self.pool = view.pool
        self.metrics = metrics or BlendMetrics()
        store = store if store is not None else InProcessChunkStore(self.cfg.chunk_store_bytes)
        # raises BlendUnsupportedError if the self-check fails: the engine must not start with it
        self.blender = Blender(view.model, view.fingerprint, store, self.metrics)
        self._computed = _ComputeLog(self.blender.chunks.compute)
        self.blender.chunks.compute = self._computed
        c = self.cfg
        self.gate = QualityGate(c.gate_fraction, c.gate_threshold, c.gate_window, c.gate_min_samples, self.metrics)
        self.prober = ShadowProber(view.submit, self.gate, c.gate_tokens, c.gate_max_inflight)

    def _fallback(self, req: Request, why: str) -> None:
        log.warning("request %s: %s; prefilling it in full", req.rid, why)
        self.metrics.fallback_requests += 1

    # -- admission hook -----------------------------------------------------------------------
    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        st = blend_state(req)
        if not isinstance(st, BlendState):
            return None
        spec = st.spec
        if spec.prompt_ids != req.prompt_ids:
            self._fallback(req, "blend segments do not spell its prompt")
            return None
        ps = self.pool.page_size
        m = req.num_computed  # exact prefix from the radix cache / connector (page-aligned)
        n = min(len(req.prompt_ids), req.num_tokens - 1)
        if m >= n:
            return None  # the exact caches already cover the prompt
        if st.probe is None and not self.gate.blending:
            st.gated = True  # the quality gate switched blending off: a plain prefill
            self.metrics.gated_requests += 1
            return None
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
        salt = st.chunk_salt if st.chunk_salt is not None else req.cache_salt or ""
        self._computed.seen.clear()
        try:
            plan = self.blender.plan(spec, salt)
            res = self.blender.blend(plan, ratio, spec.select or self.cfg.select, num_tokens=n, sink=sink,
                                     want_logits=False)
        except Exception:  # never take the engine loop down: this request is prefilled in full instead
            log.exception("request %s: blending failed", req.rid)
            self._fallback(req, "blending failed")
            pages.free(fresh)
            return None
        recomputed = torch.zeros(n, dtype=torch.bool)
        if self.arch.num_layers > CHECK_LAYER + 1:
            recomputed[res.recompute_idx.cpu()] = True
        else:
            recomputed[:] = True  # no layer after the check layer: every layer ran in full
        split = reuse_split(spec, m, n, recomputed, self._computed.seen)
        st.stats = BlendStats(ratio, len(res.recompute_idx), res.num_selected, res.num_document_tokens, m, *split)
        return PrefixExtension(fresh, n - m, exact=False, exact_head=exact_head)

    def on_finish(self, req: Request) -> None:
        """The quality gate's part: a finished blend request may start a probe, a finished shadow
        completes one. (Blended pages need nothing: the scheduler keeps them out of the radix tree
        and offloads.)"""
        st = blend_state(req)
        if isinstance(st, ProbeState):
            self.prober.on_shadow_finish(req, st.probe, blended_side=False)
        elif isinstance(st, BlendState):
            if st.probe is not None:
                self.prober.on_shadow_finish(req, st.probe, blended_side=True)
            else:
                self.prober.on_request_finish(req, st)

    def close(self) -> None:
        close = getattr(self.blender.chunks.store, "close", None)
        if close is not None:
            close()
