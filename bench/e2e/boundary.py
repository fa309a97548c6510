"""The cost model at its boundary: decisions where loading and recomputing cost about the same,
over a slow path the model has to learn (#23 part 2).

The daemon sits behind a real slow link (bench/slow_link.py: a rate-limited TCP proxy; shared
memory and the raw channel off, so every byte crosses it). Nothing tells the connector the link's
speed: each case attaches a fresh connector through the link (its start-up probe measures it),
which then makes ``learn_loads`` real loads through it (each folded into its bandwidth estimate,
connector/cost_model.py ``observe``) before it is asked to decide. The link's rate is set per case
so that the load would cost ``ratio`` x the recompute by the bench's own arithmetic (a target, not
what the model is told); what is recorded is the model's own predicted ratio after learning, the
decision, and both options measured ``reps`` times, alternating.

Figures (``cost_model`` in bench.e2e's JSON): ``grid_ratios`` (the targets), ``accuracy_all`` (the
share of every case decided right: no filter for cases near the crossover), ``regret_all``,
``bias`` (mean of predicted minus measured load/recompute ratio: > 0 means the model thinks loading
slower than it is and leans to recompute), ``bias_load`` / ``bias_recompute`` (mean relative error
of each side's prediction), ``slow_path`` (what made the tier slow).
"""

from __future__ import annotations

import logging
import statistics
import uuid

from bench.e2e import figures as fig
from bench.e2e.support import Bench, offload_prefix, run
from bench.slow_link import SlowLink

log = logging.getLogger("bench.e2e")

GRID = tuple(round(0.7 + 0.05 * i, 2) for i in range(13))  # 0.70 .. 1.30


def _measure(eng, conn, keys, ids: list[int], salt: str, mode: str) -> float:
    conn.cost.load_mode = mode
    eng.radix.reset()
    conn.known.discard(keys)
    t, _, r = run(eng, ids, 1, salt)
    ps = eng.pool.page_size
    if mode == "always" and r.cached_tokens // ps != len(keys):
        raise RuntimeError(f"a load-all run through the slow link loaded {r.cached_tokens // ps} of {len(keys)} pages")
    if mode == "never" and r.cached_tokens:
        raise RuntimeError(f"a recompute run reused {r.cached_tokens} cached tokens")
    return t


