"""One mode's capacity in one run (bench.serve): a fresh server, a first unmeasured round that puts
every user's context in the caches, then points of Poisson load (bench/serve/schedule.py), each a
discarded warm-up followed by a measured window, walked up a grid and bisected to the knee
(bench/serve/knee.py), with the machine settled (and the daemon's offload queue drained) before
each point (bench/serve/settle.py).

A point's latency figures are over the requests *sent* in its measured window; its completed/s
is the answers that *finished* in the window (the server's throughput once the warm-up has filled
it), so a server that falls behind completes less than it is sent whatever its latency. Whatever is
still unanswered ``drain_s`` after the window closes is cancelled, never counted as completed, so
an overloaded point ends in bounded time and leaves no backlog to the next one. Over a 60 s window
at 0.5 req/s the two counts differ by a few requests from Poisson noise alone (~7%): one reason for
>= 3 runs and a median.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from tqdm import tqdm

from bench.serve.client import Record, client, open_loop, send
from bench.serve.figures import point_stats, scrape
from bench.serve.knee import find_knee, passes
from bench.serve.modes import Server
from bench.serve.schedule import poisson_offsets
from bench.serve.settle import settle
from bench.serve.workload import QAWorkload

QUEUE_METRIC = "tierkv_connector_offload_queue_bytes"
log = logging.getLogger("bench.serve")


@dataclass(frozen=True)
class PointPlan:
    grid: tuple[float, ...]
    bisect_steps: int
    warmup_s: float  # discarded, at the point's rate, before the measured window
    duration_s: float  # the measured window
    drain_s: float  # after the window, how long its requests may still complete
    slo_s: float
    settle_max_s: float


def salt(srv: Server) -> str | None:
    """A fresh cache_salt on every request of the no-cache mode (no request reuses another's KV)."""
    return uuid.uuid4().hex if srv.salted else None


def offload_queue(port: int) -> Callable[[], float]:
    """The engine's staged offload bytes (0 for an engine without a daemon)."""
    def q() -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return sum(scrape(text, (QUEUE_METRIC,)).values())
    return q


async def _point(srv: Server, wl: QAWorkload, offsets: list[float], plan: PointPlan, desc: str):
    bar = tqdm(total=len(offsets), desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()

    async def one(api: openai.AsyncOpenAI, at_s: float) -> Record:
        await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
        user = wl.pick()
        try:
            rec = await send(api, srv.model, f"user{user}", wl.next_turn(user), wl.spec.answer_tokens, salt(srv))
        except asyncio.CancelledError:
            wl.abandoned(user)
            raise
        wl.answered(user, rec.text)
        bar.update(1)
        return rec

    async with client(srv.port) as api:  # closed in this loop (after asyncio.run, each connection logs a traceback)
        tasks = [asyncio.create_task(one(api, o)) for o in offsets]
        deadline = plan.warmup_s + plan.duration_s + plan.drain_s
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    # a task that raised outside the client's own errors (never expected) counts as not completed
    return t0, [t.result() if t in done and t.exception() is None else None for t in tasks]


def measure_point(srv: Server, wl: QAWorkload, qps: float, plan: PointPlan, seed: int, phase: str) -> dict[str, Any]:
    """One point: TTFT and ITL over the requests sent in the measured window that completed;
    ``completed_per_s`` = answers that *finished* inside the window (whenever they were sent) per
    second of it, the server's throughput in steady state, compared with ``sent_per_s``."""
    offsets = poisson_offsets(qps, plan.duration_s, seed, warmup_s=plan.warmup_s)
    held_start = wl.held_tokens()
    busy0 = wl.busy_picks
    t0, results = asyncio.run(_point(srv, wl, offsets, plan, f"{srv.mode} {phase} {qps:.3g}/s"))
    start, end = t0 + plan.warmup_s, t0 + plan.warmup_s + plan.duration_s
    measured = [r for o, r in zip(offsets, results, strict=True) if o >= plan.warmup_s]
    recs = [r for r in measured if r is not None]
    finished = sum(1 for r in results if r is not None and r.error is None and start <= r.done < end)
    st = point_stats(recs, plan.duration_s)
    st.update({"offered_qps": qps, "phase": phase, "sent": len(measured), "sent_per_s": len(measured) / plan.duration_s,
               "completed": finished, "completed_per_s": finished / plan.duration_s,
               "cancelled": len(measured) - len(recs), "duration_s": plan.duration_s, "warmup_s": plan.warmup_s,
               "itl_gaps": sum(len(r.itl_s) for r in recs if r.error is None),
               "held_tokens_start": held_start, "held_tokens_end": wl.held_tokens(),
               "busy_picks": wl.busy_picks - busy0})
    del st["finished_per_s"]  # over the window's own requests: completed_per_s is the throughput
    st["passes"] = passes(st, plan.slo_s)
    st["_itl"] = [g for r in recs if r.error is None for g in r.itl_s]  # for pooled percentiles; not in the JSON
    return st


def mode_run(srv: Server, wl: QAWorkload, plan: PointPlan, seed: int) -> dict[str, Any]:
    """The first round, then the knee search; every point and the knee with its bracket."""
    first, _ = asyncio.run(_first_round(srv, wl))
    queue = offload_queue(srv.port)
    points: list[dict[str, Any]] = []

    def measure(q: float, phase: str) -> bool:
        s = settle(max_s=plan.settle_max_s, queue=queue)
        pt = measure_point(srv, wl, q, plan, seed + len(points), phase)
        pt["settle"] = {"waited_s": s.waited_s, "busy": s.busy, "queue_bytes": s.queue, "timed_out": s.timed_out}
        points.append(pt)
        log.info("%s %s %.3g req/s: sent %.3g/s completed %.3g/s, TTFT p90 %.2fs, %d cancelled: %s", srv.mode, phase,
                 q, pt["sent_per_s"], pt["completed_per_s"], pt["ttft_p90_s"], pt["cancelled"],
                 "holds" if pt["passes"] else "fails")
        return pt["passes"]

    knee = find_knee(measure, plan.grid, plan.bisect_steps)
    return {"first_round_errors": sum(r.error is not None for r in first), "points": points, "knee_qps": knee.qps,
            "bracket": [knee.lo, knee.hi if not math.isinf(knee.hi) else None], "capped": knee.capped,
            "restarts": wl.restarts}


async def _first_round(srv: Server, wl: QAWorkload) -> tuple[list[Record], float]:
    """Every user's first question at once."""
    async with client(srv.port) as api:

        def job(user: int):
            async def go() -> Record:
                wl.waiting.add(user)
                rec = await send(api, srv.model, f"user{user}", wl.next_turn(user), wl.spec.answer_tokens, salt(srv))
                wl.answered(user, rec.text)
                return rec
            return go

        return await open_loop([job(u) for u in range(wl.spec.users)], 0, f"{srv.mode} first round")
