"""Miss-ratio curves from an access trace: exact byte-weighted LRU stack distances, or SHARDS.

What counts (from kvstore/ops/trace.py records):
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
a prefix). That holds for any capacity at least the largest block: a smaller tier cannot hold
that block at all, and TieredStore passes it down without evicting anything (mrc_chain.py, a
simulation, models that too; the advisor's sizes are far above one block). A Fenwick tree over time positions, holding each block's size at its latest
reference, gives each distance in O(log n): O(n log n) in all.

SHARDS (Waldspurger et al., FAST '15) keeps the blocks whose key hash falls under a threshold
(rate R) and scales their distances by 1/R. With a skewed popularity a uniform rate keeps or
loses the few hot blocks that decide the curve by chance, so the threshold here is per block:
min(1, max(R/2, c x q)) for a block referenced c times, q set so that ~R of the references are
kept (the trace is offline, so blocks are counted first). Still spatial (a block is in or out
with all its references); hot blocks are kept for sure, and the floor bounds the weight of the
rare ones. On six Zipf(0.8) traces of 60k references over 15k blocks at R = 0.1, the worst gap
to the exact curve fell from 0.25 (mean 0.10) with one rate to 0.08 (mean 0.06). A kept block
weighs w = 1/its rate: its bytes count w x size in the distances above it (a Horvitz-Thompson
estimate of the bytes in between) and its demands count w times. The error is stated from
``SUBSAMPLES`` disjoint hash sub-samples of the blocks kept below rate 1 (the others are in all
of them): three standard errors of the mean (Student t, 7 degrees of freedom: ~98%), at the
worst size. Small samples are noisy: keep ``--samples`` in the 100 thousands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore.ops.trace import MISS, Trace
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT

SHARDS_MODULUS = 1 << 24
SUBSAMPLES = 8
FLOOR = 0.5  # no block is kept at less than this share of the rate: bounds the weights


@dataclass(frozen=True)
class References:
    """The reference stream of a trace: key hash, block size, whether it is a demand, its weight."""

    keys: np.ndarray  # uint64
    sizes: np.ndarray  # int64 bytes
    demand: np.ndarray  # bool
    total_demands: float  # demands of the full trace (N); with sampling, the sample is smaller
    weights: np.ndarray | None = None  # 1 / sampling rate of each reference's block (None: all 1)

    def __len__(self) -> int:
        return len(self.keys)

    def sample(self, rate: float, sub: int | None = None, hot: bool = True) -> References:
        """Spatial sample keeping ~``rate`` of the references (module notes); ``sub``: one of the
        disjoint sub-samples of its unsaturated part; ``hot=False``: one rate for every block."""
        _, inverse, counts = np.unique(self.keys, return_inverse=True, return_counts=True)
        per_key = _pps_rates(counts, rate * len(self), FLOOR * rate) if hot else np.full(len(counts), rate)
        r = per_key[inverse]
        keep = (self.keys % np.uint64(SHARDS_MODULUS)).astype(float) < r * SHARDS_MODULUS
        if sub is not None:
            keep &= (r >= 1) | ((self.keys >> np.uint64(40)) % np.uint64(SUBSAMPLES) == np.uint64(sub))
            r = np.where(r >= 1, 1.0, r / SUBSAMPLES)
        return References(self.keys[keep], self.sizes[keep], self.demand[keep], self.total_demands, 1.0 / r[keep])


def _pps_rates(counts: np.ndarray, budget: float, floor: float) -> np.ndarray:
    """Per-block rates min(1, max(floor, c x q)), q chosen so that ~``budget`` references are kept."""
    c = counts.astype(float)
    if (c * floor).sum() >= budget:
        return np.full(len(c), floor)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        if (c * np.minimum(1.0, np.maximum(floor, c * q))).sum() > budget:
            hi = q
        else:
            lo = q
    return np.minimum(1.0, np.maximum(floor, c * lo))


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
    """Byte-weighted LRU stack distance of each reference (inf for a first reference); a block
    above the reference counts weight x size (its own size counts once: it is there for sure)."""
    n = len(refs)
    tree = [0.0] * (n + 1)  # Fenwick tree over positions 1..n: weighted size of the block last referenced there
    last: dict[int, tuple[int, float]] = {}  # key -> (position, weighted size)
    out = np.full(n, math.inf)
    total = 0.0
    keys, sizes = refs.keys.tolist(), refs.sizes.tolist()
    weights = [1.0] * n if refs.weights is None else refs.weights.tolist()
    for t in range(n):
        k, s = keys[t], sizes[t]
        ws = s * weights[t]
        prev = last.get(k)
        if prev is not None:
            p, ps = prev
            i, below = p, 0.0  # sum of positions <= p
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
            tree[i] += ws
            i += i & -i
        total += ws
        last[k] = (t + 1, ws)
    return out


@dataclass(frozen=True)
class Curve:
    """Hit ratio of one LRU tier against its capacity, from the demands' stack distances."""

    distances: np.ndarray  # of the demands, sorted
    cum_weights: np.ndarray  # demands (weighted when sampled) at or below each distance
    rate: float = 1.0  # 1: exact; else the SHARDS rate
    error: float = 0.0  # stated sampling error (absolute hit ratio), 0 when exact

    def hit_ratio(self, capacity: float | np.ndarray) -> np.ndarray:
        cap = np.minimum(np.asarray(capacity, dtype=float), np.finfo(float).max)  # first references never hit
        if not len(self.cum_weights):
            return np.zeros_like(cap)
        i = np.searchsorted(self.distances, cap, side="right")
        hits = np.where(i > 0, self.cum_weights[np.maximum(i - 1, 0)], 0.0)
        return hits / float(self.cum_weights[-1])

    @property
    def max_hit_ratio(self) -> float:
        """The hit ratio of an unbounded tier (the rest are first references: compulsory misses)."""
        return float(self.hit_ratio(math.inf))

    def capacity_for(self, target: float) -> float | None:
        """The smallest capacity whose hit ratio reaches ``target`` (None: not reachable)."""
        if not len(self.cum_weights):
            return None
        i = int(np.searchsorted(self.cum_weights, target * self.cum_weights[-1] - 1e-9, side="left"))
        if i >= len(self.distances) or not math.isfinite(self.distances[i]):
            return None
        return float(self.distances[i])


