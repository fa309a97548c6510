"""``python -m bench.vllm``: vLLM with and without tierkv, under load, through the OpenAI API only.

    python -m bench.vllm --out F.json [--quick] [--duration S] [--runs N] [--modes vllm,ideal,...]

Modes, all up at once and taking turns point by point (load from elsewhere falls on each alike;
the order rotates every run):
- ``vllm``: vLLM's CPU build with its own prefix cache, a pool of ``--blocks`` (24 = 3,072 tokens:
  about five requests at once, the ones a 1 req/s load brings together; under a quarter of the
  working set — why this size: bench/vllm/workload.py);
- ``ideal``: the same vLLM with a pool that holds every run's whole working set (400 blocks): the
  limit any offload can reach;
- ``tierkv_cpu`` / ``tierkv_disk``: vLLM + TierKVConnector and a daemon whose one tier is cpu / disk
  (lmdb; on this machine "disk" is mostly page cache);
- ``kvengine_tierkv``: our engine + the daemon's cpu tier, with a pool of the same tokens.
Every vLLM computes on the same cores with the same thread count (connector/vllm/launch.py).

Workloads (bench/vllm/workload.py): multi-round chat and shared-prefix, each with a working set
measured from its requests and compared to the pool; Poisson arrivals at ``--qps`` for
``--duration`` s per point (quick 60, full 120); ``--runs`` runs (3), each with new text. Per mode
and workload: TTFT mean/p90, ITL p99, completed requests/s and prompt tokens by source (vLLM's own
``vllm:prompt_tokens_by_source``; kvengine's usage), where TTFT goes (mean seconds waiting for the
pool or a load, in prefill, and the connector's loads), the median over runs and every run; greedy
answers compared request by request with ``vllm``'s and ``ideal``'s (reported: under concurrent load
a bf16 answer depends on its batch, and ``ideal`` differs from ``vllm`` as often). Token-for-token
fidelity is checked after the timed points, one request at a time, on each tierkv mode
(bench/vllm/fidelity.py): answers over KV loaded from the daemon against vLLM's own prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.e2e.support import machine_facts
from bench.serve.client import at_offsets, client, send
from bench.serve.figures import point_stats, tokens_by_source
from bench.serve.workload import Text
from bench.servers import exit_on_sigterm
from bench.vllm import fidelity
from bench.vllm.workload import (
    BLOCK,
    ChatSpec,
    PrefixSpec,
    blocks_per_request,
    chat_requests,
    prefix_requests,
    working_set_tokens,
)

log = logging.getLogger("bench.vllm")
MODES = ("vllm", "ideal", "tierkv_cpu", "tierkv_disk", "kvengine_tierkv")
IDEAL_BLOCKS = 400
FIGURES = ("ttft_mean_s", "ttft_p90_s", "itl_p99_s", "finished_per_s", "errors")
#: target -> (comparison, limit)
TARGETS = {"ttft_mean_vs_ideal": ("<=", 1.25), "itl_p99_vs_vllm": ("<=", 1.2), "failed_requests": ("==", 0),
           "working_set_over_pool": (">=", 4.0), "answers_loaded_differing_from_local": ("==", 0),
           "all_blocks_loaded": ("==", True)}  # fmt: skip
FIDELITY_MODES = ("tierkv_cpu", "tierkv_disk")
FIDELITY_PROMPTS = 6


#: where a request's time to first token goes, from vLLM's /metrics: the mean seconds in WAITING
#: (for room in the pool and, with tierkv, the load), then from scheduled to first token (prefill),
#: and the connector's own mean load time
PHASES = {"queue_mean_s": ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"),
          "prefill_mean_s": ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"),
          "load_mean_s": ("tierkv_connector_vllm_load_seconds_total", "tierkv_connector_vllm_loads_total")}
PHASE_SERIES = {n for pair in PHASES.values() for n in pair}


def phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean seconds per phase between two ``Mode.totals`` (None where nothing was counted)."""
    out: dict[str, float | None] = {}
    for k, (total, count) in PHASES.items():
        n = after.get(count, 0.0) - before.get(count, 0.0)
        out[k] = (after.get(total, 0.0) - before.get(total, 0.0)) / n if n > 0 else None
    return out


