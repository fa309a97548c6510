"""bench.serve's RAG point (full runs): documents drawn from a pool in varying order, a warm-up
round, then one measured batch at a fixed rate on a fresh server per mode. Exact prefix caching
reuses a request's KV only as far as it starts with the same documents in the same order."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from bench.serve.capacity import salt
from bench.serve.client import Job, Record, client, open_loop, send
from bench.serve.figures import point_stats
from bench.serve.modes import Server
from bench.serve.workload import RAGSpec, RAGWorkload


def _jobs(api: openai.AsyncOpenAI, srv: Server, wl: RAGWorkload, n: int) -> list[Job]:

    def job(i: int) -> Job:
        msgs, s = wl.request(), salt(srv)
        return lambda: send(api, srv.model, f"rag{i}", msgs, wl.spec.answer_tokens, s)

    return [job(i) for i in range(n)]


async def _warm_then_measure(srv: Server, wl: RAGWorkload, qps: float) -> tuple[list[Record], float]:
    async with client(srv.port) as api:  # one client, closed in the loop that used it
        await open_loop(_jobs(api, srv, wl, wl.spec.requests), 0, f"{srv.mode} rag warm-up")
        return await open_loop(_jobs(api, srv, wl, wl.spec.requests), qps, f"{srv.mode} rag")


def rag_point(srv: Server, spec: RAGSpec, tokenizer, qps: float) -> dict[str, Any]:
    recs, secs = asyncio.run(_warm_then_measure(srv, RAGWorkload(spec, tokenizer), qps))
    return point_stats(recs, secs)
