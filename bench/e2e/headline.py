"""bench.e2e sections about one long prompt and about two replicas.

headline  a 2k-token document + question: cold TTFT (full prefill, on the engine's torch
          threads), warm TTFT from each tier, the local radix hit (the suffix compute alone),
          fidelity across all of them, and the load itself against the memcpy time of its bytes
          on as many threads as the load copies on (``load_threads``, native.default_threads()):
          ``load_over_floor_cpu`` against the machine's best memcpy on those threads (best of 3
          copies of 256 MiB, caches as they come), ``load_with_lookup_over_floor_cpu`` the same
          with the daemon lookup included (the connector's LOADING wait: lookup, decision, pages,
          transfer), and beside them ``load_over_cold_memcpy_cpu`` against a copy of the prompt's
          KV bytes on those threads timed just before each cpu load, where the previous round's
          prefills have left the caches as that load finds them. Until issue 23 the floor copied
          on 1 thread against a 2-thread load and the lookup was left out. Every disk point is
          cold (bench.e2e.cold); s3 is SeaweedFS on loopback. Round 0 of every kind of run is a
          discarded warm-up; rounds 1..reps are timed, the kinds interleaved within each round so
          that load from other processes hits all of them alike.
replicas  two engines sharing the cpu daemon: share of the second's prefix tokens it loads.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid

import numpy as np

from bench.e2e import figures as fig
from bench.e2e.support import Bench, ThreadedCopy, loaded_by_tier, memcpy_bandwidth, offload_prefix, run
from connector import native
from connector.state import kv_state
from connector.wiring import detach_tierkv

log = logging.getLogger("bench.e2e")


def headline(b: Bench, daemons: dict[str, str], doc_len: int, reps: int) -> dict:
    salt = "headline-" + uuid.uuid4().hex[:6]
    ids = b.text(doc_len) + b.text(24)
    pages = (len(ids) + 64) // 16 + 8
    eng = b.engine(pages)
    first_cold_ttft, _, cold = run(eng, ids, 8, salt)  # the warm-up of the cold kind, discarded
    want = cold.output_ids
    outputs = {"cold": want}
    offload_prefix(b, eng, daemons.values(), ids, salt)  # then every tier reloads it
    engines = {tier: b.engine(pages) for tier in daemons}  # one reader per tier, runs interleaved
    conns = {tier: b.attach(engines[tier], address, load_mode="auto") for tier, address in daemons.items()}
    ts: dict[str, list[float]] = {tier: [] for tier in daemons}
    warm_runs: dict[str, list[dict]] = {}
    copy_src = np.ones(len(ids) // eng.pool.page_size * eng.pool.bytes_per_page, np.uint8)
    copy_dst = np.zeros_like(copy_src)  # both faulted in now, not inside a timed copy
    load_threads = native.default_threads()  # what a load of >= 4 MiB copies on (connector/native_batch.py)
    copy = ThreadedCopy(load_threads)
    cold_copies: list[float] = []
    loading: list[float] = []  # the cpu loads' LOADING waits, lookup included
    decisions, kv_bytes, radix_ttfts, cold_ttfts, mismatches = {}, 0, [], [], set()
    for i in range(reps + 1):  # round 0 is a discarded warm-up; rounds alternate the tiers
        for tier in daemons:
            eng2, conn = engines[tier], conns[tier]
            if tier == "cpu" and i:  # the same bytes copied in the cache state the load will find
                t0 = time.perf_counter()
                copy(copy_dst, copy_src)
                cold_copies.append(time.perf_counter() - t0)
            eng2.radix.reset()
            conn.known.discard(conn.keyspace.keys(ids, salt))
            b.before_point(daemons[tier])
            waited = conn.metrics.value("tierkv_connector_loading_seconds_sum")
            t, _, r = run(eng2, ids, 8, salt)
            waited = conn.metrics.value("tierkv_connector_loading_seconds_sum") - waited
            outputs[tier] = r.output_ids
            if r.output_ids != want:
                mismatches.add(tier)
            d = kv_state(r).decision if kv_state(r) is not None else None
            decisions[tier] = d._asdict() if d else None
            if tier == "cpu":
                kv_bytes = (d.pages if d else 0) * eng2.pool.bytes_per_page
            if i:
                ts[tier].append(t)
                if tier == "cpu" and waited > 0:
                    loading.append(waited)
                warm_runs.setdefault(tier, []).append({"ttft_s": t, "load_s": kv_state(r).load_s if kv_state(r) is not None else None})
        if i:  # a full prefill on an empty radix tree, which leaves the prefix cached for the next run
            eng.radix.reset()
            t, _, r = run(eng, ids, 8, salt)
            cold_ttfts.append(t)
            if r.output_ids != want:
                mismatches.add("cold")
        t, _, r = run(eng, ids, 8, salt)  # the local radix hit: the suffix compute alone, same round
        outputs["radix"] = r.output_ids
        if r.output_ids != want:
            mismatches.add("radix")
        if i:
            radix_ttfts.append(t)
    warm = {tier: fig.repeated_median(ts[tier], reps) for tier in daemons}
    for eng2 in engines.values():
        detach_tierkv(eng2)
    copy.close()
    bw = memcpy_bandwidth(load_threads)
    cold_bw = fig.copy_bandwidth(copy_src.nbytes, cold_copies)
    suffix = fig.repeated_median(radix_ttfts, reps)
    cold_ttft = fig.repeated_median(cold_ttfts, reps)
    cpu_loads = [w["load_s"] for w in warm_runs["cpu"] if w["load_s"]]
    loaded = kv_bytes > 0 and bool(cpu_loads)  # the cost model may choose recompute (a tiny model, a short prompt)
    if not loaded:
        log.warning("headline: the cpu tier's warm runs loaded nothing (decision %s): no floor figures",
                    decisions.get("cpu"))
    floor = fig.memcpy_floor_s(kv_bytes, bw) + suffix if loaded else None
    log.info("headline: cold %.2fs (median of %d), radix %.3fs, warm %s", cold_ttft, len(cold_ttfts), suffix, warm)
    return {
        "prompt_tokens": len(ids), "cold_ttft_s": cold_ttft, "cold_ttft_reps": len(cold_ttfts),
        "cold_runs": cold_ttfts, "cold_warmup_ttft_s": first_cold_ttft,
        "radix_ttft_s": suffix, "warm_ttft_s": warm,
        "warm_runs": warm_runs, "radix_runs": radix_ttfts, "decisions": decisions, "kv_bytes_loaded": kv_bytes,
        "memcpy_bytes_per_s": bw, "memcpy_floor_s": fig.memcpy_floor_s(kv_bytes, bw) if loaded else None,
        "floor_s": floor,
        "speedup_cpu": fig.speedup(cold_ttft, warm["cpu"]),
        "floor_ratio_cpu": fig.ttft_floor_ratio(warm["cpu"], kv_bytes, bw, suffix) if loaded else None,
        "load_s_cpu": statistics.median(cpu_loads) if cpu_loads else None,
        "load_over_floor_cpu": fig.load_over_floor(cpu_loads, kv_bytes, bw) if loaded else None,
        "loading_s_cpu": statistics.median(loading) if loading else None, "loading_runs_cpu": loading,
        "load_with_lookup_over_floor_cpu": fig.load_over_floor(loading, kv_bytes, bw) if loaded and loading else None,
        "load_threads": load_threads, "floor_threads": load_threads, "recompute_threads": b.threads_used,
        "cold_memcpy_bytes_per_s": cold_bw, "cold_memcpy_runs_s": cold_copies,
        "load_over_cold_memcpy_cpu": fig.load_over_floor(cpu_loads, kv_bytes, cold_bw) if loaded else None,
        "fidelity_identical": not mismatches, "fidelity_mismatches": sorted(mismatches),
        "outputs_compared": sorted(outputs),
    }


def replicas(b: Bench, address: str, n_docs: int, doc_len: int) -> dict:
    salt = "replicas-" + uuid.uuid4().hex[:6]
    docs = [b.text(doc_len) for _ in range(n_docs)]
    pages = (doc_len + 128) // 16 * 2
    first, second = b.engine(pages), b.engine(pages)
    c1 = b.attach(first, address, load_mode="auto", write_through=True)
    c2 = b.attach(second, address, load_mode="auto", write_through=True)
    rows, shared_tokens = [], 0
    for doc in docs:
        run(first, doc + b.text(20), 8, salt)
    c1.flush(300)
    for doc in docs:
        t, _, r = run(second, doc + b.text(20), 8, salt)
        shared_tokens += doc_len // 16 * 16
        rows.append({"ttft_s": t, "cached_tokens": r.cached_tokens})
    loaded = sum(loaded_by_tier(c2).values())
    detach_tierkv(first)
    detach_tierkv(second)
    return {"docs": n_docs, "doc_tokens": doc_len, "second_replica": rows, "prefix_tokens": shared_tokens,
            "loaded_from_daemon_tokens": loaded, "replica_hit_rate": fig.hit_rate(loaded, shared_tokens)}