def _case(b: Bench, eng, link: SlowLink, ids: list[int], salt: str, ratio: float, rate: float, reps: int,
          learn_loads: int, load_first: bool) -> dict:
    link.set_rate(rate)
    conn = b.attach(eng, link.address, load_mode="always", use_shm=False, load_deadline_min_s=600.0)
    try:
        ps = eng.pool.page_size
        keys = conn.keyspace.keys(ids[: (len(ids) - 1) // ps * ps], salt)
        tiers = conn.loader.lookup(keys, 30.0)
        if len(tiers) != len(keys):
            raise RuntimeError(f"the daemon holds {len(tiers)} of {len(keys)} pages")
        tier = tiers[0] or "?"
        probed = conn.cost.tier(tier)
        seen = {"latency_s": probed.latency_s, "bytes_per_s": probed.bandwidth}
        learned = [_measure(eng, conn, keys, ids, salt, "always") for _ in range(learn_loads)]
        conn.cost.load_mode = "auto"
        auto = conn.cost.decide(0, len(ids), tiers)
        conn.cost.load_mode = "always"
        load_all = conn.cost.decide(0, len(ids), tiers)
        model = conn.cost.tier(tier)
        runs: dict[str, list[float]] = {"always": [], "never": []}
        for _ in range(reps):
            for mode in ("always", "never") if load_first else ("never", "always"):
                runs[mode].append(_measure(eng, conn, keys, ids, salt, mode))
        t_load, t_rec = statistics.median(runs["always"]), statistics.median(runs["never"])
        v = fig.grid_verdict(auto.pages > 0, t_load, t_rec)
        return {
            "target_ratio": ratio, "link_bytes_per_s": rate, "pages": len(keys), "prompt_tokens": len(ids),
            "probe": seen, "learn_loads_s": learned,
            "learned": {"latency_s": model.latency_s, "bytes_per_s": model.bandwidth, "loads": model.measured},
            "decision": auto.outcome, "pages_loaded": auto.pages,
            "predicted_load_ttft_s": load_all.predicted_total_s, "predicted_recompute_s": auto.predicted_recompute_s,
            "predicted_ratio": load_all.predicted_total_s / auto.predicted_recompute_s,
            "measured_load_ttft_s": t_load, "measured_recompute_ttft_s": t_rec, "measured_ratio": t_load / t_rec,
            "measured_load_ttft_runs": runs["always"], "measured_recompute_ttft_runs": runs["never"],
            "correct": v.correct, "gap": v.gap, "chosen_measured_s": v.chosen_s, "best_measured_s": v.best_s,
        }
    finally:
        b.detach(eng)


def figures(cases: list[dict]) -> dict:
    """accuracy_all, regret_all and the signed biases over every case (module doc)."""
    if not cases:
        raise fig.FigureError("boundary: no cases")
    verdicts = [fig.grid_verdict(c["pages_loaded"] > 0, c["measured_load_ttft_s"], c["measured_recompute_ttft_s"])
                for c in cases]
    mean = statistics.fmean
    return {
        "accuracy_all": sum(v.correct for v in verdicts) / len(verdicts), "cases_all": len(verdicts),
        "regret_all": fig.regret(verdicts),
        "bias": mean(c["predicted_ratio"] - c["measured_ratio"] for c in cases),
        "bias_load": mean(c["predicted_load_ttft_s"] / c["measured_load_ttft_s"] - 1 for c in cases),
        "bias_recompute": mean(c["predicted_recompute_s"] / c["measured_recompute_ttft_s"] - 1 for c in cases),
        "predicted_ratio_range": [min(c["predicted_ratio"] for c in cases), max(c["predicted_ratio"] for c in cases)],
        "measured_ratio_range": [min(c["measured_ratio"] for c in cases), max(c["measured_ratio"] for c in cases)],
    }


def boundary_grid(b: Bench, address: str, prefix_tokens: int, ratios=GRID, reps: int = 3,
                  learn_loads: int = 2) -> dict:
    """The cases of the module doc over one prompt of ``prefix_tokens`` + a 16-token question; the
    daemon at ``address`` must serve without shared memory and without its raw channel."""
    salt = "boundary-" + uuid.uuid4().hex[:6]
    doc, q = b.text(prefix_tokens), b.text(16)
    ids = doc + q
    eng = b.engine((len(ids) + 64) // 16 + 8)
    run(eng, doc, 1, salt)
    offload_prefix(b, eng, [address], doc, salt)  # straight to the daemon: only loads cross the link
    cases: list[dict] = []
    with SlowLink(address) as link:
        # where to put the link: the model's own prediction of the recompute, the suffix after the
        # prefix and a latency measured through the unthrottled link; the model is told none of it
        conn = b.attach(eng, link.address, load_mode="always", use_shm=False)
        ps = eng.pool.page_size
        pages = (len(ids) - 1) // ps
        rec = conn.cost.prefill.predict(len(ids), 0) * conn.cost.prefill.scale
        suffix = conn.cost.prefill.predict(len(ids) - pages * ps, pages * ps) * conn.cost.prefill.scale
        lat = conn.cost.tier("cpu").latency_s
        b.detach(eng)
        nbytes = pages * eng.pool.bytes_per_page
        for i, r in enumerate(ratios):
            try:
                rate = fig.bandwidth_for(r, rec, suffix, lat, nbytes)
            except fig.FigureError as e:
                log.warning("boundary ratio %.2f skipped: %s", r, e)
                continue
            c = _case(b, eng, link, ids, salt, r, rate, reps, learn_loads, load_first=i % 2 == 0)
            cases.append(c)
            log.info("boundary %.2f (link %.3g MB/s): predicted %.3f measured %.3f -> %s%s", r, rate / 1e6,
                     c["predicted_ratio"], c["measured_ratio"], c["decision"], "" if c["correct"] else "  WRONG")
        forwarded = link.bytes_forwarded
    return {"grid_ratios": list(ratios), "reps": reps, "learn_loads": learn_loads, "prefix_tokens": prefix_tokens,
            **figures(cases),
            "slow_path": {"kind": "rate-limited TCP proxy on loopback (bench/slow_link.py), shared memory and the "
                                  "raw channel off; the model learns the link from its probe and its own loads",
                          "told_speed": False, "bytes_forwarded": forwarded},
            "cases": cases}


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.e2e.boundary --out F.json [--quick]``: the grid alone (bench.e2e runs it too)."""
    import argparse
    import json
    import os
    import tempfile
    from pathlib import Path

    import torch

    from bench.e2e.support import kv_daemon, machine_facts
    from connector.calibrate import calibrate_prefill
    from engine.model_loader import load_model

    ap = argparse.ArgumentParser(prog="python -m bench.e2e.boundary", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a 512-token prefix (else 1024)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("connector").setLevel(logging.WARNING)
    torch.set_num_threads(a.threads)
    machine = machine_facts()
    b = Bench(load_model(""), a.threads)
    b.prefill = calibrate_prefill(b.engine(256).view)
    with tempfile.TemporaryDirectory(prefix="tierkv-boundary-") as work:
        with kv_daemon(Path(work) / "d", "--cpu", "1GiB", "--no-stream") as address:
            doc = boundary_grid(b, address, 512 if a.quick else 1024, reps=a.reps)
    machine["loadavg_end"] = list(os.getloadavg())
    doc.update(threads=a.threads, machine=machine)
    Path(a.out).write_text(json.dumps(doc, indent=2, default=float))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("cases", "machine")}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
