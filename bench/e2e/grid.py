"""bench.e2e's cost-model section: the load-or-recompute decision measured around its crossover.

real tiers  for each prefix length and each real tier (unthrottled), one load and one recompute
            on a fresh connector that knows only its start-up probe: how far from the crossover
            the real tiers are (``reach`` = predicted load-then-compute / predicted recompute)
            and how well an unwarmed load of a real tier is predicted.
grid        for each length and each f in RATIOS, a tier speed at which the cost model predicts
            load-then-compute = f x recompute. A real tier is used as it is where its probed speed
            lands within 10% of that; otherwise the slowest real tier still faster than it, slowed
            by the loader's throttle (``Loader.throttle_bps``, a sleep of bytes / throttle per
            read) to the speed wanted. The model is told that speed: its probe of the real tier
            composed with the throttle it was given (1/speed = 1/probed + 1/throttle), never a
            warm-up load at it. Each case is a fresh connector; both options are measured
            ``reps`` times (3), alternating within the case and which goes first case by case,
            and judged on their medians (other processes share the machine: one sample of each
            flipped cases that were 25% from the crossover). The prefill
            model, with the online correction it learns from the engine's timed steps, carries
            from case to case as it would in a running engine; the tiers' models do not.

Figures (bench.e2e.figures): ``accuracy`` over cases whose measured options differ by >= 10%,
``regret`` = Σ(chosen − best) / Σ best over all cases, and the median relative prediction error
of loads and of recomputes, separately.
"""

from __future__ import annotations

import logging
import statistics
import uuid

from bench.e2e import figures as fig
from bench.e2e.support import Bench, offload_prefix, run
from connector.state import kv_state

log = logging.getLogger("bench.e2e")

RATIOS = (0.5, 0.8, 1.25, 2.0)
_REAL_TOLERANCE = 0.1  # a real tier within 10% of the wanted speed is used unthrottled


