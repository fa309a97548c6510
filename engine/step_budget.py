"""The prompt tokens one step may take, and how many of them may slow another tenant's stream.

A step feeds every decoding request one token, then prompt chunks up to ``max_prefill_tokens`` in
all. On the CPU a prompt token rides almost free on a decode step's weights only while the step is
small; past a few rows each one is compute (SmolLM2-135M on one thread: a decode step ~40 ms, each
prompt token ~2.7 ms more), so a step full of someone else's prompts stretches every stream's gap
between tokens: a flood of 5-token completions from one tenant (bench.soak's salt flood) held
another tenant's stream at ~0.27 s per token, ~7x its gap alone (bench.tenant_flood).

``cross_tenant_step_share`` bounds that in time: the prompt tokens of requests whose tenant differs
from a tenant decoding in the step (*cross* prefills) may add at most that share of a decode-only
step. ``StepCost`` learns both from the engine's own steps (a least-squares line of step seconds
over prompt tokens, old steps fading; a decode-only step measured as such; and how far steps of a
few prompt tokens run past the line), so the bound follows the machine: 1-3 tokens on one CPU
thread, more with more threads, the whole budget on a GPU, where a prompt token costs next to
nothing. Until it has measured, ``page_size`` tokens; never less than one token (the bounded tenant
still moves).

A tenant's own prompts are not bounded by its own streams (its trade-off to make, as with one
tenant), nor by the streams of a tenant that asks as much of the engine or more (requests in it:
equals share steps as one tenant's requests do); with one tenant (or none: no API keys) nothing
changes. The cost is the bounded tenant's TTFT while another tenant decodes: its prompt is fed in
chunks of the bound.

A prompt protects its tenant too. The scheduler feeds prompts in a fair order (the tenant with the
fewest requests in the engine first: engine/scheduler.py ``fair``), and the tenant first in that
order is protected in the step as a decoding one is: the other tenants' prompts in the step,
running prefills among them, are cross. Before, a tenant's one new request waited behind another
tenant's queue of 32 and then shared a step with ~20 of its prompts: its TTFT was 0.70 s against
0.06 s alone (bench.tenant_flood).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from engine.request import Request

FADE = 0.98  # each step's weight in the fit, relative to the next one's: ~50 steps remembered
MIN_STEPS = 8.0  # weight of steps before the fit is trusted
MIN_SPREAD = 4.0  # tokens: the prompt sizes seen must differ by about this much to give a slope
SMALL = 32  # prompt tokens up to which a step is a "small" one, the bound's range on a CPU
LEARN = 0.1  # weight of each new step in the decode-only step's and the small steps' averages


class StepCost:
    """Step seconds ≈ ``base_s`` + ``token_s`` × prompt tokens, fitted over recent steps; and, apart
    from the line, what a decode-only step takes and how far small steps run past the line.

    Why apart: on the CPU the line is learnt mostly from big steps (a tenant's prompts alone take
    the whole budget), while the bound lives at a few tokens, where a step pays for going from one
    row to several (the linear layers' small-row forms, another sequence in attention) before any
    token's own cost. A flood's steps at 3-4 tokens took 55-59 ms against 36 ms decode-only, where
    the line said 45: the share of 0.25 was a share of 0.5-0.65 (a step log, bench.tenant_flood)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._last: tuple[float, float] | None = None  # the last fit the steps could tell apart
        self._decode_s: float | None = None  # a decode-only step (no prompt tokens), averaged
        self._excess = 0.0  # small steps' seconds past the line, as a share of a decode-only step

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        x = float(prompt_tokens)
        self._w = self._w * FADE + 1.0
        self._x = self._x * FADE + x
        self._y = self._y * FADE + seconds
        self._xx = self._xx * FADE + x * x
        self._xy = self._xy * FADE + x * seconds
        if prompt_tokens == 0:
            d = self._decode_s
            self._decode_s = seconds if d is None else d + LEARN * (seconds - d)
        elif prompt_tokens <= SMALL and (f := self.fit()) is not None:
            base = self.decode_step_s(f)
            self._excess += LEARN * ((seconds - base - f[1] * x) / base - self._excess)

    def fit(self) -> tuple[float, float] | None:
        """(base_s, token_s): of the recent steps, or of the last ones whose prompt sizes differed
        enough to tell the two apart (a steady load of one size cannot); None before any."""
        if self._w >= MIN_STEPS:
            mx, my = self._x / self._w, self._y / self._w
            var = self._xx / self._w - mx * mx
            if var >= MIN_SPREAD * MIN_SPREAD:
                slope = (self._xy / self._w - mx * my) / var
                base = my - slope * mx
                if slope > 0 and base > 0:
                    self._last = (base, slope)
        return self._last

    def decode_step_s(self, fit: tuple[float, float]) -> float:
        """A decode-only step's seconds: measured, or the line's base before any was seen."""
        return self._decode_s if self._decode_s is not None else fit[0]

    def cross_tokens(self, share: float, fallback: int) -> int:
        """Prompt tokens that add about ``share`` of a decode-only step (``fallback`` before a fit);
        at least one, so that a tenant bounded by another's stream still moves."""
        f = self.fit()
        if f is None:
            return fallback
        base = self.decode_step_s(f)
        return max(1, math.floor((share - max(self._excess, 0.0)) * base / f[1] + 1e-9))


class StepBudget:
    """``total`` prompt tokens left in the step; of them at most ``cross`` for cross prefills (None:
    no bound) — cross: the request's tenant differs from one of ``protected``, the step's tenants
    whose time it bounds (the scheduler's: those decoding in the step, and the tenant first in its
    fair order of prompts), and asks more of the engine than that one (``demand``: requests in the
    engine per tenant, engine/scheduler.py ``tenant_demand``; None: any other tenant is cross).

    Why only more: tenants that ask as much as each other share the engine as one tenant's requests
    do (chunked prefill bounds everyone alike), and bounding each by the others' streams cut a load
    of several tenants taking turns to a few prompt tokens a step. A tenant past another's demand (a
    flood of 32 against one stream) is the one whose prompts stretch the other's gaps."""

    def __init__(self, total: int, cross: int | None, protected: Iterable[str],
                 demand: Mapping[str, int] | None = None) -> None:  # fmt: skip
        self.total = max(total, 0)
        self._tenants = frozenset(protected)
        self._demand = demand
        self.cross_left = cross

    def is_cross(self, req: Request) -> bool:
        if self.cross_left is None:
            return False
        others = self._tenants - {req.tenant}
        if self._demand is None:
            return bool(others)
        mine = self._demand.get(req.tenant, 0)
        return any(self._demand.get(t, 0) < mine for t in others)

    def allows(self, req: Request) -> int:
        """Prompt tokens ``req`` may take now (0: none this step)."""
        if self.is_cross(req):
            return max(min(self.total, self.cross_left or 0), 0)
        return self.total

    def take(self, req: Request, n: int) -> None:
        if self.is_cross(req):
            self.cross_left = (self.cross_left or 0) - n
        self.total -= n
