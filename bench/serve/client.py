"""The load generator's client side: streamed chat completions through the official ``openai``
client, one ``Record`` per request, sent open-loop at a fixed rate.

TTFT is from the send to the first chunk that carries a token (the server's opening chunk, with
the role and no token, does not count); inter-token latency is the gap between successive token
chunks (the engine streams one token per step). The usage comes with the last chunk
(``stream_options={"include_usage": True}``), with its ``prompt_tokens_details.tierkv`` split.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from tqdm import tqdm


@dataclass
class Record:
    key: str  # who sent it (a QA user, a RAG request)
    sent: float  # perf_counter at the send
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    done: float = float("nan")  # perf_counter at the last chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tierkv: dict[str, Any] | None = None  # usage.prompt_tokens_details.tierkv
    text: str = ""
    error: str | None = None


def client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)


async def send(api: openai.AsyncOpenAI, model: str, key: str, messages: list[dict[str, str]], max_tokens: int,
               salt: str | None = None) -> Record:
    rec = Record(key, time.perf_counter())
    extra: dict[str, Any] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    last = None
    parts: list[str] = []
    try:
        stream = await api.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                u = chunk.usage
                rec.prompt_tokens, rec.completion_tokens = u.prompt_tokens, u.completion_tokens
                details = u.prompt_tokens_details
                rec.tierkv = getattr(details, "tierkv", None) if details is not None else None
            if not chunk.choices or chunk.choices[0].delta.role is not None:
                continue  # the usage chunk, or the opening chunk (no token yet)
            parts.append(chunk.choices[0].delta.content or "")
            if last is None:
                rec.ttft_s = now - rec.sent
            else:
                rec.itl_s.append(now - last)
            last = now
        rec.done = time.perf_counter()
    except openai.OpenAIError as e:
        rec.error = f"{type(e).__name__}: {e}"
        rec.done = time.perf_counter()
    rec.text = "".join(parts)
    return rec


Job = Callable[[], Awaitable[Record]]


async def open_loop(jobs: Sequence[Job], qps: float, desc: str) -> tuple[list[Record], float]:
    """Start job i at i / qps seconds (all at once for qps <= 0); (records, seconds from the first
    send to the last answer). A progress bar on stderr counts the answers."""
    return await at_offsets(jobs, [i / qps if qps > 0 else 0.0 for i in range(len(jobs))], desc)


async def at_offsets(jobs: Sequence[Job], offsets: Sequence[float], desc: str) -> tuple[list[Record], float]:
    """Start job i ``offsets[i]`` seconds after the first (e.g. Poisson arrival times), never
    waiting for an answer before the next send (open loop); (records, seconds to the last answer)."""
    if len(offsets) != len(jobs):
        raise ValueError(f"{len(jobs)} jobs but {len(offsets)} offsets")
    bar = tqdm(total=len(jobs), desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()

    async def at(at_s: float, job: Job) -> Record:
        await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
        rec = await job()
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(at(o, j) for o, j in zip(offsets, jobs, strict=True)))
    finally:
        bar.close()
    return list(records), time.perf_counter() - t0
