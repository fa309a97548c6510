"""How bench.serve drives its modes: every mode's server is up at once and the modes take turns,
point by point, so that load from other processes on a shared machine falls on every mode alike
(a mode run minutes after another would meet a different machine).

Per mode: a first QA round of every user, unmeasured (it puts every context in the caches);
then the sweep, one point per QPS, all modes at one QPS before any at the next; a mode leaves the
sweep at its first point over the SLO. RAG: a warm-up round per mode, then one measured point
per mode at the sweep's first QPS.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from bench.serve.client import Job, client, open_loop, send
from bench.serve.figures import max_qps_at_slo, passes, point_stats, scrape
from bench.serve.modes import Server
from bench.serve.workload import QASpec, QAWorkload, RAGSpec, RAGWorkload


@dataclass(frozen=True)
class Plan:
    qa: QASpec
    per_point: int  # QA requests per point: the users take turns
    qps: list[float]
    slo_s: float
    rag: RAGSpec | None
    rag_modes: tuple[str, ...]


def _salt(srv: Server) -> str | None:
    return uuid.uuid4().hex if srv.salted else None


def _jobs_qa(srv: Server, wl: QAWorkload, users: list[int]) -> list[Job]:
    api = client(srv.port)

    def job(user: int) -> Job:
        async def go():
            rec = await send(api, srv.model, f"user{user}", wl.next_turn(user), wl.spec.answer_tokens, _salt(srv))
            wl.answered(user, rec.text)
            return rec
        return go

    return [job(u) for u in users]


def _jobs_rag(srv: Server, wl: RAGWorkload, n: int) -> list[Job]:
    api = client(srv.port)

    def job(i: int) -> Job:
        msgs = wl.request()
        salt = _salt(srv)
        return lambda: send(api, srv.model, f"rag{i}", msgs, wl.spec.answer_tokens, salt)

    return [job(i) for i in range(n)]


async def run_all(servers: dict[str, Server], plan: Plan, tokenizer) -> dict[str, dict[str, Any]]:
    qa = plan.qa
    wls = {m: QAWorkload(qa, tokenizer) for m in servers}  # one seed: the same conversations in every mode
    out: dict[str, dict[str, Any]] = {}
    for m, srv in servers.items():
        recs, _ = await open_loop(_jobs_qa(srv, wls[m], list(range(qa.users))), 0, f"{m} first round")
        out[m] = {"first_round_errors": sum(r.error is not None for r in recs), "sweep": []}
    live = list(servers)
    for k, q in enumerate(plan.qps):
        users = [(k * plan.per_point + i) % qa.users for i in range(plan.per_point)]
        for m in list(live):
            recs, secs = await open_loop(_jobs_qa(servers[m], wls[m], users), q, f"{m} qps={q:g}")
            out[m]["sweep"].append({"qps": q, **point_stats(recs, secs)})
            if not passes(out[m]["sweep"][-1], plan.slo_s):
                live.remove(m)
    for m, srv in servers.items():
        res = out[m]
        res.update({k: v for k, v in res["sweep"][0].items() if k != "qps"})
        res["reference_qps"] = plan.qps[0]
        res["max_qps_at_slo"] = max_qps_at_slo(res["sweep"], plan.slo_s)
        async with httpx.AsyncClient() as http:
            res["server_metrics"] = scrape((await http.get(f"http://127.0.0.1:{srv.port}/metrics", timeout=30)).text)
    if plan.rag is not None:
        rag_servers = {m: s for m, s in servers.items() if m in plan.rag_modes}
        rwls = {m: RAGWorkload(plan.rag, tokenizer) for m in rag_servers}
        for m, srv in rag_servers.items():
            await open_loop(_jobs_rag(srv, rwls[m], plan.rag.requests), 0, f"{m} rag warm-up")
        for m, srv in rag_servers.items():
            recs, secs = await open_loop(_jobs_rag(srv, rwls[m], plan.rag.requests), plan.qps[0], f"{m} rag")
            out[m]["rag"] = point_stats(recs, secs)
    return out
