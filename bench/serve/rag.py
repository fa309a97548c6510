"""bench.serve's RAG point (full runs): documents drawn from a pool in varying order, a warm-up
round, then one measured batch at a fixed rate on a fresh server per mode. Exact prefix caching
reuses a request's KV only as far as it starts with the same documents in the same order."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from bench.serve.capacity import salt
from bench.serve.client import Job, client, closing, open_loop, send
from bench.serve.figures import point_stats
from bench.serve.modes import Server
from bench.serve.workload import RAGSpec, RAGWorkload


def _jobs(api: openai.AsyncOpenAI, srv: Server, wl: RAGWorkload, n: int) -> list[Job]:

    def job(i: int) -> Job:
        msgs, s = wl.request(), salt(srv)
        return lambda: send(api, srv.model, f"rag{i}", msgs, wl.spec.answer_tokens, s)

    return [job(i) for i in range(n)]


def rag_point(srv: Server, spec: RAGSpec, tokenizer, qps: float) -> dict[str, Any]:
    wl = RAGWorkload(spec, tokenizer)
    api = client(srv.port)
    asyncio.run(closing(api, open_loop(_jobs(api, srv, wl, spec.requests), 0, f"{srv.mode} rag warm-up")))
    api = client(srv.port)
    recs, secs = asyncio.run(closing(api, open_loop(_jobs(api, srv, wl, spec.requests), qps, f"{srv.mode} rag")))
    return point_stats(recs, secs)