class Mode:
    """A mode's server: ``metrics`` is its /metrics as ``name{labels}`` -> value ({} for kvengine)."""

    def __init__(self, name: str, port: int, model: str, metrics: Callable[[], dict[str, float]]) -> None:
        self.name, self.port, self.model, self.metrics = name, port, model, metrics

    def totals(self) -> dict[str, float]:
        """Sums over labels of vLLM's request-phase histograms and the connector's load counters."""
        out: dict[str, float] = {}
        for sample, v in self.metrics().items():
            name = sample.partition("{")[0]
            if name in PHASE_SERIES:
                out[name] = out.get(name, 0.0) + v
        return out

    def by_source(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sample, v in self.metrics().items():
            if sample.startswith("vllm:prompt_tokens_by_source_total{"):
                src = sample.split('source="', 1)[1].split('"', 1)[0]
                out[src] = out.get(src, 0.0) + v
        return out


@contextlib.contextmanager
def _mode(name: str, work: Path, blocks: int, max_len: int) -> Any:
    from connector.vllm.launch import SERVED_NAME, VLLMServer
    from connector.vllm.model_dir import vllm_model_dir

    work.mkdir(parents=True, exist_ok=True)
    if name == "kvengine_tierkv":
        from bench.serve.modes import EngineSpec, mode_server

        with mode_server("daemon_cpu", EngineSpec(num_pages=blocks * BLOCK // 16, threads=2), work) as srv:
            yield Mode(name, srv.port, srv.model, dict)
        return
    from bench.serve.modes import mode_daemon

    tier = {"tierkv_cpu": "daemon_cpu", "tierkv_disk": "daemon_disk"}.get(name, "")  # bench.serve's daemons
    with mode_daemon(tier, work / "daemon") as address:
        ideal = name == "ideal"
        srv = VLLMServer(vllm_model_dir(), address, blocks=IDEAL_BLOCKS if ideal else blocks, max_model_len=max_len,
                         log=work / "vllm.log", kv_space_gib=2 if ideal else 1, cores="all")  # fmt: skip
        with srv.start(wait=False):  # stopped when the block ends
            srv.wait_ready(600)
            yield Mode(name, srv.port, SERVED_NAME, srv.metrics)


def _sources(mode: Mode, before: dict[str, float], after: dict[str, float], recs: list) -> dict[str, int]:
    if mode.name == "kvengine_tierkv":
        return tokens_by_source(r for r in recs if r.error is None)
    names = {"local_cache_hit": "local", "external_kv_transfer": "tierkv", "local_compute": "recomputed"}
    return {names.get(k, k): int(after.get(k, 0) - before.get(k, 0)) for k in after}


async def _point(mode: Mode, reqs: list, answer_tokens: int) -> dict[str, Any]:
    before, totals = mode.by_source(), mode.totals()
    async with client(mode.port) as api:  # closed in this loop (after asyncio.run, each connection logs a traceback)
        jobs = [lambda r=r: send(api, mode.model, r.key, r.messages, answer_tokens) for r in reqs]
        recs, secs = await at_offsets(jobs, [r.at_s for r in reqs], f"{mode.name}")
    await asyncio.sleep(1.5)  # vLLM publishes its counters a step later
    out = point_stats(recs, secs)
    out["tokens_by_source"] = _sources(mode, before, mode.by_source(), recs)
    out["phases"] = phases(totals, mode.totals())
    out["answers"] = [r.text if r.error is None else None for r in recs]
    return out


def _median(points: list[dict[str, Any]], key: str) -> float:
    vals = [p[key] for p in points if p[key] == p[key]]
    return statistics.median(vals) if vals else float("nan")


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per workload and mode: medians over runs, answer agreement, and the targets."""
    targets: dict[str, Any] = {}
    for wl, res in doc["workloads"].items():
        modes = res["modes"]
        for m, r in modes.items():
            r["median"] = {k: _median(r["runs"], k) for k in FIGURES}
            for k in PHASES:  # where the time went, for reading the TTFTs (no target)
                vals = [p["phases"][k] for p in r["runs"] if (p.get("phases") or {}).get(k) is not None]
                r["median"][k] = statistics.median(vals) if vals else None
            for ref in ("vllm", "ideal"):
                if ref in modes and ref != m and m != "kvengine_tierkv":
                    diff = sum(a != b for run, rr in zip(r["runs"], modes[ref]["runs"], strict=False)
                               for a, b in zip(run["answers"], rr["answers"], strict=True))  # fmt: skip
                    r[f"answers_differing_from_{ref}"] = diff
        med = {m: r["median"] for m, r in modes.items()}
        t: dict[str, Any] = {"working_set_over_pool": res["working_set_over_pool"]}
        for m in ("tierkv_cpu", "tierkv_disk", "kvengine_tierkv", "ideal"):
            if m not in modes:
                continue
            f: dict[str, Any] = {"failed_requests": sum(p["errors"] for p in modes[m]["runs"])}
            if "ideal" in med and m != "ideal":
                f["ttft_mean_vs_ideal"] = med[m]["ttft_mean_s"] / med["ideal"]["ttft_mean_s"]
            if "vllm" in med:
                f["ttft_mean_speedup_over_vllm"] = med["vllm"]["ttft_mean_s"] / med[m]["ttft_mean_s"]
                f["itl_p99_vs_vllm"] = med[m]["itl_p99_s"] / med["vllm"]["itl_p99_s"]
            if "answers_differing_from_vllm" in modes[m]:
                f["answers_differing_from_vllm"] = modes[m]["answers_differing_from_vllm"]
            fid = res.get("fidelity", {}).get(m)
            if fid is not None:
                f["answers_loaded_differing_from_local"] = fid["answers_loaded_differing_from_local"]
                f["all_blocks_loaded"] = fid["all_blocks_loaded"]
            t[m] = f
        if "vllm" in med and "ideal" in med:
            t["most_any_offload_can_win"] = med["vllm"]["ttft_mean_s"] / med["ideal"]["ttft_mean_s"]
            # how often two runs of vLLM alone differ under load (the timed answers' noise floor)
            t["ideal_answers_differing_from_vllm"] = modes["ideal"].get("answers_differing_from_vllm")
        # the targets bind vLLM + tierkv's cpu tier (the others are reported beside it)
        checked = [(t, "working_set_over_pool")] + [(t.get("tierkv_cpu", {}), k) for k in TARGETS]
        for holder, name in checked:
            if name in holder and name in TARGETS:
                op, lim = TARGETS[name]
                v = holder[name]
                met = v >= lim if op == ">=" else v <= lim if op == "<=" else v == lim
                holder[name] = {"value": v, "target": f"{op} {lim}", "met": bool(met)}
        if "tierkv_cpu" not in t:
            t["tierkv_cpu"] = {"missing": {"value": None, "target": "the mode ran", "met": False}}
        elif "answers_loaded_differing_from_local" not in t["tierkv_cpu"]:
            t["tierkv_cpu"]["fidelity"] = {"value": None, "target": "checked (fidelity.py)", "met": False}
        targets[wl] = t
    doc["targets"] = targets
    def verdicts(d: dict[str, Any]):
        for v in d.values():
            if isinstance(v, dict):
                yield from ([v["met"]] if "met" in v else verdicts(v))

    doc["all_targets_met"] = all(verdicts(targets))
    return doc


async def drive(modes: dict[str, Mode], plan: dict[str, tuple[Any, list[list]]], settle_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {wl: {m: {"runs": []} for m in modes} for wl in plan}
    names = list(modes)
    runs = len(next(iter(plan.values()))[1])
    for k in range(runs):
        order = names[k % len(names):] + names[:k % len(names)]  # rotate: no mode always runs first
        for wl, (spec, per_run) in plan.items():
            for m in order:
                log.info("run %d/%d %s %s: %d requests", k + 1, runs, wl, m, len(per_run[k]))
                out[wl][m]["runs"].append(await _point(modes[m], per_run[k], spec.answer_tokens))
                await asyncio.sleep(settle_s)  # the last point's saves and offloads land before the next
    return out


async def check_fidelity(modes: dict[str, Mode], fidelity_plan: dict[str, tuple[list, list]],
                         answer_tokens: dict[str, int]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """bench/vllm/fidelity.py on each tierkv mode that ran, per workload (after the timed points)."""
    out: dict[str, dict[str, Any]] = {}
    for wl, (prompts, fillers) in fidelity_plan.items():
        for m in (m for m in FIDELITY_MODES if m in modes):
            log.info("fidelity %s %s: %d prompts", wl, m, len(prompts))
            mode = modes[m]
            out.setdefault(wl, {})[m] = await fidelity.check(mode.port, mode.model, mode.metrics, prompts, fillers,
                                                             answer_tokens[wl], BLOCK)  # fmt: skip
    return out


def fidelity_plan(makers: dict[str, Any], specs: dict[str, Any], tok: Any, workloads: list[str], qps: float,
                  pool_tokens: int) -> dict[str, tuple[list, list]]:  # fmt: skip
    """Per workload: prompts no timed point sent (a seed of their own) and, per prompt, fillers of new
    text holding more blocks than the pool (fidelity.py)."""
    per_prompt = pool_tokens // fidelity.FILLER_TOKENS + 2
    plan = {}
    for wl in workloads:
        reqs = makers[wl](specs[wl], tok, qps, 10 * FIDELITY_PROMPTS / qps, seed=99_000 + len(wl))
        prompts = reqs[:FIDELITY_PROMPTS]
        text = Text(tok, 98_000 + len(wl))
        fillers = [[{"role": "user", "content": text.make(fidelity.FILLER_TOKENS)}]
                   for _ in range(per_prompt * len(prompts))]  # fmt: skip
        plan[wl] = (prompts, [fillers[i::len(prompts)] for i in range(len(prompts))])
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="60 s per point instead of 120")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per point")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--qps", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=24, help="vLLM's KV pool in 128-token blocks (ideal: 400)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workloads", default="chat,shared_prefix")
    ap.add_argument("--users", type=int, default=ChatSpec.users, help="chat: users sharing the system prompt")
    ap.add_argument("--prefixes", type=int, default=PrefixSpec.prefixes, help="shared_prefix: documents")
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--keep", default="", help="keep every mode's logs under this directory")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    modes = [m for m in a.modes.split(",") if m]
    if bad := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(bad)}; known: {','.join(MODES)}")
    duration = a.duration or (60.0 if a.quick else 120.0)
    from connector.vllm.launch import VLLMUnavailable, vllm_python

    try:
        vllm_python()
    except VLLMUnavailable as e:
        ap.error(str(e))
    from transformers import AutoTokenizer

    from engine.model_loader import hf_model_dir

    tok = AutoTokenizer.from_pretrained(hf_model_dir())
    specs = {"chat": ChatSpec(users=a.users), "shared_prefix": PrefixSpec(prefixes=a.prefixes)}
    makers = {"chat": chat_requests, "shared_prefix": prefix_requests}
    pool = a.blocks * BLOCK
    plan: dict[str, tuple[Any, list[list]]] = {}
    doc: dict[str, Any] = {"quick": a.quick, "duration_s": duration, "runs": a.runs, "qps": a.qps,
                           "pool_tokens": pool, "ideal_pool_tokens": IDEAL_BLOCKS * BLOCK, "workloads": {}}
    longest = 0
    for wl in (w for w in a.workloads.split(",") if w):
        per_run = [makers[wl](specs[wl], tok, a.qps, duration, seed=1000 * (k + 1) + len(wl)) for k in range(a.runs)]
        sets = [working_set_tokens(tok, reqs) for reqs in per_run]
        longest = max([longest] + [s[1] for s in sets])
        ws = min(s[0] for s in sets)
        plan[wl] = (specs[wl], per_run)
        doc["workloads"][wl] = {"spec": vars(specs[wl]), "requests_per_run": [len(r) for r in per_run],
                                "working_set_tokens": ws, "working_set_over_pool": ws / pool,
                                "blocks_per_request_mean": max(blocks_per_request(tok, r, specs[wl].answer_tokens)
                                                               for r in per_run)}  # fmt: skip
    max_len = pool - BLOCK  # vLLM wants a block to spare beyond the longest sequence
    if longest + 32 > max_len:
        ap.error(f"the longest prompt ({longest} tokens) does not fit a pool of {pool} tokens")
    t0 = time.monotonic()
    doc["machine"] = machine_facts()
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-vllm-") as tmp, contextlib.ExitStack() as stack:
        work = Path(a.keep or tmp)
        servers = {}
        for m in modes:  # one after another: start-up has the machine to itself
            servers[m] = stack.enter_context(_mode(m, work / m, a.blocks, max_len))
            log.info("%s ready", m)
        results = asyncio.run(drive(servers, plan, a.settle))
        checks = fidelity_plan(makers, specs, tok, list(plan), a.qps, pool)
        fid = asyncio.run(check_fidelity(servers, checks, {wl: spec.answer_tokens for wl, (spec, _) in plan.items()}))
    for wl, res in results.items():
        doc["workloads"][wl]["modes"] = res
        doc["workloads"][wl]["fidelity"] = fid.get(wl, {})
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    doc["wall_s"] = time.monotonic() - t0
    summarize(doc)
    Path(a.out).write_text(json.dumps(doc, indent=1, default=float))
    brief = {wl: {m: r["median"] for m, r in res["modes"].items()} for wl, res in doc["workloads"].items()}
    print(json.dumps({"medians": brief, "targets": doc["targets"], "all_targets_met": doc["all_targets_met"],
                      "wall_s": doc["wall_s"]}, indent=1, default=float))  # fmt: skip
    return 0
