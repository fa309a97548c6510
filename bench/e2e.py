"""End-to-end benchmark of the engine + connector + kvstore daemon (SmolLM2-135M, fp32, CPU).

    python -m bench.e2e --out F.json [--quick] [--threads N]

Everything runs in this process (engines on separate KV pools, one model in memory) against
real daemons in subprocesses: one per tier (cpu only, disk only, s3 only on a local SeaweedFS),
so a hit's tier is never ambiguous. Each section uses its own ``cache_salt``, so sections never
see each other's blocks. Requests run one at a time; TTFT is admission to first token.

Sections:
  headline   a 2k-token document + question: cold TTFT, warm TTFT from each tier, the local
             radix hit (the suffix compute alone), fidelity across all of them, and the floor
             (KV bytes / measured memcpy bandwidth + suffix compute).
  replicas   two engines sharing the cpu daemon: share of the second's prefix tokens it loads.
  sweep      tiers x prefix lengths x throttled bandwidths (the loader's bandwidth test double):
             the cost model's choice against the measured load and recompute TTFTs, and the
             totals of cost-model / always-load / never-load over those same cases.
  workloads  (a) multi-round chat, shared system prompt, growing histories, KV pool smaller
             than the working set; (b) long-document QA, questions round-robin. Configurations:
             no cache, local radix only, radix + daemon (cpu / disk / s3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch

from connector.wiring import attach_tierkv, detach_tierkv
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import load_model
from engine.request import Request, Status
from engine.sampling import SamplingParams
from kvstore.launch import running_daemon

log = logging.getLogger("bench.e2e")
TIERS = ("cpu", "disk", "s3")


# -- infrastructure --------------------------------------------------------------------------
@contextmanager
def kv_daemon(work: Path, *flags: str, env: dict[str, str] | None = None):
    work.mkdir(parents=True, exist_ok=True)
    with running_daemon(work, *flags, env=env, log_path=work / "daemon.log") as address:
        yield address


class Bench:
    def __init__(self, loaded, threads: int, prefill=None) -> None:
        self.loaded, self.threads, self.prefill = loaded, threads, prefill
        rng = np.random.default_rng(1234)
        self.rng = rng

    def engine(self, num_pages: int) -> LLMEngine:
        cfg = EngineConfig(num_pages=num_pages, num_threads=self.threads, max_prefill_tokens=8192)
        eng = LLMEngine(cfg, loaded=self.loaded)
        eng.pool.kv.fill_(0.0)  # fault the pool's memory in now, not inside the first timed request
        return eng

    def attach(self, eng: LLMEngine, address: str, **kw: object):
        conn = attach_tierkv(eng, address, prefill=self.prefill, **kw)
        self.prefill = conn.cost.prefill  # calibrate once per process
        return conn

    def text(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(200, 40000, n)]


def run(eng: LLMEngine, ids: list[int], max_tokens: int, salt: str | None) -> tuple[float, float, Request]:
    t0 = time.monotonic()
    rid = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)
    req = eng.requests[rid]
    while req.status is not Status.FINISHED:
        eng.step()
    return req.first_token_time - t0, time.monotonic() - t0, req  # type: ignore[operator]


def loaded_by_tier(conn) -> dict[str, float]:
    return {t: conn.metrics.value("tierkv_connector_loaded_tokens_total", tier=t) for t in (*TIERS, "redis")}


def memcpy_bandwidth() -> float:
    a = np.ones(256 * 2**20 // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# -- sections --------------------------------------------------------------------------------
def headline(b: Bench, daemons: dict[str, str], doc_len: int, reps: int) -> dict:
    salt = "headline-" + uuid.uuid4().hex[:6]
    ids = b.text(doc_len) + b.text(24)
    pages = (len(ids) + 64) // 16 + 8
    eng = b.engine(pages)
    cold_ttft, _, cold = run(eng, ids, 8, salt)
    want = cold.output_ids
    outputs = {"cold": want}
    radix_ttfts = []
    full = len(ids) // 16 * 16
    m = eng.radix.match_prefix(ids[:full], record_stats=False, salt=salt)
    warm, warm_runs, decisions, kv_bytes = {}, {}, {}, 0
    for address in daemons.values():  # offload through the connector's own path, then reload
        conn = b.attach(eng, address, load_mode="auto")
        conn.save(conn.keyspace.keys(ids[:full], salt), m.pages)
        conn.flush(300)
        detach_tierkv(eng)
    engines = {tier: b.engine(pages) for tier in daemons}  # one reader per tier, runs interleaved
    conns = {tier: b.attach(engines[tier], address, load_mode="auto") for tier, address in daemons.items()}
    ts: dict[str, list[float]] = {tier: [] for tier in daemons}
    for i in range(reps + 1):  # round 0 is a discarded warm-up; rounds alternate the tiers
        for tier in daemons:
            eng2, conn = engines[tier], conns[tier]
            eng2.radix.reset()
            conn.known.discard(conn.keyspace.keys(ids, salt))
            t, _, r = run(eng2, ids, 8, salt)
            outputs[tier] = r.output_ids
            d = r.kv.decision if r.kv is not None else None
            decisions[tier] = d._asdict() if d else None
            if tier == "cpu":
                kv_bytes = (d.pages if d else 0) * eng2.pool.bytes_per_page
            if i:
                ts[tier].append(t)
                warm_runs.setdefault(tier, []).append({"ttft_s": t, "load_s": r.kv.load_s if r.kv is not None else None})
        t, _, r = run(eng, ids, 8, salt)  # the local radix hit: the suffix compute alone, same round
        outputs["radix"] = r.output_ids
        if i:
            radix_ttfts.append(t)
    for tier, eng2 in engines.items():
        warm[tier] = statistics.median(ts[tier])
        detach_tierkv(eng2)
    bw = memcpy_bandwidth()
    suffix = statistics.median(radix_ttfts)
    floor = kv_bytes / bw + suffix
    log.info("headline: cold %.2fs, radix %.3fs, warm %s", cold_ttft, suffix, warm)
    return {
        "prompt_tokens": len(ids), "cold_ttft_s": cold_ttft, "radix_ttft_s": suffix, "warm_ttft_s": warm,
        "warm_runs": warm_runs, "radix_runs": radix_ttfts, "decisions": decisions, "kv_bytes_loaded": kv_bytes,
        "memcpy_bytes_per_s": bw, "floor_s": floor,
        "speedup_cpu": cold_ttft / warm["cpu"], "floor_ratio_cpu": warm["cpu"] / floor,
        "fidelity_identical": all(o == want for o in outputs.values()), "outputs_compared": sorted(outputs),
    }


def replicas(b: Bench, address: str, n_docs: int, doc_len: int) -> dict:
    salt = "replicas-" + uuid.uuid4().hex[:6]
    docs = [b.text(doc_len) for _ in range(n_docs)]
    pages = (doc_len + 128) // 16 * 2
    first, second = b.engine(pages), b.engine(pages)
    c1 = b.attach(first, address, load_mode="auto", write_through=True)
    c2 = b.attach(second, address, load_mode="auto", write_through=True)
    rows, shared_tokens, ttfts = [], 0, []
    for doc in docs:
        run(first, doc + b.text(20), 8, salt)
    c1.flush(300)
    for doc in docs:
        t, _, r = run(second, doc + b.text(20), 8, salt)
        ttfts.append(t)
        shared_tokens += doc_len // 16 * 16
        rows.append({"ttft_s": t, "cached_tokens": r.cached_tokens})
    loaded = sum(loaded_by_tier(c2).values())
    detach_tierkv(first)
    detach_tierkv(second)
    return {"docs": n_docs, "doc_tokens": doc_len, "second_replica": rows, "prefix_tokens": shared_tokens,
            "loaded_from_daemon_tokens": loaded, "replica_hit_rate": loaded / shared_tokens}


def sweep(b: Bench, daemons: dict[str, str], lengths: list[int], throttles: list[float],
          throttled_tiers: list[str]) -> dict:
    salt = "sweep-" + uuid.uuid4().hex[:6]
    doc = b.text(max(lengths))
    q = b.text(16)
    eng = b.engine((max(lengths) + 64) // 16 + 8)
    full = max(lengths) // 16 * 16
    eng.radix.reset()
    run(eng, doc[:full], 1, salt)
    m = eng.radix.match_prefix(doc[:full], record_stats=False, salt=salt)
    cases = []
    for tier, address in daemons.items():
        conn = b.attach(eng, address, load_mode="always")
        # the truth of a load is its full time: no deadline cuts it short in the sweep
        conn.cfg = dataclasses.replace(conn.cfg, load_deadline_min_s=600.0)
        conn.save(conn.keyspace.keys(doc[:full], salt), m.pages)
        conn.flush(300)
        for thr in throttles if tier in throttled_tiers else [0.0]:
            conn.loader.throttle_bps = thr
            warm_ids = doc[: min(lengths)] + q  # one load to let the EWMA see this bandwidth
            eng.radix.reset()
            conn.known.discard(conn.keyspace.keys(warm_ids, salt))
            conn._down_until = 0.0
            run(eng, warm_ids, 1, salt)
            for n in lengths:
                ids = doc[:n] + q
                conn._down_until = 0.0  # a deadline-cut warm-up must not turn the next load into a recompute
                eng.radix.reset()
                conn.known.discard(conn.keyspace.keys(ids, salt))
                tiers = conn.loader.lookup(conn.keyspace.keys(ids[: (len(ids) - 1) // 16 * 16], salt), 5.0)
                conn.cost.load_mode = "auto"
                auto = conn.cost.decide(0, len(ids), tiers)
                conn.cost.load_mode = "always"
                load_all = conn.cost.decide(0, len(ids), tiers)
                t_load = run(eng, ids, 1, salt)[0]
                # the no-load option measured right after (other processes share this machine:
                # both options must be timed under the same load), through the same connector
                conn.cost.load_mode = "never"
                eng.radix.reset()
                t_rec = run(eng, ids, 1, salt)[0]
                conn.cost.load_mode = "always"
                picked_load = auto.pages > 0
                correct = picked_load == (t_load < t_rec)
                cases.append({
                    "tier": tier, "throttle_bytes_per_s": thr or None, "prefix_tokens": n,
                    "decision": auto.outcome, "pages": auto.pages, "predicted_load_ttft_s": load_all.predicted_total_s,
                    "measured_load_ttft_s": t_load, "predicted_recompute_s": auto.predicted_recompute_s,
                    "measured_recompute_ttft_s": t_rec, "correct": correct,
                    "chosen_measured_s": t_load if picked_load else t_rec,
                })
                log.info("sweep %s thr=%s n=%d: %s (pred load %.3f / rec %.3f, measured %.3f / %.3f)%s", tier, thr,
                         n, auto.outcome, load_all.predicted_total_s, auto.predicted_recompute_s, t_load, t_rec,
                         "" if correct else "  WRONG")
        conn.loader.throttle_bps = 0.0
        detach_tierkv(eng)
    # every prediction against its own measurement: a load and a recompute per case
    load_err = [abs(c["predicted_load_ttft_s"] - c["measured_load_ttft_s"]) / c["measured_load_ttft_s"] for c in cases]
    rec_err = [abs(c["predicted_recompute_s"] - c["measured_recompute_ttft_s"]) / c["measured_recompute_ttft_s"]
               for c in cases]
    errors = load_err + rec_err
    policies = {
        "cost_model_s": sum(c["chosen_measured_s"] for c in cases),
        "always_load_s": sum(c["measured_load_ttft_s"] for c in cases),
        "never_load_s": sum(c["measured_recompute_ttft_s"] for c in cases),
    }
    return {"cases": cases, "cost_model_accuracy": sum(c["correct"] for c in cases) / len(cases),
            "cost_model_median_error": statistics.median(errors), "load_median_error": statistics.median(load_err),
            "recompute_median_error": statistics.median(rec_err), "policies_total_ttft": policies,
            "prefill_model": list(b.prefill) if b.prefill else None}


def _chat_requests(b: Bench, users: int, turns: int, system_len: int):
    system = b.text(system_len)
    msgs = {(u, t): b.text(int(b.rng.integers(64, 128))) for u in range(users) for t in range(turns)}
    return system, msgs


def workload(b: Bench, kind: str, config: str, address: str | None, spec: dict) -> tuple[dict, list]:
    salt = f"{kind}-{config}-" + uuid.uuid4().hex[:6]
    eng = b.engine(spec["pages"])
    conn = b.attach(eng, address, load_mode="auto") if address else None
    ttfts, outputs, gen_tokens, prompt_tokens, cached = [], [], 0, 0, 0
    t0 = time.monotonic()

    def one(ids: list[int]) -> list[int]:
        nonlocal gen_tokens, prompt_tokens, cached
        if config == "no_cache":
            eng.radix.reset()
        t, _, r = run(eng, ids, spec["max_tokens"], salt)
        ttfts.append(t)
        outputs.append(r.output_ids)
        gen_tokens += len(r.output_ids)
        prompt_tokens += len(ids)
        cached += r.cached_tokens
        return r.output_ids

    if kind == "chat":
        system, msgs = spec["system"], spec["msgs"]
        hist = {u: list(system) for u in range(spec["users"])}
        for t in range(spec["turns"]):
            for u in range(spec["users"]):
                hist[u] += msgs[(u, t)]
                hist[u] += one(hist[u])
    else:
        for i, question in enumerate(spec["questions"]):
            one(spec["docs"][i % len(spec["docs"])] + question)
    wall = time.monotonic() - t0
    by_tier = loaded_by_tier(conn) if conn else {}
    if conn:
        detach_tierkv(eng)
    loaded = sum(by_tier.values())
    row = {"config": config, "requests": len(ttfts), "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
           "throughput_tokens_per_s": gen_tokens / wall, "prompt_tokens_per_s": prompt_tokens / wall,
           "wall_s": wall, "prompt_tokens": prompt_tokens,
           "hit_tokens": {"radix": cached - loaded, **{t: v for t, v in by_tier.items() if v}}}
    log.info("workload %s %s: %s", kind, config, {k: row[k] for k in ("ttft_p50_s", "ttft_p90_s", "wall_s")})
    return row, outputs


def workloads(b: Bench, daemons: dict[str, str], quick: bool) -> tuple[dict, bool]:
    users, turns, system_len = (3, 2, 1024) if quick else (4, 4, 1024)
    system, msgs = _chat_requests(b, users, turns, system_len)
    chat_len = system_len + turns * (128 + 16)
    chat = {"users": users, "turns": turns, "system": system, "msgs": msgs, "max_tokens": 16,
            "pages": chat_len * 11 // 10 // 16}  # one conversation fits, not every history
    n_docs, doc_len, n_q = (2, 1024, 5) if quick else (4, 2048, 12)
    docs = {"docs": [b.text(doc_len) for _ in range(n_docs)], "questions": [b.text(24) for _ in range(n_q)],
            "max_tokens": 8, "pages": (doc_len + 64) * 3 // 2 // 16}  # about 1.5 documents fit
    configs = [("no_cache", None), ("radix", None)] + [(f"radix+{t}", a) for t, a in daemons.items()]
    out, identical = {}, True
    for kind, spec in (("chat", chat), ("docs", docs)):
        rows, ref = [], None
        for config, address in configs:
            row, outputs = workload(b, kind, config, address, spec)
            rows.append(row)
            ref = outputs if ref is None else ref
            row["outputs_identical_to_no_cache"] = outputs == ref
            identical &= outputs == ref
        out[kind] = {"spec": {k: v for k, v in spec.items() if k in ("users", "turns", "max_tokens", "pages")}
                     | ({"system_tokens": system_len} if kind == "chat" else {"docs": n_docs, "doc_tokens": doc_len,
                                                                             "questions": n_q}), "rows": rows}
    return out, identical


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box, 2 OpenMP threads spin against other work)")
    ap.add_argument("--skip-workloads", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("connector").setLevel(logging.WARNING)
    torch.set_num_threads(a.threads)
    t_start = time.monotonic()
    from bench.servers import seaweedfs_s3

    result: dict = {"quick": a.quick, "threads": a.threads}
    b = Bench(load_model(""), a.threads)
    from connector.calibrate import calibrate_prefill

    t0 = time.monotonic()
    b.prefill = calibrate_prefill(b.engine(256))  # once, on an empty pool, before any server starts
    result["calibration_s"] = time.monotonic() - t0
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierkv-e2e-")))
        ep = stack.enter_context(seaweedfs_s3())
        s3_env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
                  "AWS_DEFAULT_REGION": ep.region}
        daemons = {
            "cpu": stack.enter_context(kv_daemon(work / "cpu", "--cpu", "2GiB")),
            "disk": stack.enter_context(kv_daemon(work / "disk", "--disk", f"{work / 'disk' / 'lmdb'}:4GiB")),
            "s3": stack.enter_context(kv_daemon(work / "s3", "--s3", f"s3://tierkv-e2e/{uuid.uuid4().hex[:8]}",
                                                "--s3-endpoint", ep.url, env=s3_env)),
        }
        h = headline(b, daemons, 2048, 3 if a.quick else 5)
        result["headline"] = h
        result["replicas"] = replicas(b, daemons["cpu"], 2 if a.quick else 4, 1024 if a.quick else 2048)
        lengths = [256, 1024] if a.quick else [256, 512, 1024, 2048]
        throttles = [0.0, 50e6, 5e6] if a.quick else [0.0, 200e6, 50e6, 10e6, 3e6]
        result["sweep"] = sweep(b, daemons, lengths, throttles, ["cpu"] if a.quick else list(TIERS))
        identical = True
        if not a.skip_workloads:
            result["workloads"], identical = workloads(b, daemons, a.quick)
    result.update({
        "cold_ttft_s": h["cold_ttft_s"], "warm_ttft_s": h["warm_ttft_s"], "speedup_cpu": h["speedup_cpu"],
        "floor_ratio_cpu": h["floor_ratio_cpu"], "fidelity_identical": h["fidelity_identical"] and identical,
        "replica_hit_rate": result["replicas"]["replica_hit_rate"],
        "cost_model_accuracy": result["sweep"]["cost_model_accuracy"],
        "cost_model_median_error": result["sweep"]["cost_model_median_error"],
        "wall_s": time.monotonic() - t_start,
    })
    Path(a.out).write_text(json.dumps(result, indent=2, default=float))
    keys = ("cold_ttft_s", "warm_ttft_s", "speedup_cpu", "floor_ratio_cpu", "fidelity_identical", "replica_hit_rate",
            "cost_model_accuracy", "cost_model_median_error", "wall_s")
    print(json.dumps({k: result[k] for k in keys}, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
