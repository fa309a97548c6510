"""``make demo-vllm`` (``python -m connector.vllm.demo``): one kvstore daemon, two vLLM replicas
sharing it through TierKVConnector, and replica B answering conversations it never saw from the
blocks replica A saved.

Each conversation (a long shared system prompt, a user's document and a question) goes to A first:
A prefills it and writes its full blocks through to the daemon. The same conversation then goes to
B, which has never seen it: B's connector finds the blocks in the daemon, its cost model decides to
load them, and B answers after a load instead of a prefill. The demo prints both TTFTs, the blocks
B loaded (from B's own /metrics) and whether B's greedy answer is A's: A's fresh one, or A's from its
own prefix cache (a cache hit splits the prefill, and bf16 sums over a split can flip a token).

vLLM runs from ``.venv-vllm`` (``make vllm-setup``); the daemon is ``kvstore serve`` with one cpu
tier; everything listens on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.servers import running_daemon
from connector.vllm.launch import SERVED_NAME, VLLMServer, VLLMUnavailable, vllm_python

SYSTEM = ("You are Atlas, a careful assistant for a rail operator's support desk. You know timetables, "
          "station layouts, ticket rules, luggage limits, accessibility services and refund policies. "
          "Answer in two sentences, name the rule you rely on, and never invent prices. ") * 6
USERS = {
    "Ana": "My booking: Paris Gare de Lyon to Lyon Part-Dieu, 07:56, coach 14, seat 82, with a bicycle. ",
    "Ben": "My booking: Brussels Midi to Amsterdam Centraal, 10:16, coach 3, seat 41, with a guide dog. ",
    "Chen": "My booking: Milano Centrale to Zurich HB, 09:10, coach 8, seat 12, with two large suitcases. ",
}
QUESTION = "The train was cancelled. What are my options, and what happens to the reservation?"


def conversation(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": (USERS[user] * 20) + QUESTION}]


def chat(srv: VLLMServer, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """(TTFT seconds, the answer) of one streamed, greedy chat completion."""
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True, "messages": messages}
    req = urllib.request.Request(f"{srv.url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0, ttft, parts = time.perf_counter(), float("nan"), []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                if not parts:
                    ttft = time.perf_counter() - t0
                parts.append(delta)
    return ttft, "".join(parts)


def wait_saved(srv: VLLMServer, at_least: float, timeout_s: float = 60) -> float:
    """A's saves are asynchronous (write-through, off the forward path): wait for its counter."""
    end = time.monotonic() + timeout_s
    while (n := srv.tierkv("blocks", event="saved")) < at_least and time.monotonic() < end:
        time.sleep(0.3)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m connector.vllm.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--keep", default="", help="keep the logs (daemon, vllm-A, vllm-B) under this directory")
    a = ap.parse_args(argv)
    try:
        vllm_python()
    except VLLMUnavailable as e:
        print(f"demo-vllm: {e}", file=sys.stderr)
        return 2
    from connector.vllm.model_dir import vllm_model_dir

    model = vllm_model_dir()
    with tempfile.TemporaryDirectory(prefix="tierkv-vllm-demo-") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        with running_daemon(work / "daemon", "--cpu", "2GiB", log_path=work / "daemon.log") as address:
            print(f"kvstore daemon on {address} (cpu tier); starting vLLM replicas A and B (~40 s each) ...")
            one = str(min(1, (os.cpu_count() or 1) - 1))
            reps = {n: VLLMServer(model, address, log=work / f"vllm-{n}.log", cores=c)
                    for n, c in (("A", "0"), ("B", one))}  # fmt: skip
            try:
                for s in reps.values():
                    s.start(wait=False)
                for s in reps.values():
                    s.wait_ready(600)
                A, B = reps["A"], reps["B"]
                for s in (A, B):  # warm both servers' code paths on a conversation of no user's
                    chat(s, [{"role": "user", "content": "Say hello."}], 2)
                print(f"\n{'user':6} {'A TTFT (prefill)':>17} {'B TTFT (from A)':>16} {'B loaded':>9}  B's answer = A's")
                same_all = True
                for user in USERS:
                    saved = A.tierkv("blocks", event="saved")
                    ttft_a, ans_a = chat(A, conversation(user), a.max_tokens)
                    wait_saved(A, saved + 1)
                    time.sleep(0.5)
                    before = B.tierkv("blocks", event="loaded")
                    ttft_b, ans_b = chat(B, conversation(user), a.max_tokens)
                    time.sleep(1.0)  # vLLM publishes connector stats a step later
                    got = B.tierkv("blocks", event="loaded") - before
                    # B computed only the tail over loaded KV: the split of a prefix-cache hit, whose
                    # bf16 sums can differ from one pass. A asked again answers from its own cache
                    # (the same split): B must match A fresh or A from its own cache
                    _, ans_hit = chat(A, conversation(user), a.max_tokens)
                    same = ans_b in (ans_a, ans_hit)
                    same_all &= same
                    how = "fresh" if ans_b == ans_a else "A's own cache" if same else "NO"
                    print(f"{user:6} {ttft_a:16.3f}s {ttft_b:15.3f}s {int(got):9d}  {how}")
                print(f"\nB: {int(B.tierkv('blocks', event='loaded'))} blocks loaded from the daemon, "
                      f"{int(B.tierkv('failed_blocks'))} failed; A: {int(A.tierkv('blocks', event='saved'))} saved")
                print(f"answer ({'B as A' if same_all else 'B DIFFERENT from A'}): {ans_b[:200]!r}")
                return 0 if same_all else 1
            finally:
                for s in reps.values():
                    s.stop()


if __name__ == "__main__":
    sys.exit(main())
