"""Transfer versus recompute: how many of the daemon's pages are worth loading for one request.

Load time of k pages = the slowest involved tier's latency + sum over tiers of bytes / bandwidth.
Each tier's bandwidth is an EWMA (of seconds per byte) of what the connector measured, seeded by a start-up probe of
the daemon (tiers the probe cannot reach get conservative seeds until a first real load); a
measurement off by 2x or more replaces the estimate instead of being averaged in.

Recompute time comes from a prefill model calibrated on this machine at start-up:
``t = a + b*new + c*new*ctx`` where ``new`` is the number of tokens fed and ``ctx`` the mean
length they attend to (tokens already cached + new/2), fitted by least squares over a few timed
prefills. Nothing is hard-coded per machine: on a GPU prefill is cheap and S3 loses, on a CPU
the opposite.

The start-up fit is taken on an idle engine with the best of two runs; the engine's real steps
cost more (other requests in the batch, sampling, other processes on the machine). So the model
is kept honest online: every engine step that feeds at least ``MIN_OBSERVED_TOKENS`` tokens is
timed (``observe_step``), and an EWMA of log(measured / fitted) becomes a multiplicative
correction of every prefill prediction (``PrefillModel.scale``; each sample clamped to [1/4, 4]).

``decide`` evaluates every k from 0 (recompute) to all available pages and keeps the fastest:
T(k) = load(k) + prefill(rest | context m + k pages).

Under load (``decide_under_load``, the connector's decision; ``decide`` is its idle case) two more
things are priced, both measured when the request is decided (``EngineLoad``):
- the bytes already queued or in flight on the connector's transfer stream, per tier: the loader
  moves one load at a time, so a new load waits for them, W = sum over tiers of bytes / bandwidth;
- the prefill already queued on the engine ahead of this request (running prefills, queued
  requests before it), priced by the prefill model as one batch, Q: a recompute waits for it, and
  so does the part of a load's request left to compute, unless the load itself takes longer:
  T(0) = Q + prefill(all),  T(k) = max(W + load(k), Q) + prefill(rest).
So loads in flight push a decision towards recompute, and a busy engine pushes it towards loading
(a load that finishes while the engine works through the queue costs nothing extra).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

#: seeds for tiers the start-up probe could not measure: (latency s, bytes/s)
DEFAULT_TIERS = {
    "cpu": (0.001, 2e9),
    "redis": (0.002, 5e8),
    "disk": (0.002, 5e8),
    "s3": (0.02, 1.5e8),
}
_FALLBACK = (0.02, 1e8)
#: steps feeding fewer tokens are not observed: decode steps, and the short suffix a load leaves to
#: compute, whose per-step overhead is a larger share than in a long prefill. At 16, the suffix
#: steps after every load pulled the one correction up and long recomputes were predicted 9-21% too
#: slow (bench.e2e.boundary: 0.62-0.69 of the decisions at load/recompute 0.7-1.3 right); at 64,
#: 1% off and 0.92 right (bench/results/boundary_quick*.json)
MIN_OBSERVED_TOKENS = 64
_SCALE_LIMITS = (0.25, 4.0)


class PrefillModel(NamedTuple):
    a: float  # s per forward pass
    b: float  # s per token
    c: float  # s per token x attended token
    scale: float = 1.0  # online correction: what real steps took / what the fit says
    observed: int = 0  # engine steps folded into ``scale``

    def fitted(self, new: int, ctx: int = 0) -> float:
        """The start-up fit alone (no online correction)."""
        if new <= 0:
            return 0.0
        return self.a + self.b * new + self.c * new * (ctx + new / 2)

    def predict(self, new: int, ctx: int = 0) -> float:
        return self.fitted(new, ctx) * self.scale

    def fitted_step(self, seqs: Sequence[tuple[int, int]]) -> float:
        """The fit for one forward pass over ``seqs`` = (tokens fed, tokens already cached)."""
        fed = [(n, ctx) for n, ctx in seqs if n > 0]
        if not fed:
            return 0.0
        return self.a + sum(self.b * n + self.c * n * (ctx + n / 2) for n, ctx in fed)

    def observe(self, seqs: Sequence[tuple[int, int]], seconds: float, alpha: float) -> PrefillModel | None:
        """This model with one timed step folded into ``scale`` (a running mean of log(measured /
        fitted) over the first 1/alpha steps, an EWMA after); None if the step is not a prefill."""
        if seconds <= 0 or sum(n for n, _ in seqs) < MIN_OBSERVED_TOKENS:
            return None
        fitted = self.fitted_step(seqs)
        if fitted <= 0:
            return None
        lo, hi = _SCALE_LIMITS
        sample = math.log(min(max(seconds / fitted, lo), hi))
        w = max(alpha, 1.0 / (self.observed + 1))
        log_scale = math.log(self.scale)
        return self._replace(scale=math.exp(log_scale + w * (sample - log_scale)), observed=self.observed + 1)

    @staticmethod
    def fit(samples: Sequence[tuple[int, int, float]]) -> PrefillModel:
        """Least squares over (new, ctx, seconds); coefficients clamped at >= 0."""
        x = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in samples])
        y = np.array([t for _, _, t in samples])
        active = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            neg = [active[i] for i, v in enumerate(coef) if v < 0]
            if not neg or len(active) == 1:
                break
            active = [i for i in active if i not in neg]
        full = [0.0, 0.0, 0.0]
        for i, v in zip(active, coef, strict=True):
            full[i] = max(float(v), 0.0)
        return PrefillModel(*full)


@dataclass
class TierModel:
    latency_s: float
    bandwidth: float  # bytes / s
    measured: int = 0  # loads that updated it

    def time(self, nbytes: int) -> float:
        return nbytes / self.bandwidth


class Decision(NamedTuple):
    pages: int  # pages to load (a prefix of what the daemon holds)
    outcome: str  # load_all | load_partial | recompute | explore
    tier: str  # tier holding most of the pages considered
    predicted_load_s: float  # for ``pages``
    predicted_compute_s: float  # prefill of what is left after loading ``pages``
    predicted_recompute_s: float  # prefill of everything (the no-load option)
    load_wait_s: float = 0.0  # before the load starts: the bytes ahead of it on the transfer stream
    prefill_wait_s: float = 0.0  # the prefill queued ahead on the engine (in compute and recompute)

    @property
    def predicted_total_s(self) -> float:
        return self.load_wait_s + self.predicted_load_s + self.predicted_compute_s


class EngineLoad(NamedTuple):
    """What else the machine is doing when one request's load is decided."""

    inflight_bytes: Mapping[str, int]  # per tier: bytes queued or moving on the connector's transfer stream
    prefill_ahead: Sequence[tuple[int, int]]  # (tokens to feed, tokens cached) of each prefill queued ahead