def _curve(refs: References, rate: float) -> Curve:
    d = stack_distances(refs)[refs.demand]
    w = np.ones(len(d)) if refs.weights is None else refs.weights[refs.demand]
    order = np.argsort(d, kind="stable")
    return Curve(d[order], np.cumsum(w[order]), rate)


def lru_curve(refs: References, rate: float = 1.0) -> Curve:
    """The top tier's curve: exact when ``rate`` is 1, else sampled at ``rate`` with its error."""
    if rate >= 1.0:
        return _curve(refs, 1.0)
    full = _curve(refs.sample(rate), rate)
    finite = full.distances[np.isfinite(full.distances)]
    grid = np.unique(np.quantile(finite, np.linspace(0, 1, 64))) if len(finite) else np.array([0.0])
    subs = np.array([_curve(refs.sample(rate, sub), rate).hit_ratio(grid) for sub in range(SUBSAMPLES)])
    stderr = subs.std(axis=0, ddof=1) / math.sqrt(SUBSAMPLES)
    return Curve(full.distances, full.cum_weights, rate, float(3 * stderr.max()))


def sampling_rate(n_refs: int, exact_limit: int, max_samples: int) -> float:
    """1.0 (exact) up to ``exact_limit`` references, else the rate that keeps ~``max_samples``."""
    return 1.0 if n_refs <= exact_limit else max(max_samples / n_refs, 1.0 / SHARDS_MODULUS)
