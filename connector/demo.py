"""`make demo` (``python -m connector.demo --with-kvstore``): start `kvengine serve` on the bundled model, run a short multi-turn chat workload
through the official openai client, and print cold vs warm TTFT and the prefix-cache hit rate.

With ``--with-kvstore`` (the connector's demo) a kvstore daemon is started too, and a second engine
replica that never saw the conversation answers from KV the first replica computed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from bench.servers import EngineServer, running_daemon

SYSTEM = ("You are Atlas, a concise travel assistant for European rail trips. You know timetables, "
          "station layouts, ticket rules, luggage limits and good places to eat near stations. Answer in "
          "at most two sentences, name concrete places, and never invent prices. ") * 4
TURNS = [
    "I am going from Paris to Lyon tomorrow morning. Which station do I leave from?",
    "How long does the trip take?",
    "Is there a good cafe near the arrival station?",
    "And what should I see in Lyon if I only have one afternoon?",
]
USERS = ["Ana", "Ben", "Chen"]


@contextmanager
def engine_server(extra: list[str], name: str, env: dict[str, str] | None = None,
                  timeout: float = 300) -> Iterator[str]:
    """`kvengine serve` on a free loopback port (bench/servers.py) for a ``with`` block; yields its base URL."""
    with EngineServer(*extra, env=env, grace_s=20, label=name) as server:
        print(f"[demo] starting {name}: {' '.join(server.argv[1:])}", flush=True)
        server.wait_ready(timeout)
        yield server.base


def chat_ttft(client, messages: list[dict]) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    ttft, text, cached = None, [], 0
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), cached


def metric(base: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


@contextmanager
def kvstore_daemon(workdir: str):
    """`kvstore serve` with its embedded default tiers (cpu over disk, the disk under ``workdir``)."""
    with running_daemon(workdir) as address:
        print(f"[demo] kvstore daemon on {address} (cpu 1GiB -> disk under {workdir})", flush=True)
        yield address


def run_workload(base: str, histories: dict[str, list[dict]] | None = None) -> dict[str, list[float]]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    if histories is None:
        histories = {}
    for u in USERS:
        histories.setdefault(u, [{"role": "system", "content": SYSTEM}])
    cold, warm = [], []
    for t, question in enumerate(TURNS):
        for u in USERS:
            histories[u].append({"role": "user", "content": f"({u}) {question}"})
            ttft, answer, cached = chat_ttft(client, histories[u])
            histories[u].append({"role": "assistant", "content": answer})
            (cold if cached == 0 else warm).append(ttft)
            print(f"  turn {t + 1} {u:5s} ttft={ttft * 1000:7.1f} ms cached_tokens={cached:5d}  {answer[:60]!r}",
                  flush=True)
    return {"cold": cold, "warm": warm}


def replay_last_turns(base: str, histories: dict[str, list[dict]]) -> list[tuple[float, int]]:
    """Ask a replica each user's last question again, with the whole conversation before it."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    out = []
    for u in USERS:
        ttft, answer, cached = chat_ttft(client, histories[u][:-1])
        out.append((ttft, cached))
        print(f"  replica B {u:5s} ttft={ttft * 1000:7.1f} ms cached_tokens={cached:5d}  {answer[:60]!r}", flush=True)
    return out


def main_with_kvstore(kv_memory: str) -> int:
    import tempfile

    env = {"TIERKV_CONNECTOR_WRITE_THROUGH": "1"}  # offload at request finish, not only on eviction
    flags = ["--kv-memory", kv_memory, "--threads", "2"]
    histories: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as work, kvstore_daemon(work) as address:
        with engine_server([*flags, "--kvstore", address], "replica A", env) as base:
            res = run_workload(base, histories)
        print("[demo] replica A stopped; starting replica B, which never saw these conversations", flush=True)
        with engine_server([*flags, "--kvstore", address], "replica B", env) as base:
            replayed = replay_last_turns(base, histories)
            loaded = sum(float(m) for m in re.findall(
                r'^tierkv_connector_loaded_tokens_total\{tier="[^"]+"\} ([0-9.e+-]+)$',
                httpx.get(base + "/metrics").text, re.M))
    cold = statistics.median(res["cold"]) if res["cold"] else float("nan")
    b_ttft = statistics.median(t for t, _ in replayed)
    prompt_tokens = sum(c for _, c in replayed)
    print("\n=== tierkv demo with the kvstore daemon: 3 users x 4 turns on replica A, last turns on replica B ===")
    print(f"replica A cold TTFT (no cached prefix), median of {len(res['cold'])}: {cold * 1000:8.1f} ms")
    print(f"replica A warm TTFT (its own radix hits), median of {len(res['warm'])}: "
          f"{statistics.median(res['warm']) * 1000 if res['warm'] else float('nan'):8.1f} ms")
    print(f"replica B TTFT on conversations it never saw, median of {len(replayed)}: {b_ttft * 1000:8.1f} ms")
    print(f"replica B prompt tokens served from cache: {prompt_tokens}, loaded from the daemon: {int(loaded)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kv-memory", default="256MiB")
    ap.add_argument("--with-kvstore", action="store_true",
                    help="start a kvstore daemon too and show a second replica reusing the first's KV")
    a = ap.parse_args(argv)
    if a.with_kvstore:
        return main_with_kvstore(a.kv_memory)
    with engine_server(["--kv-memory", a.kv_memory, "--threads", "2"], "engine") as base:
        res = run_workload(base)
        prompt = metric(base, "tierkv_engine_prompt_tokens_total")
        hit = metric(base, "tierkv_engine_prefix_hit_tokens_total")
    cold = statistics.median(res["cold"]) if res["cold"] else float("nan")
    warm = statistics.median(res["warm"]) if res["warm"] else float("nan")
    print("\n=== tierkv demo: multi-turn chat, 3 users x 4 turns, shared system prompt ===")
    print(f"cold TTFT (no cached prefix), median of {len(res['cold'])}: {cold * 1000:8.1f} ms")
    print(f"warm TTFT (radix prefix hit), median of {len(res['warm'])}: {warm * 1000:8.1f} ms")
    print(f"speed-up cold/warm: {cold / warm:.1f}x")
    print(f"prefix-cache hit rate: {hit / max(prompt, 1):.1%} of {int(prompt)} prompt tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
