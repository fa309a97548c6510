"""The workloads of bench.vllm, as OpenAI chat messages with Poisson arrival times.

``chat`` (the shape of LMCache's multi-round QA benchmark): ``users`` users share one system
prompt; each user's first turn carries a private history (a document), and every later turn sends
the whole conversation so far plus a new question. The assistant turns in the history are fixed
text of ``answer_tokens``, not what the server answered: every mode is then sent exactly the same
prompts, so their answers can be compared token for token. Users take turns round-robin.

``shared_prefix``: a pool of ``prefixes`` long documents; each request is one of them, drawn
uniformly at random, then a question of its own. Exact prefix caching reuses a request's KV only
while its document is still cached somewhere.

Every run uses new text (its own seed), so one run's KV never serves the next: each run starts
cold and warms up, the same for every mode. Arrivals are Poisson at ``qps`` for ``duration_s``.

The working set is measured from the requests themselves: the distinct full KV blocks (chained
over the token ids under the model's chat template, as vLLM keys its prefix cache) of all of a
run's prompts, times the block size. It is compared with the pool, never sized from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from bench.serve.workload import Text

BLOCK = 128  # vLLM's CPU block size (tokens)


@dataclass(frozen=True)
class Request:
    key: str  # "u3r2" (user 3, round 2) or "p5q7" (prefix 5, request 7)
    messages: list[dict[str, str]]
    at_s: float  # arrival, seconds after the run's first send


# The pool and the load are set so the pool holds the requests that arrive together and no more,
# and the working set is still >= 4x the pool, measured: a 24-block pool (3,072 tokens, about five
# 6-block chat requests at once) at 1 req/s, with 36 users / 36 documents. Why not smaller: with a
# 14-block pool at 0.5 req/s (about two requests at once) the measured TTFT gap between any offload
# and the ideal (400 blocks) was queueing for room in the pool, equal for vLLM with and without
# tierkv (bench/results/vllm_quick_pool14.json, 3d3c84f: queue 0.084 s vs 0.081 s vs the ideal's 0; the
# prefill with tierkv equal to the ideal's); with 8-block requests in a 12-block pool, one request at
# a time, tierkv_cpu was 1.75x / 3.3x the ideal's mean TTFT for the same reason. No offload removes
# queueing for pool room, so that setting measures the pool size, not the connector. The sizes are
# LMCache's multi-round QA shape the issue measured (300-token system prompt and history).
@dataclass(frozen=True)
class ChatSpec:
    users: int = 36
    system_tokens: int = 300
    history_tokens: int = 300
    question_tokens: int = 30
    answer_tokens: int = 24


@dataclass(frozen=True)
class PrefixSpec:
    prefixes: int = 36
    prefix_tokens: int = 500
    question_tokens: int = 30
    answer_tokens: int = 24


def arrivals(qps: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Poisson arrival times in [0, duration_s): exponential gaps of mean 1/qps."""
    if qps <= 0 or duration_s <= 0:
        raise ValueError(f"qps and duration must be > 0 (got {qps}, {duration_s})")
    out, t = [], float(rng.exponential(1 / qps))
    while t < duration_s:
        out.append(t)
        t += float(rng.exponential(1 / qps))
    return out


def chat_requests(spec: ChatSpec, tokenizer, qps: float, duration_s: float, seed: int) -> list[Request]:
    text, rng = Text(tokenizer, seed), np.random.default_rng(seed + 1)
    system = text.make(spec.system_tokens)
    convs = [[{"role": "system", "content": system}] for _ in range(spec.users)]
    rounds = [0] * spec.users
    out = []
    for i, at in enumerate(arrivals(qps, duration_s, rng)):
        u = i % spec.users
        q = text.make(spec.question_tokens)
        if rounds[u] == 0:
            q = f"Here is my history:\n{text.make(spec.history_tokens)}\n\nQuestion: {q}"
        else:
            convs[u].append({"role": "assistant", "content": text.make(spec.answer_tokens)})
        convs[u].append({"role": "user", "content": q})
        out.append(Request(f"u{u}r{rounds[u]}", list(convs[u]), at))
        rounds[u] += 1
    return out


def prefix_requests(spec: PrefixSpec, tokenizer, qps: float, duration_s: float, seed: int) -> list[Request]:
    text, rng = Text(tokenizer, seed), np.random.default_rng(seed + 1)
    docs = [text.make(spec.prefix_tokens) for _ in range(spec.prefixes)]
    out = []
    for i, at in enumerate(arrivals(qps, duration_s, rng)):
        p = int(rng.integers(spec.prefixes))
        msgs = [{"role": "system", "content": f"Answer from this document only.\n\n{docs[p]}"},
                {"role": "user", "content": text.make(spec.question_tokens)}]  # fmt: skip
        out.append(Request(f"p{p}q{i}", msgs, at))
    return out


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def working_set_tokens(tokenizer, requests: list[Request], block: int = BLOCK) -> tuple[int, int]:
    """(distinct full-block KV tokens over all ``requests``, tokens of the longest prompt)."""
    seen: set[bytes] = set()
    longest = 0
    for r in requests:
        ids = prompt_ids(tokenizer, r.messages)
        longest = max(longest, len(ids))
        h = b""
        for start in range(0, len(ids) - block + 1, block):
            h = hashlib.blake2b(h + np.asarray(ids[start:start + block], dtype=np.int64).tobytes(),
                                digest_size=16).digest()  # fmt: skip
            seen.add(h)
    return len(seen) * block, longest


def blocks_per_request(tokenizer, requests: list[Request], answer_tokens: int, block: int = BLOCK) -> float:
    """The mean blocks a request holds in vLLM's pool once answered (prompt and answer, rounded up):
    with the pool's size, how many requests can run at once."""
    if not requests:
        return 0.0
    return float(np.mean([-(-(len(prompt_ids(tokenizer, r.messages)) + answer_tokens) // block) for r in requests]))
