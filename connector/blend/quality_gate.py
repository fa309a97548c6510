"""The blending quality gate: check blended answers against full prefill, and stop blending when they drift.

CacheBlend trades exactness for speed, and how much it loses depends on the model, the documents
and the ratio: nothing a fixed setting can promise. So a share of blend requests (``fraction``,
chosen deterministically: every 1/fraction-th one) is answered twice more, in the background:

- a *probe* compares the first ``tokens`` greedy tokens of the blended prompt with those of a full
  prefill of the same prompt, as token LCS-F1 (1.0: identical; robust to a one-token shift);
- each side the request itself did not produce greedily (``tokens`` of them at least: a short answer
  is too small a sample) is a *shadow request* on the same engine:
  an ordinary request (greedy, ``ignore_eos``, no client) queued behind the real one, so it never
  delays that request's first token; it is submitted through the engine view (engine/hooks.py
  ``Submit``) from the hook's ``on_finish`` and joins the queue after the step, so the scheduler is
  never re-entered from its own ``finish``; its outputs go nowhere, and at most ``max_inflight`` probes
  run at once (a sample is skipped beyond that), which bounds the extra work;
- the full-prefill shadow shares the tenant's radix tree (its KV is exact); the blended shadow
  runs under a separate radix tree (``<salt> + SHADOW_SALT``) that only ever holds exact heads,
  so a prompt a full prefill just cached is still blended, while its chunks come from the
  tenant's chunk store. A blended shadow the hook did not blend (no pages, the exact caches
  covered it) is void: no sample.

The agreement of the last ``window`` samples is the gate (exported on /metrics). Once at least
``min_samples`` are in and their mean falls below ``threshold``, blending switches OFF: every blend
request is then prefilled in full, so its output is exactly a plain prefill's. While OFF the gate
keeps probing the same share of requests (their own output is the full-prefill side; the blended
side is a shadow), and it switches back ON as soon as the window's mean is at or above the
threshold again. The bad samples that switched it off stay in the window until newer samples push
them out, so it recovers only after enough good blends, not on the first lucky one.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import dataclass

from connector.blend.agreement import lcs_f1
from connector.blend.metrics import BlendMetrics
from connector.blend.state import BlendState, blend_extras, blend_state
from engine.errors import EngineError
from engine.hooks import Submit
from engine.request import HookState, Request
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

SHADOW_SALT = "\x00tierkv-gate"  # appended to a tenant's salt: the blended shadows' own radix tree


class QualityGate:
    """The decision: which requests to sample, and whether blending is on (no engine here)."""

    def __init__(self, fraction: float, threshold: float, window: int, min_samples: int,
                 metrics: BlendMetrics | None = None) -> None:
        self.fraction = fraction
        self.threshold = threshold
        self.min_samples = min(min_samples, window)
        self.samples: deque[float] = deque(maxlen=window)
        self.metrics = metrics or BlendMetrics()
        self._credit = 0.0
        self.blending = True
        self.metrics.gate_blending = 1

    @property
    def agreement(self) -> float | None:
        """Mean agreement of the window (None before the first sample)."""
        return sum(self.samples) / len(self.samples) if self.samples else None

    def should_sample(self) -> bool:
        """Deterministic share: exactly ``fraction`` of the calls, spread evenly."""
        if self.fraction <= 0.0:
            return False
        self._credit += self.fraction
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False

    def record(self, agreement: float) -> None:
        self.samples.append(agreement)
        mean = self.agreement
        assert mean is not None
        m = self.metrics
        m.gate_samples += 1
        m.gate_agreement = mean
        if len(self.samples) < self.min_samples:
            return
        on = mean >= self.threshold
        if on != self.blending:
            self.blending = on
            m.gate_blending = int(on)
            if on:
                m.gate_switched_on += 1
            else:
                m.gate_switched_off += 1
            log.warning("CacheBlend quality gate: blending switched %s (agreement with full prefill %.3f over "
                        "the last %d samples, threshold %.3f)", "ON" if on else "OFF", mean, len(self.samples),
                        self.threshold)


@dataclass
class Probe:
    """One sample: the first ``n`` greedy tokens of the blended prompt and of its full prefill."""

    n: int
    blended: list[int] | None = None
    full: list[int] | None = None
    void: bool = False  # the blended side was not blended after all: no sample

    @property
    def done(self) -> bool:
        return self.void or (self.blended is not None and self.full is not None)


@dataclass
class ProbeState(HookState):
    """CacheBlend's state of a full-prefill shadow: the hook prefills it like any plain request."""

    probe: Probe


class ShadowProber:
    """Starts probes on real blend requests as they finish and completes them as shadows finish.

    Runs on the engine loop thread only (from the hook's ``on_finish``)."""

    def __init__(self, submit: Submit, gate: QualityGate, tokens: int, max_inflight: int) -> None:
        self._submit = submit  # the engine view's: a shadow joins the queue after the step
        self.gate = gate
        self.tokens = tokens
        self.max_inflight = max_inflight
        self.inflight: list[Probe] = []

    def on_request_finish(self, req: Request, st: BlendState) -> None:
        """A real blend request finished: maybe start a probe of its prompt."""
        if req.finish_reason == "abort" or not (st.stats is not None or st.gated):
            return  # aborted, or neither blended nor gated (the exact caches covered it): nothing to compare
        if not self.gate.should_sample():
            return
        if len(self.inflight) >= self.max_inflight:
            self.gate.metrics.gate_skipped += 1
            return
        # its own output is one side when greedy and long enough (an answer that stopped early would
        # make a sample of a token or two: then both sides are shadows of ``tokens`` tokens)
        own = list(req.output_ids[: self.tokens]) if req.params.greedy and len(req.output_ids) >= self.tokens \
            else None
        probe = Probe(self.tokens)
        if own is not None:
            if st.stats is not None:
                probe.blended = own
            else:
                probe.full = own
        salt = req.cache_salt or ""
        try:
            if probe.blended is None:
                self._shadow(req, BlendState(st.spec, probe=probe, chunk_salt=salt), salt + SHADOW_SALT, probe.n)
            if probe.full is None:
                self._shadow(req, ProbeState(probe), req.cache_salt, probe.n)
        except EngineError as e:  # e.g. the longer shadow does not fit the context: skip this sample
            log.info("quality gate: no probe for %s (%s)", req.rid, e)
            self.gate.metrics.gate_skipped += 1
            return
        self.inflight.append(probe)

    def _shadow(self, req: Request, state: HookState, salt: str | None, n: int) -> None:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        self._submit(req.prompt_ids, params, rid=f"gate-{uuid.uuid4().hex}", cache_salt=salt,
                     extras=blend_extras(state))

    def on_shadow_finish(self, req: Request, probe: Probe, blended_side: bool) -> None:
        """A shadow finished: fill its side; a complete probe becomes a sample."""
        if blended_side:
            st = blend_state(req)
            if isinstance(st, BlendState) and st.stats is None:
                probe.void = True
                self.gate.metrics.gate_void += 1
            probe.blended = list(req.output_ids[: probe.n])
        else:
            probe.full = list(req.output_ids[: probe.n])
        if not probe.done or probe not in self.inflight:
            return
        self.inflight.remove(probe)
        if not probe.void:
            assert probe.blended is not None and probe.full is not None
            self.gate.record(lcs_f1(probe.blended, probe.full))
