"""Miss-ratio curves from an access trace: exact byte-weighted LRU stack distances, or SHARDS.

What counts (from kvstore/trace.py records):
- A *reference* is every get and every put: a hit moves the block to the front of the top tier
  (a lower-tier hit is promoted there), a new block is put there. Lookups move nothing and are
  skipped. A get that misses is a reference too: the client computes the block and puts it, so
  this models what the client does at *another* size ("demand fill"), not only at the traced one.
- A *demand* is a read the client wanted served: every get, and every put of a block that no
  tier held (the client recomputed it: the lookup said absent), except the put right after a get
  of that key that missed (that get was the demand). The hit ratio is hits / demands.

Exact: the stack distance of a reference is the bytes of distinct blocks referenced since that
block's previous reference, plus its own size: an LRU tier of C bytes holds it iff distance <= C
(TieredStore evicts least-recent blocks until the new one fits, so its content is always such
a prefix). A Fenwick tree over time positions, holding each block's size at its latest
reference, gives each distance in O(log n): O(n log n) in all.

SHARDS (Waldspurger et al., FAST '15): keep only the blocks whose key hash falls under a
threshold (rate R), compute their distances, scale them by 1/R, and count the demands against
the expected R x N (the difference goes to the first bucket: SHARDS_adj). Its error is stated
from the spread of ``SUBSAMPLES`` disjoint hash sub-samples: three standard errors of the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore.trace import MISS, OP_GET, OP_LOOKUP, OP_PUT, Trace

SHARDS_MODULUS = 1 << 24
SUBSAMPLES = 8


@dataclass(frozen=True)
class References:
    """The reference stream of a trace: key hash, block size, and whether it is a demand."""

    keys: np.ndarray  # uint64
    sizes: np.ndarray  # int64 bytes
    demand: np.ndarray  # bool
    total_demands: float  # demands of the full trace (N); with sampling, the sample is smaller

    def __len__(self) -> int:
        return len(self.keys)

    def sample(self, rate: float, sub: int | None = None) -> References:
        """Spatial sample: the blocks whose hash falls under ``rate`` (and in sub-sample ``sub``)."""
        h = self.keys % np.uint64(SHARDS_MODULUS)
        keep = h < np.uint64(max(1, round(rate * SHARDS_MODULUS)))
        if sub is not None:
            keep &= (self.keys >> np.uint64(40)) % np.uint64(SUBSAMPLES) == np.uint64(sub)
        return References(self.keys[keep], self.sizes[keep], self.demand[keep], self.total_demands)


def references(trace: Trace) -> References:
    """The references and demands of a trace (see the module notes)."""
    recs = trace.records[trace.records["op"] != OP_LOOKUP]
    keys = recs["key"].astype(np.uint64)
    sizes = recs["size"].astype(np.int64)
    ops, tiers = recs["op"], recs["tier"]
    demand = np.zeros(len(recs), dtype=bool)
    known: dict[int, int] = {}
    after_get_miss: set[int] = set()
    for i, (k, op, tier) in enumerate(zip(keys.tolist(), ops.tolist(), tiers.tolist(), strict=True)):
        if sizes[i]:
            known[k] = int(sizes[i])
        else:
            sizes[i] = known.get(k, 0)
        if op == OP_GET:
            demand[i] = True
            if tier == MISS:
                after_get_miss.add(k)
            else:
                after_get_miss.discard(k)
        elif op == OP_PUT:
            demand[i] = tier == MISS and k not in after_get_miss
            after_get_miss.discard(k)
    return References(keys, sizes, demand, float(demand.sum()))


def stack_distances(refs: References) -> np.ndarray:
    """Byte-weighted LRU stack distance of each reference (inf for a first reference)."""
    n = len(refs)
    tree = [0] * (n + 1)  # Fenwick tree over positions 1..n: size of the block last referenced there
    last: dict[int, tuple[int, int]] = {}  # key -> (position, size)
    out = np.full(n, math.inf)
    total = 0
    keys, sizes = refs.keys.tolist(), refs.sizes.tolist()
    for t in range(n):
        k, s = keys[t], sizes[t]
        prev = last.get(k)
        if prev is not None:
            p, ps = prev
            i, below = p, 0  # sum of positions <= p
            while i > 0:
                below += tree[i]
                i -= i & -i
            out[t] = total - below + s  # blocks referenced after p, plus this one
            i = p
            while i <= n:
                tree[i] -= ps
                i += i & -i
            total -= ps
        i = t + 1
        while i <= n:
            tree[i] += s
            i += i & -i
        total += s
        last[k] = (t + 1, s)
    return out


@dataclass(frozen=True)
class Curve:
    """Hit ratio of one LRU tier against its capacity, from the demands' stack distances."""

    distances: np.ndarray  # sorted, of the demands (scaled by 1/rate when sampled)
    demands: float  # the denominator (expected demands when sampled)
    extra_hits: float = 0.0  # SHARDS_adj correction, counted as hits at the smallest size
    rate: float = 1.0
    error: float = 0.0  # stated sampling error (absolute hit ratio), 0 when exact

    def hit_ratio(self, capacity: float | np.ndarray) -> np.ndarray:
        cap = np.minimum(np.asarray(capacity, dtype=float), np.finfo(float).max)  # first references never hit
        hits = np.searchsorted(self.distances, cap, side="right") + self.extra_hits
        return np.clip(hits / max(self.demands, 1.0), 0.0, 1.0)

    @property
    def max_hit_ratio(self) -> float:
        """The hit ratio of an unbounded tier (the rest are first references: compulsory misses)."""
        return float(self.hit_ratio(math.inf))

    def capacity_for(self, target: float) -> float | None:
        """The smallest capacity whose hit ratio reaches ``target`` (None: not reachable)."""
        need = math.ceil(target * self.demands - self.extra_hits - 1e-9)
        if need <= 0:
            return 0.0
        if need > len(self.distances) or not math.isfinite(self.distances[need - 1]):
            return None
        return float(self.distances[need - 1])


def _curve(refs: References, rate: float) -> Curve:
    d = stack_distances(refs)[refs.demand] / rate
    expected = refs.total_demands * rate
    extra = (expected - int(refs.demand.sum())) / rate if rate < 1.0 else 0.0
    return Curve(np.sort(d), refs.total_demands, extra, rate)


def lru_curve(refs: References, rate: float = 1.0) -> Curve:
    """The top tier's curve: exact when ``rate`` is 1, else SHARDS at ``rate`` with its error."""
    if rate >= 1.0:
        return _curve(refs, 1.0)
    full = _curve(refs.sample(rate), rate)
    grid = _grid(full)
    subs = np.array([_curve(refs.sample(rate, sub), rate / SUBSAMPLES).hit_ratio(grid) for sub in range(SUBSAMPLES)])
    stderr = subs.std(axis=0, ddof=1) / math.sqrt(SUBSAMPLES)
    return Curve(full.distances, full.demands, full.extra_hits, rate, float(3 * stderr.max()))


def _grid(curve: Curve, points: int = 64) -> np.ndarray:
    finite = curve.distances[np.isfinite(curve.distances)]
    if not len(finite):
        return np.array([0.0])
    return np.unique(np.quantile(finite, np.linspace(0, 1, points)))


def sampling_rate(n_refs: int, exact_limit: int, max_samples: int) -> float:
    """1.0 (exact) up to ``exact_limit`` references, else the rate that keeps ~``max_samples``."""
    return 1.0 if n_refs <= exact_limit else max(max_samples / n_refs, 1.0 / SHARDS_MODULUS)
