"""Counters the server exports: blended requests, recomputed-token share, chunk hits/misses, the quality gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class BlendMetrics:
    blended_requests: int = 0
    fallback_requests: int = 0  # blend asked for but the pool had no pages: plain prefill instead
    prompt_tokens: int = 0  # tokens covered by blends
    recomputed_tokens: int = 0  # tokens recomputed at layers >= 2 (selected + suffix + last)
    document_tokens: int = 0
    selected_document_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    blend_seconds: float = 0.0
    # the quality gate (quality_gate.py)
    gated_requests: int = 0  # blend requests prefilled in full because the gate had switched blending off
    gate_samples: int = 0  # probes compared (blended vs full prefill)
    gate_agreement: float = 1.0  # mean LCS-F1 over the gate's window (1.0 before any sample)
    gate_blending: int = 1  # 1 while blending is on
    gate_switched_off: int = 0
    gate_switched_on: int = 0
    gate_skipped: int = 0  # samples skipped (too many probes in flight, or the shadow did not fit)
    gate_void: int = 0  # probes whose blended shadow was not blended after all

    @property
    def recomputed_share(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def chunk_hit_rate(self) -> float:
        n = self.chunk_hits + self.chunk_misses
        return self.chunk_hits / n if n else 0.0

    def snapshot(self) -> dict[str, float]:
        d: dict[str, float] = asdict(self)
        d["recomputed_share"] = self.recomputed_share
        d["chunk_hit_rate"] = self.chunk_hit_rate
        return d


class BlendCollector:
    """Prometheus collector over a BlendMetrics (register it; values are read at scrape time)."""

    _COUNTERS = {"blended_requests": "Requests whose prompt KV was blended",
                 "fallback_requests": "Blend requests prefilled in full instead (no pages, bad spec)",
                 "prompt_tokens": "Prompt tokens covered by blends",
                 "recomputed_tokens": "Tokens recomputed at layers >= 2",
                 "chunk_hits": "Document chunks found in the chunk store",
                 "chunk_misses": "Document chunks computed (not in the chunk store)",
                 "blend_seconds": "Seconds spent blending",
                 "gated_requests": "Blend requests prefilled in full because the quality gate switched blending off",
                 "gate_samples": "Quality-gate probes compared against full prefill",
                 "gate_switched_off": "Times the quality gate switched blending off",
                 "gate_switched_on": "Times the quality gate switched blending back on",
                 "gate_skipped": "Quality-gate samples skipped (probes in flight, or the shadow did not fit)",
                 "gate_void": "Quality-gate probes whose blended shadow was not blended"}

    def __init__(self, metrics: BlendMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.metrics
        for name, doc in self._COUNTERS.items():
            yield CounterMetricFamily(f"tierkv_blend_{name}", doc, value=getattr(m, name))
        yield GaugeMetricFamily("tierkv_blend_recomputed_share", "Recomputed / blended prompt tokens",
                                value=m.recomputed_share)
        yield GaugeMetricFamily("tierkv_blend_gate_agreement",
                                "Quality gate: mean LCS-F1 of blended vs full-prefill greedy tokens (rolling window)",
                                value=m.gate_agreement)
        yield GaugeMetricFamily("tierkv_blend_gate_blending", "Quality gate: 1 while blending is on, 0 while off",
                                value=m.gate_blending)