IDLE = EngineLoad({}, ())


class CostModel:
    def __init__(self, prefill: PrefillModel, bytes_per_page: int, page_size: int, alpha: float = 0.3,
                 load_mode: str = "auto") -> None:
        self.prefill = prefill
        self.bytes_per_page = bytes_per_page
        self.page_size = page_size
        self.alpha = alpha
        self.load_mode = load_mode  # auto: cheapest of load k pages + compute; always; never
        self.tiers: dict[str, TierModel] = {}
        self._lock = threading.Lock()

    # -- prefill -----------------------------------------------------------------------
    def observe_step(self, seqs: Sequence[tuple[int, int]], seconds: float) -> bool:
        """Fold one timed engine step (``seqs`` = (tokens fed, tokens cached) per sequence) into
        the prefill model's online correction; False if it was not a prefill step."""
        with self._lock:
            new = self.prefill.observe(seqs, seconds, self.alpha)
            if new is None:
                return False
            self.prefill = new
            return True

    # -- tiers -----------------------------------------------------------------------
    def seed(self, tier: str, latency_s: float, bandwidth: float) -> None:
        with self._lock:
            self.tiers[tier] = TierModel(max(latency_s, 0.0), max(bandwidth, 1.0))

    def tier(self, name: str) -> TierModel:
        with self._lock:
            t = self.tiers.get(name)
            if t is None:
                lat, bw = DEFAULT_TIERS.get(name, _FALLBACK)
                if "cpu" in self.tiers and name != "cpu":  # never faster than the measured cpu tier
                    bw = min(bw, self.tiers["cpu"].bandwidth)
                    lat = max(lat, self.tiers["cpu"].latency_s)
                t = self.tiers[name] = TierModel(lat, bw)
            return t

    def load_time(self, tiers: Sequence[str | None]) -> float:
        """Predicted seconds to load one page from each of ``tiers`` (in one request)."""
        if not tiers:
            return 0.0
        per: dict[str, int] = {}
        for t in tiers:
            per[t or "?"] = per.get(t or "?", 0) + 1
        models = {t: self.tier(t) for t in per}
        return max(m.latency_s for m in models.values()) + sum(
            models[t].time(n * self.bytes_per_page) for t, n in per.items())

    def observe(self, tiers: Sequence[str | None], seconds: float) -> None:
        """Fold one measured load into the bandwidths of the tiers it read from."""
        if not tiers or seconds <= 0:
            return
        per: dict[str, int] = {}
        for t in tiers:
            per[t or "?"] = per.get(t or "?", 0) + 1
        models = {t: self.tier(t) for t in per}
        lat = max(m.latency_s for m in models.values())
        predicted = sum(models[t].time(n * self.bytes_per_page) for t, n in per.items())
        actual = max(seconds - lat, seconds * 0.1)
        ratio = actual / predicted  # > 1: slower than we thought
        with self._lock:
            for t, n in per.items():
                m = models[t]
                share = n / len(tiers)
                # a first measurement replaces a seed, and so does one off by 2x or more (the tier
                # changed: throttled, contended, moved to another medium); otherwise an EWMA
                jump = not m.measured or ratio > 2 or ratio < 0.5
                w = share if jump else self.alpha * share
                inv = 1.0 / m.bandwidth  # EWMA of seconds per byte: averages times, reacts to slow-downs
                m.bandwidth = max(1.0, 1.0 / (inv + w * (inv * ratio - inv)))
                m.measured += 1

    # -- the decision ------------------------------------------------------------------
    def transfer_wait_s(self, inflight_bytes: Mapping[str, int]) -> float:
        """Seconds until a new load starts moving: every byte already on the transfer stream first."""
        return sum(self.tier(t).time(n) for t, n in inflight_bytes.items() if n > 0)

    def prefill_wait_s(self, prefill_ahead: Sequence[tuple[int, int]]) -> float:
        """Seconds of the prefill queued ahead on the engine: one batch of them (they share steps)."""
        return self.prefill.fitted_step(prefill_ahead) * self.prefill.scale

    def decide(self, cached_tokens: int, total_tokens: int, tiers: Sequence[str | None]) -> Decision:
        """``cached_tokens`` are already in the pool, ``total_tokens`` must be fed in all (the
        prompt), ``tiers`` holds the tier of each page the daemon has right after the cache."""
        return self.decide_under_load(cached_tokens, total_tokens, tiers, IDLE)

    def decide_under_load(self, cached_tokens: int, total_tokens: int, tiers: Sequence[str | None],
                          load: EngineLoad) -> Decision:
        """``decide`` with the transfers in flight and the prefill queued ahead priced in (module doc)."""
        avail = len(tiers)
        if self.load_mode == "always":
            candidates: Sequence[int] = [avail]
        elif self.load_mode == "never":
            candidates = []
        else:
            candidates = range(1, avail + 1)
        best = self._option(cached_tokens, total_tokens, tiers, load, 0)
        for k in candidates:
            opt = self._option(cached_tokens, total_tokens, tiers, load, k)
            if opt.predicted_total_s < best.predicted_total_s or self.load_mode == "always":
                best = opt
        return best

    def explore(self, cached_tokens: int, total_tokens: int, tiers: Sequence[str | None], load: EngineLoad,
                pages: int) -> Decision:
        """Load the first ``pages`` whatever they cost (outcome ``explore``): a small load that
        measures a tier the model would otherwise bypass on an estimate no load ever confirmed."""
        return self._option(cached_tokens, total_tokens, tiers, load, min(pages, len(tiers)))._replace(outcome="explore")

    def _option(self, cached_tokens: int, total_tokens: int, tiers: Sequence[str | None], load: EngineLoad,
                k: int) -> Decision:
        """What loading the first ``k`` of ``tiers`` and computing the rest is predicted to take."""
        wait = self.transfer_wait_s(load.inflight_bytes) if k else 0.0
        queued = self.prefill_wait_s(load.prefill_ahead)
        recompute = queued + self.prefill.predict(total_tokens - cached_tokens, cached_tokens)
        load_s = self.load_time(tiers[:k])
        ctx = cached_tokens + k * self.page_size
        compute = max(wait + load_s, queued) - wait - load_s + self.prefill.predict(total_tokens - ctx, ctx)
        outcome = "recompute" if k == 0 else ("load_all" if k == len(tiers) else "load_partial")
        counts: dict[str, int] = {}
        for t in tiers[: k or len(tiers)]:
            counts[t or "?"] = counts.get(t or "?", 0) + 1
        tier = max(counts, key=lambda t: counts[t]) if counts else "none"
        return Decision(k, outcome, tier, load_s, compute if k else recompute, recompute, wait, queued)