def _case(b: Bench, eng, address: str, ids: list[int], salt: str, load_first: bool,
          speed: tuple[float, float] | None = None, reps: int = 1) -> dict:
    """One decision on a fresh connector, both options measured ``reps`` times each (alternating,
    medians). ``speed`` = (wanted bytes/s, throttle bytes/s)."""
    # generous deadlines: a lookup past the default 0.25 s on a loaded box marked the daemon down
    # and the load-all run recomputed (07:43 on 2026-12-05, load average 8)
    conn = b.attach(eng, address, load_mode="always", load_deadline_min_s=600.0, lookup_deadline_s=5.0)
    try:
        ps = eng.pool.page_size
        keys = conn.keyspace.keys(ids[: (len(ids) - 1) // ps * ps], salt)
        tiers = conn.loader.lookup(keys, 5.0)
        tier = tiers[0] or "?"
        probed = conn.cost.tier(tier)
        probe = {"latency_s": probed.latency_s, "bytes_per_s": probed.bandwidth, "measured": probed.measured}
        throttle = 0.0
        if speed is not None and speed[1] > 0:
            throttle = speed[1]
            conn.loader.throttle_bps = throttle
            conn.cost.seed(tier, probed.latency_s, 1.0 / (1.0 / probed.bandwidth + 1.0 / throttle))
        conn.cost.load_mode = "auto"
        auto = conn.cost.decide(0, len(ids), tiers)
        conn.cost.load_mode = "always"
        load_all = conn.cost.decide(0, len(ids), tiers)

        def measure(mode: str) -> tuple[float, object]:
            conn.cost.load_mode = mode
            eng.radix.reset()
            conn.known.discard(keys)
            b.before_point(address)  # a disk point starts cold (bench.e2e.cold)
            t, _, r = run(eng, ids, 1, salt)
            return t, r

        order = ("always", "never") if load_first else ("never", "always")
        runs: dict[str, list[tuple[float, object]]] = {"always": [], "never": []}
        for _ in range(reps):
            for mode in order:
                runs[mode].append(measure(mode))
        for _, r in runs["always"]:
            if r.cached_tokens // ps != len(tiers):
                raise RuntimeError(f"a load-all run loaded {r.cached_tokens // ps} of {len(tiers)} pages")
        for _, r in runs["never"]:
            if r.cached_tokens:
                raise RuntimeError(f"a recompute run reused {r.cached_tokens} cached tokens")
        load_runs = [t for t, _ in runs["always"]]
        rec_runs = [t for t, _ in runs["never"]]
        t_load, t_rec = statistics.median(load_runs), statistics.median(rec_runs)
        v = fig.grid_verdict(auto.pages > 0, t_load, t_rec)
        return {
            "tier": tier, "prefix_tokens": len(tiers) * ps, "prompt_tokens": len(ids), "probe": probe,
            "throttle_bytes_per_s": throttle or None, "decision": auto.outcome, "pages": auto.pages,
            "predicted_load_ttft_s": load_all.predicted_total_s, "predicted_load_s": load_all.predicted_load_s,
            "measured_load_ttft_s": t_load,
            "measured_load_s": statistics.median(kv_state(r).load_s for _, r in runs["always"]),
            "predicted_recompute_s": auto.predicted_recompute_s, "measured_recompute_ttft_s": t_rec,
            "reps": reps, "measured_load_ttft_runs": load_runs, "measured_recompute_ttft_runs": rec_runs,
            "predicted_ratio": load_all.predicted_total_s / auto.predicted_recompute_s,
            "measured_ratio": t_load / t_rec, "correct": v.correct, "gap": v.gap,
            "chosen_measured_s": v.chosen_s, "best_measured_s": v.best_s, "load_measured_first": load_first,
        }
    finally:
        conn.loader.throttle_bps = 0.0
        b.detach(eng)


def _figures(cases: list[dict]) -> dict:
    verdicts = [fig.grid_verdict(c["pages"] > 0, c["measured_load_ttft_s"], c["measured_recompute_ttft_s"])
                for c in cases]
    acc, decisive = fig.accuracy(verdicts, 0.1)
    return {
        "accuracy": acc, "decisive_cases": decisive, "regret": fig.regret(verdicts),
        "load_median_error": fig.median_relative_error([c["predicted_load_ttft_s"] for c in cases],
                                                       [c["measured_load_ttft_s"] for c in cases]),
        "recompute_median_error": fig.median_relative_error([c["predicted_recompute_s"] for c in cases],
                                                            [c["measured_recompute_ttft_s"] for c in cases]),
        "policies_total_ttft": {"cost_model_s": sum(c["chosen_measured_s"] for c in cases),
                                "always_load_s": sum(c["measured_load_ttft_s"] for c in cases),
                                "never_load_s": sum(c["measured_recompute_ttft_s"] for c in cases),
                                "best_s": sum(c["best_measured_s"] for c in cases)},
    }


def cost_model_grid(b: Bench, daemons: dict[str, str], lengths: list[int], ratios=RATIOS, reps: int = 3,
                    real_reps: int = 1) -> dict:
    """``reps``: measurements of each option per grid case (medians); ``real_reps``: per real-tier case."""
    salt = "grid-" + uuid.uuid4().hex[:6]
    doc, q = b.text(max(lengths)), b.text(16)
    eng = b.engine((max(lengths) + 64) // 16 + 8)
    full = max(lengths) // 16 * 16
    run(eng, doc[:full], 1, salt)
    offload_prefix(b, eng, daemons.values(), doc[:full], salt)
    real, grid, unreachable, n_case = [], [], [], 0
    for n in lengths:
        ids = doc[:n] + q
        for tier, address in daemons.items():
            real.append(_case(b, eng, address, ids, salt, load_first=n_case % 2 == 0, reps=real_reps))
            n_case += 1
            c = real[-1]
            log.info("real %s n=%d: predicted load/recompute %.3f, measured %.3f", tier, n, c["predicted_ratio"],
                     c["measured_ratio"])
        here = {c["tier"]: c for c in real if c["prompt_tokens"] == len(ids)}
        rec, ps = b.prefill, eng.pool.page_size
        for f in ratios:
            ref = next(iter(here.values()))
            pages = ref["prefix_tokens"] // ps
            nbytes = pages * eng.pool.bytes_per_page
            suffix = rec.predict(len(ids) - pages * ps, pages * ps)
            lat = max(c["probe"]["latency_s"] for c in here.values())
            try:
                want = fig.bandwidth_for(f, ref["predicted_recompute_s"], suffix, lat, nbytes)
            except fig.FigureError as e:  # even an instant load cannot be that cheap at this length
                unreachable.append({"prompt_tokens": len(ids), "target_ratio": f, "why": str(e)})
                log.warning("grid n=%d f=%.2f skipped: %s", n, f, e)
                continue
            near = [t for t, c in here.items() if abs(c["probe"]["bytes_per_s"] / want - 1) <= _REAL_TOLERANCE]
            if near:
                tier, throttle = near[0], 0.0
            else:
                faster = {t: c["probe"]["bytes_per_s"] for t, c in here.items() if c["probe"]["bytes_per_s"] > want}
                tier = min(faster, key=faster.__getitem__)
                throttle = fig.throttle_for(want, faster[tier])
            c = _case(b, eng, daemons[tier], ids, salt, load_first=n_case % 2 == 0, speed=(want, throttle),
                      reps=reps)
            n_case += 1
            c.update({"target_ratio": f, "wanted_bytes_per_s": want, "base_tier": tier})
            grid.append(c)
            log.info("grid n=%d f=%.2f on %s (throttle %.3g B/s): %s; predicted %.3f, measured load %.3f / "
                     "recompute %.3f%s", n, f, tier, throttle, c["decision"], c["predicted_ratio"],
                     c["measured_load_ttft_s"], c["measured_recompute_ttft_s"], "" if c["correct"] else "  WRONG")
    out = {"grid_cases": len(grid), "ratios": list(ratios), "lengths": lengths, "reps": reps,
           "unreachable": unreachable, **_figures(grid)}
    out["real_tiers"] = {
        "reach": {t: {str(c["prompt_tokens"]): c["predicted_ratio"] for c in real if c["tier"] == t}
                  for t in daemons},
        "load_median_error": fig.median_relative_error([c["predicted_load_ttft_s"] for c in real],
                                                       [c["measured_load_ttft_s"] for c in real]),
        "recompute_median_error": fig.median_relative_error([c["predicted_recompute_s"] for c in real],
                                                            [c["measured_recompute_ttft_s"] for c in real]),
        "decided_right": sum(c["correct"] for c in real) / len(real),
        "cases": real,
    }
    out["cases"] = grid
    out["prefill_model"] = list(b.prefill[:3]) if b.prefill else None  # the start-up fit (a, b, c)
    out["prefill_scale"] = b.prefill.scale if b.prefill else None  # its online correction at the end
    out["prefill_steps_observed"] = b.prefill.observed if b.prefill else None
    out["median_measured_over_predicted_recompute"] = statistics.median(
        c["measured_recompute_ttft_s"] / c["predicted_recompute_s"] for c in grid)
    return out
