"""The soak's security figures, as pure functions of what its probes recorded (tests:
tests/bench/soak/test_security_figures.py). The probes are bench/soak/tenant_probes.py,
forge.py, dos.py and shm_reclaim.py.

- A **refusal** is PERMISSION_DENIED or UNAUTHENTICATED, nothing else: a call answered with any
  other error was not refused (the daemon may have been down, or the check may never have run),
  and anything served is a read. Where the design answers a request with a miss instead (the
  engine computing another tenant's prompt from scratch: B may not know A's prompt exists), the
  outcome is ``miss``, counted with the refusals and shown apart.
- A **forged block served**: an answer over forged blocks that differs from the prompt's cold
  reference. Beside it, the daemon's corrupt-block counter tells whether the forgery was read at
  all (a probe whose blocks were never read proves nothing: ``forged_probes_exercised``).
- **DoS**: a normal client's inter-token gaps while a probe runs against those of the same client
  just before it (``itl_p99_ratio``), the slowest health answer during the probe (a failed or
  timed-out check counts as its whole wait), and RSS growth (median of readings after the probe
  minus median before).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import grpc

READ, REFUSED, MISSED, UNCLEAR = "read", "refused", "miss", "unclear"
REFUSAL_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})
REUSED_PAGES = ("radix", "loaded")  # page outcomes whose KV was not computed for the request


class Attempt(NamedTuple):
    path: str  # "grpc.Get", "raw.Get", "shm.arena", "engine", ...
    outcome: str  # READ | REFUSED | MISSED | UNCLEAR
    detail: str = ""


def grpc_outcome(code: grpc.StatusCode) -> str:
    """What a call that failed with ``code`` was: a refusal only for PERMISSION_DENIED / UNAUTHENTICATED."""
    return REFUSED if code in REFUSAL_CODES else UNCLEAR


def engine_attempt(a: Any) -> Attempt:
    """Another tenant's request for a private prompt (a bench.soak.load.Answer): a read if any of
    its prompt was not computed for it — by the reported cached tokens, by the sources of its
    cached tokens, or by its pages' outcomes (from the radix tree, loaded from the daemon)."""
    if a.error is not None:
        return Attempt("engine", UNCLEAR, a.error[:120])
    reused = max(a.cached, 0) + sum(a.sources.values()) + sum(a.pages.get(r, 0) for r in REUSED_PAGES)
    return Attempt("engine", READ if reused else MISSED, f"cached={a.cached} sources={a.sources} pages={a.pages}")


def cross_tenant(attempts: Iterable[Attempt]) -> dict[str, Any]:
    """``reads`` (the target: 0), with every attempt's outcome by path."""
    by_path: dict[str, Counter[str]] = defaultdict(Counter)
    for a in attempts:
        by_path[a.path][a.outcome] += 1
    total: Counter[str] = sum(by_path.values(), Counter())
    return {"reads": total[READ], "refused": total[REFUSED], "missed": total[MISSED], "unclear": total[UNCLEAR],
            "attempts": sum(total.values()), "by_path": {p: dict(c) for p, c in sorted(by_path.items())}}  # fmt: skip


def auth_refused(code: grpc.StatusCode | None) -> bool:
    """The unauthenticated probe's rule: None (the call was served) and any other code are not refusals."""
    return code in REFUSAL_CODES


class Forgery(NamedTuple):
    tier: str  # "redis" | "s3"
    kind: str  # "unsigned" | "mac" | "unknown_secret"
    planted: int  # forged blocks written
    reference: str | None  # the prompt's cold answer (None: none was cold)
    text: str | None  # the answer over the forged blocks (None: the request failed)
    corrupt_delta: float | None  # the daemon's corrupt-block counter over the victim's request (None: unknown)
    left: int | None  # forged values still in the tier afterwards
    error: str = ""


def forged_figures(forgeries: Sequence[Forgery]) -> dict[str, Any]:
    """``forged_blocks_served``: forgeries whose answer differs from the cold reference (0 is the
    target); ``forged_probes_exercised``: those the daemon read and refused (its counter moved);
    ``forged_unclear``: no answer or no reference to judge by."""
    served = unclear = exercised = 0
    for f in forgeries:
        if f.text is None or f.reference is None:
            unclear += 1
        elif f.text != f.reference:
            served += 1
        if f.corrupt_delta:
            exercised += 1
    return {"forged_blocks_served": served, "forged_probes": len(forgeries), "forged_probes_exercised": exercised,
            "forged_unclear": unclear, "forged_blocks_planted": sum(f.planted for f in forgeries),
            "forged_blocks_refused": sum(f.corrupt_delta or 0 for f in forgeries)}  # fmt: skip


