"""Timed passes of bench.tiers: a tier's get and its raw baseline over the same blocks, interleaved.

A pass reads every block once; a repetition times one pass of each side, block by block, with
the order of the two sides flipped every block and every repetition, so load from other
processes on a shared machine lands on both sides instead of on one whole pass. Extra baselines
(e.g. one Redis MGET of every key) are timed once per repetition beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.tiers import figures as fig
from tiers.base import Tier

Block = tuple[bytes, np.ndarray]
RawGet = Callable[[bytes, np.ndarray], object]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Passes:
    """Seconds per pass of each side; every list has one entry per repetition (puts excepted)."""

    nbytes: int
    put_s: list[float]
    get_s: list[float]
    raw_s: list[float]
    extra_s: dict[str, list[float]] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "put_gbps": round(fig.gbps(self.nbytes, self.put_s), 3),
            "get_gbps": round(fig.gbps(self.nbytes, self.get_s), 3),
            "raw_gbps": round(fig.gbps(self.nbytes, self.raw_s), 3),
            "ratio": round(fig.ratio_of_medians(self.get_s, self.raw_s), 3),
            "paired_ratio": round(fig.paired_ratio(self.get_s, self.raw_s), 3),
        }
        for name, secs in self.extra_s.items():
            out[f"{name}_gbps"] = round(fig.gbps(self.nbytes, secs), 3)
        return out


def measure(tier: Tier, blocks: list[Block], raw_get: RawGet, reps: int,
            consume: Callable[[object], object] = len,
            extra: dict[str, Callable[[], object]] | None = None) -> Passes:
    """Puts one block at a time, as the store does (overwrites after one untimed write), then
    ``reps`` interleaved raw-vs-tier single-key get passes (and the ``extra`` whole-pass calls)."""
    nbytes = sum(a.nbytes for _, a in blocks)

    def put_all() -> None:
        for k, a in blocks:
            tier.put(k, a.data)

    put_all()  # untimed first write: S3 grows volumes, lmdb extends its file
    puts = [timed(put_all) for _ in range(max(3, reps // 2))]
    for k, a in blocks:  # warm both sides and check both return what was stored
        raw = raw_get(k, a)
        got = tier.get(k)
        assert got is not None and len(got) == a.nbytes, f"{tier.name} returned wrong bytes"
        assert raw is None or len(raw) == a.nbytes, f"{tier.name} baseline returned wrong bytes"  # type: ignore[arg-type]
    extra = extra or {}
    passes = Passes(nbytes, puts, [], [], {name: [] for name in extra})
    for rep in range(reps):
        raw_s = get_s = 0.0
        for i, (k, a) in enumerate(blocks):
            if (i + rep) % 2:
                raw_s += timed(lambda k=k, a=a: raw_get(k, a))
                get_s += timed(lambda k=k: consume(tier.get(k)))
            else:
                get_s += timed(lambda k=k: consume(tier.get(k)))
                raw_s += timed(lambda k=k, a=a: raw_get(k, a))
        passes.raw_s.append(raw_s)
        passes.get_s.append(get_s)
        for name, fn in extra.items():
            passes.extra_s[name].append(timed(fn))
    return passes
