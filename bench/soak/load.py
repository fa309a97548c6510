"""The soak's clients: streaming chat requests through the official ``openai`` client, with mixed
prefix reuse and several tenants, each answer checked against a cold reference. A request's
tenant is its API key's (``Authorization: Bearer KEY``, bench/soak/tenancy.py): the engine runs it
in that tenant whatever the body says; a body ``cache_salt`` only sub-divides the tenant.

Prompts: a few long system prompts (the shared prefixes), each with several questions; clients
pick (tenant, prompt, replica) at random, so a prefix is reused within a tenant, across replicas
(through the daemon) and never across tenants. The reference of a prompt is its greedy answer
computed cold — on a replica, in tenant ``reference`` under a salt no other request uses, so neither the radix cache nor
the daemon can hold any of its pages (its usage must show 0 cached tokens) — before any fault.
Private prompts, each sent by one tenant only, are the cross-tenant probes: when another tenant
sends one afterwards, its usage must show 0 cached tokens.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import openai

from bench.soak.tenancy import LOAD_TENANTS, REFERENCE

TOPICS = ("the Harbor Museum of maritime history", "the Alpine railway timetable office", "a municipal water utility",
          "a cooperative bakery and its suppliers", "a small observatory that runs night tours",
          "a public library's archive of local newspapers")  # fmt: skip
RULES = ("Answer in one short sentence.", "Never invent prices or opening hours.", "Name a concrete place when you can.",
         "If you do not know, say so plainly.", "Prefer the metric system.", "Keep a calm, friendly tone.",
         "Mention accessibility when it matters.", "Do not repeat the question back.")  # fmt: skip
TENANTS = list(LOAD_TENANTS)
QUESTIONS = ("What should a first-time visitor see?", "When is the quietest time to come?", "How do I get there by train?",
             "Is there anything for children?", "What is the history of the place?", "Where can I eat nearby?")  # fmt: skip


class Prompt(NamedTuple):
    pid: str
    messages: list[dict[str, str]]


def system_prompt(i: int, words: int, rng: random.Random, tag: str = "") -> str:
    """A long, distinct system prompt: its first words differ from every other's (so its first
    page of KV does too)."""
    head = f"{tag}Assistant {i} for {TOPICS[i % len(TOPICS)]}. "
    body = []
    while len(" ".join(body).split()) < words:
        body.append(rng.choice(RULES))
        body.append(f"Note {len(body)}: visitors often ask about {rng.choice(TOPICS)} and {rng.choice(QUESTIONS).lower()}")
    return head + " ".join(body)


def workload(systems: int, questions: int, words: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for s in range(systems):
        sys_text = system_prompt(s, words, rng)
        for q in range(questions):
            out.append(Prompt(f"s{s}q{q}", [{"role": "system", "content": sys_text},
                                            {"role": "user", "content": QUESTIONS[q % len(QUESTIONS)]}]))  # fmt: skip
    return out


def dos_client_prompts(prompts: list[Prompt]) -> list[Prompt]:
    """The 4 of the workload's prompts the DoS phase's normal client asks, in turn (bench/soak/dos.py)."""
    return prompts[:: max(1, len(prompts) // 4)]


def private_prompt(owner: str, k: int, words: int, seed: int) -> Prompt:
    rng = random.Random(f"{seed}-{owner}-{k}")
    text = system_prompt(k, words, rng, tag=f"Private notebook {k} of {owner}. ")
    return Prompt(f"private-{owner}-{k}", [{"role": "system", "content": text},
                                           {"role": "user", "content": "Summarise my notebook."}])  # fmt: skip


@dataclass
class Answer:
    pid: str
    tenant: str
    replica: str
    text: str = ""
    cached: int = -1
    prompt_tokens: int = 0
    error: str | None = None
    t0: float = 0.0
    t1: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # usage's tierkv "cached": tokens by where their KV came from
    pages: dict[str, int] = field(default_factory=dict)  # usage's tierkv page outcomes: reason -> pages
    token_times: list[float] = field(default_factory=list)  # when each content chunk arrived (clock)


@dataclass
class Load:
    replicas: list[str]  # base URLs
    model: str
    max_tokens: int
    api_keys: dict[str, str]  # tenant -> API key
    clock: Callable[[], float] = time.monotonic
    answers: list[Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.clients = {b: openai.OpenAI(base_url=b + "/v1", api_key="soak", max_retries=0, timeout=180)
                        for b in self.replicas}  # fmt: skip

    def ask(self, prompt: Prompt, tenant: str, replica: str, keep: bool = True, salt: str | None = None,
            max_tokens: int | None = None) -> Answer:  # fmt: skip
        """One streamed chat completion with ``tenant``'s API key (``salt``: the body's cache_salt);
        an exception of any kind is the answer's ``error``."""
        a = Answer(prompt.pid, tenant, replica, t0=self.clock())
        try:
            stream = self.clients[replica].chat.completions.create(
                model=self.model, messages=prompt.messages, max_tokens=max_tokens or self.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_headers={"Authorization": f"Bearer {self.api_keys[tenant]}"},
                extra_body={"cache_salt": salt} if salt else None)  # fmt: skip
            parts = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    a.token_times.append(self.clock())
                if chunk.usage is not None:
                    a.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    a.cached = details.cached_tokens if details is not None else 0
                    tierkv = (details.model_extra or {}).get("tierkv") if details is not None else None
                    if isinstance(tierkv, dict):
                        a.sources = {k: int(v) for k, v in (tierkv.get("cached") or {}).items()}
                        pages = (tierkv.get("pages") or {}).get("outcomes") or []
                        for p in pages:
                            a.pages[p["reason"]] = a.pages.get(p["reason"], 0) + int(p["pages"])
            a.text = "".join(parts)
            if a.cached < 0:
                a.error = "stream ended without usage"
        except Exception as e:  # noqa: BLE001 - every failure a client could see is counted
            a.error = f"{type(e).__name__}: {e}"[:300]
        a.t1 = self.clock()
        if keep:
            with self._lock:
                self.answers.append(a)
        return a

    def references(self, prompts: list[Prompt], concurrency: int = 2, shift: int = 0) -> dict[str, Answer]:
        """Each prompt once, cold: tenant ``reference`` under a salt of its own; prompt i on replica
        i + ``shift`` (round-robin)."""
        jobs = [(p, self.replicas[(i + shift) % len(self.replicas)]) for i, p in enumerate(prompts)]
        out: dict[str, Answer] = {}
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not jobs:
                        return
                    p, replica = jobs.pop(0)
                a = self.ask(p, REFERENCE, replica, keep=False, salt=f"reference-{uuid.uuid4().hex}")
                with lock:
                    out[p.pid] = a

        threads = [threading.Thread(target=worker) for _ in range(concurrency * len(self.replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def warm(self, prompts: list[Prompt], tenants: list[str], concurrency: int = 2) -> int:
        """Each tenant asks each system prompt once (its first question), replicas in turn, not kept:
        every (tenant, system prompt) prefix is then in the daemon before the soak, so a soak answer
        that misses its replica's radix tree loads it rather than computing it for the first time.
        Returns the answers that failed (they are only a warm-up: the soak's own answers count)."""
        firsts: dict[str, Prompt] = {}
        for p in prompts:
            firsts.setdefault(p.messages[0]["content"], p)
        jobs = [(p, t, self.replicas[i % len(self.replicas)]) for i, (t, p) in
                enumerate((t, p) for t in tenants for p in firsts.values())]
        lock, failed = threading.Lock(), [0]

        def worker() -> None:
            while True:
                with lock:
                    if not jobs:
                        return
                    p, tenant, replica = jobs.pop(0)
                if self.ask(p, tenant, replica, keep=False).error is not None:
                    with lock:
                        failed[0] += 1

        threads = [threading.Thread(target=worker) for _ in range(concurrency * len(self.replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return failed[0]

    def run(self, prompts: list[Prompt], tenants: list[str], clients: int, stop: threading.Event,
            seed: int, skew_every: int = 16) -> None:  # fmt: skip
        """``clients`` threads asking until ``stop``: a prompt by a skewed choice (hot prefixes
        come back often: prompt i weighs 1 / (1 + i // ``skew_every``)), a tenant and a replica at
        random."""

        def client(k: int) -> None:
            rng = random.Random(seed * 100 + k)
            weights = [1.0 / (1 + i // skew_every) for i in range(len(prompts))]
            while not stop.is_set():
                p = rng.choices(prompts, weights)[0]
                self.ask(p, rng.choice(tenants), rng.choice(self.replicas))

        threads = [threading.Thread(target=client, args=(k,), name=f"soak-client-{k}") for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
