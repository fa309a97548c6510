"""One round of cluster traffic: every live node writes fresh blocks, then reads another node's.

``run_round(h, r, count)``: every node with a worker is sent ``put rR-nI COUNT`` at once (its daemon
writes them through to Redis Cluster and S3), then every such node reads ``count`` blocks another
node wrote this round: the next node after it (cyclically) whose put was answered without an error
(``read_all_others``: every such other node, one read each). The blocks' bytes follow from their
keys (bench/cluster/node_client.py), so each read counts hits, misses and ``wrong`` blocks.

A node with no worker (its daemon killed) is not sent anything: its would-be operations are
counted ``unavailable``. An answer with ``error`` (the client raised, or its worker gave no answer
in ``timeout_s``) is a client error. ``Round.full_hit(i)``: node i read everything it asked, with no
error and nothing wrong, the recovery test of bench/cluster/faults.py.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from bench.cluster.harness import ClusterHarness


@dataclass
class Round:
    index: int
    count: int
    t_end: float = 0.0
    seconds: float = 0.0
    puts: dict[int, dict[str, object]] = field(default_factory=dict)
    gets: dict[int, list[tuple[int, dict[str, object]]]] = field(default_factory=dict)  # reader -> [(writer, answer)]
    unavailable: int = 0

    def put_ok(self, i: int) -> bool:
        a = self.puts.get(i)
        return a is not None and "error" not in a

    def full_hit(self, i: int) -> bool:
        reads = self.gets.get(i) or []
        return bool(reads) and self.put_ok(i) and all(
            "error" not in a and a.get("hits") == self.count and a.get("wrong") == 0 for _, a in reads)

    @property
    def answers(self) -> list[dict[str, object]]:
        return [*self.puts.values(), *(a for reads in self.gets.values() for _, a in reads)]

    @property
    def errors(self) -> list[str]:
        return [str(a["error"]) for a in self.answers if "error" in a]

    def tally(self) -> Counter[str]:
        """requests, client_errors, unavailable, hits, asked (cross-node blocks), wrong, and the tiers
        that answered the reads (``tier_redis``, ``tier_s3``, ``tier_miss``, ...)."""
        c: Counter[str] = Counter(requests=len(self.answers), client_errors=len(self.errors),
                                  unavailable=self.unavailable)
        for reads in self.gets.values():
            for _, a in reads:
                if "error" in a:
                    continue
                c["asked"] += self.count
                c["hits"] += int(a.get("hits", 0))  # type: ignore[call-overload]
                c["wrong"] += int(a.get("wrong", 0))  # type: ignore[call-overload]
                for tier, n in dict(a.get("tiers") or {}).items():  # type: ignore[call-overload]
                    c[f"tier_{tier}"] += n
        return c


def tag(r: int, i: int) -> str:
    return f"r{r}n{i}"


def run_round(h: ClusterHarness, r: int, count: int, *, read_all_others: bool = False,
              timeout_s: float = 30.0) -> Round:
    t0 = time.monotonic()
    rnd = Round(r, count)
    n = len(h.workers)
    live = [i for i, w in enumerate(h.workers) if w is not None]
    rnd.unavailable = 2 * (n - len(live))
    for i in live:
        h.workers[i].send("put", tag(r, i), count)  # type: ignore[union-attr]
    for i in live:
        rnd.puts[i] = h.workers[i].receive(timeout_s)  # type: ignore[union-attr]
    written = [j for j in range(n) if rnd.put_ok(j)]
    plan: dict[int, list[int]] = {}
    for i in live:
        others = [(i + k) % n for k in range(1, n) if (i + k) % n in written]
        plan[i] = others if read_all_others else others[:1]
    for step in range(max((len(p) for p in plan.values()), default=0)):
        readers = [i for i in live if step < len(plan[i])]
        for i in readers:
            h.workers[i].send("get", tag(r, plan[i][step]), count)  # type: ignore[union-attr]
        for i in readers:
            rnd.gets.setdefault(i, []).append((plan[i][step], h.workers[i].receive(timeout_s)))  # type: ignore[union-attr]
    rnd.t_end = time.monotonic()
    rnd.seconds = round(rnd.t_end - t0, 3)
    return rnd


def summed(rounds: list[Round]) -> Counter[str]:
    total: Counter[str] = Counter()
    for rnd in rounds:
        total.update(rnd.tally())
    return total