def gaps_in(answers: Iterable[Any], lo: float, hi: float, overlapping: bool = False) -> list[float]:
    """Gaps between consecutive content chunks of the answers without an error, by when they
    happened: each gap within [lo, hi], or (``overlapping``) each that overlaps it at all — so a
    stall that began under a probe and ended after it still counts against the probe."""
    out: list[float] = []
    for a in answers:
        if a.error is not None:
            continue
        for x, y in zip(a.token_times, a.token_times[1:], strict=False):
            if (x < hi and y > lo) if overlapping else (lo <= x and y <= hi):
                out.append(y - x)
    return out


def health_in(samples: Iterable[tuple[float, float, float]], lo: float, hi: float) -> list[float]:
    """Seconds of each health answer (asked at t0, answered or given up at t1) that overlaps [lo, hi]."""
    return [s for t0, t1, s in samples if t0 < hi and t1 > lo]


def p99(values: Sequence[float], at_least: int = 20) -> float | None:
    """The 99th percentile (nearest rank); None with fewer than ``at_least`` values."""
    if len(values) < at_least:
        return None
    s = sorted(values)
    return s[math.ceil(0.99 * len(s)) - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def growth_mb(before: Sequence[float], after: Sequence[float]) -> float | None:
    """Median of the readings after minus median of those before (MB); None without both."""
    if not before or not after:
        return None
    return round(statistics.median(after) - statistics.median(before), 2)


def dos_figures(base_gaps: Sequence[float], under_gaps: Sequence[float], health_s: Sequence[float],
                rss_before: Sequence[float] = (), rss_after: Sequence[float] = ()) -> dict[str, Any]:  # fmt: skip
    """One DoS probe: the normal client's inter-token gaps without (``base_gaps``) and with
    (``under_gaps``) it, the health answers' seconds during it, RSS readings (MB) around it."""
    b, u = p99(base_gaps), p99(under_gaps)
    out = {"itl_p99_ratio": ratio(u, b), "itl_p99_base_s": _r4(b), "itl_p99_under_s": _r4(u),
           "itl_gaps": [len(base_gaps), len(under_gaps)],
           "health_max_s": round(max(health_s), 3) if health_s else None, "health_checks": len(health_s)}  # fmt: skip
    if rss_before or rss_after:
        out["rss_growth_mb"] = growth_mb(rss_before, rss_after)
    return out


def dos_repeated(pairs: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]],
                 rss_before: Sequence[float] = (), rss_after: Sequence[float] = ()) -> dict[str, Any]:
    """One DoS probe run as several pairs of windows, each (``base_gaps``, ``under_gaps``, ``health_s``)
    as ``dos_figures`` takes them, RSS readings (MB) before the first and after the last. Headline
    ``itl_p99_ratio``: the median of the pairs' ratios (each in ``itl_p99_ratio_runs``, in order: the
    first is what a single pair measured), None where any pair had too few gaps (missing, never met);
    ``itl_p99_ratio_pooled``, ``itl_p99_base_s`` / ``itl_p99_under_s`` and ``itl_gaps`` over every
    pair's gaps pooled; ``health_max_s`` the slowest health answer under any of them."""
    if not pairs:
        raise ValueError("dos_repeated: no pairs of windows")
    runs = [dos_figures(b, u, h)["itl_p99_ratio"] for b, u, h in pairs]
    pooled = dos_figures([g for b, _, _ in pairs for g in b], [g for _, u, _ in pairs for g in u],
                         [s for _, _, h in pairs for s in h], rss_before, rss_after)  # fmt: skip
    known = [r for r in runs if r is not None]
    return {**pooled, "itl_p99_ratio": round(statistics.median(known), 3) if len(known) == len(runs) else None,
            "itl_p99_ratio_runs": runs, "itl_p99_ratio_pooled": pooled["itl_p99_ratio"]}


def _r4(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def reclaim_seconds(killed_at: float, readings: Iterable[tuple[float, bool]]) -> float | None:
    """Seconds from the kill to the first reading (time, still mapped) where the daemon no longer
    maps the dead client's segments; None if it still did at every reading."""
    for t, mapped in sorted(readings):
        if t >= killed_at and not mapped:
            return round(t - killed_at, 2)
    return None
