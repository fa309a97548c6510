"""Synthetic workloads for the sizing advisor, and their replay through a real TieredStore.

A workload is a list of requests, each a list of pages (page id, payload bytes). The client is
the connector's pattern: look the request's pages up, read the ones a tier holds, recompute and
put the others. Replay serialises the store's write-back (a flush after every call) so that one
run is one outcome: the spill thread's timing would otherwise decide some hits.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.block import encode_block
from kvstore.ops.trace import TraceControl
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

Page = tuple[int, int]  # (page id, payload bytes)
UNIT = 2048  # payload bytes of a one-unit page (small: the replays must be quick)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[list[Page]]

    @property
    def working_set_bytes(self) -> int:
        return sum(len(block(self.name, p, s)) for p, s in {p: s for r in self.requests for p, s in r}.items())


def cyclic(loop_pages: int = 160, rounds: int = 6, per_request: int = 8) -> Workload:
    """A loop over more pages than a small cache holds: LRU's worst case (all or nothing)."""
    pages = [(i, UNIT) for i in range(loop_pages)] * rounds
    return Workload("cyclic", [pages[i : i + per_request] for i in range(0, len(pages), per_request)])


def zipfian(keys: int = 800, requests: int = 500, per_request: int = 4, alpha: float = 0.9, seed: int = 1) -> Workload:
    """Pages drawn by a Zipf law (distinct within a request), one in four twice as large (byte weighting matters)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, keys + 1) ** alpha
    ids = [rng.choice(keys, size=per_request, replace=False, p=p / p.sum()) for _ in range(requests)]
    return Workload("zipfian", [[(int(i), UNIT * (2 if i % 4 == 0 else 1)) for i in row] for row in ids])


def chat(conversations: int = 40, requests: int = 220, first_pages: int = 3, per_round: int = 2,
         seed: int = 2) -> Workload:  # fmt: skip
    """Multi-round chat: a conversation's next turn re-reads its whole history and adds pages;
    popular conversations come back often (Zipf), the rest now and then."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, conversations + 1) ** 0.8
    turns = [0] * conversations
    out = []
    for c in rng.choice(conversations, size=requests, p=p / p.sum()):
        n = first_pages + per_round * turns[c]
        turns[c] += 1
        out.append([(int(c) * 10_000 + i, UNIT) for i in range(n)])
    return Workload("chat", out)


def all_workloads() -> list[Workload]:
    return [cyclic(), zipfian(), chat()]


def block(name: str, page: int, size: int) -> bytes:
    key = f"{name}/{page}".encode()
    return encode_block(key, np.zeros(size, dtype=np.uint8))


@dataclass(frozen=True)
class Replay:
    demands: int
    hits: list[int]  # per level

    def hit_ratio(self, through_level: int | None = None) -> float:
        hits = self.hits if through_level is None else self.hits[: through_level + 1]
        return sum(hits) / self.demands


def replay(w: Workload, capacities: Sequence[int], trace_to: Path | None = None) -> Replay:
    """Run ``w`` through a TieredStore of a cpu tier (+ a disk tier if two capacities); with
    ``trace_to``, the daemon's trace of this run is written there (kvstore/ops/trace.py)."""
    with tempfile.TemporaryDirectory(prefix="tierkv-advise-") as tmp:
        levels = [(CpuTier(int(capacities[0]), pinned=False), LevelOptions())]
        levels += [(DiskTier(Path(tmp) / f"disk{i}", int(c), sync=False), LevelOptions())
                   for i, c in enumerate(capacities[1:])]  # fmt: skip
        store = TieredStore(levels)
        out = trace_to.absolute() if trace_to is not None else None
        control = TraceControl(store, out.parent if out is not None else Path(tmp))  # its traces dir
        if out is not None:
            control.start(str(out))
        demands = 0
        try:
            for req in w.requests:
                keys = [f"{w.name}/{p}".encode() for p, _ in req]
                held = store.lookup(keys).tiers
                for (p, s), k, tier in zip(req, keys, held, strict=True):
                    demands += 1
                    if tier is None or store.get(k) is None:
                        store.put(k, block(w.name, p, s))
                    store.flush()
            hits = [t.hits for t in store.stats().tiers]
        finally:
            if trace_to is not None:
                control.stop()
            store.close()
    return Replay(demands, hits)
