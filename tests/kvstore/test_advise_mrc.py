"""Miss-ratio curves (kvstore/ops/mrc.py, kvstore/ops/mrc_chain.py) against brute-force LRU simulations."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from kvstore.ops.mrc import References, lru_curve, references, stack_distances
from kvstore.ops.mrc_chain import chain_hits
from kvstore.ops.trace import MISS, RECORD_DTYPE, Trace, TraceTier
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT


def brute_lru(keys: list[int], sizes: list[int], demand: list[bool], capacity: int) -> float:
    """One byte-capacity LRU, filled on every reference; the share of demands that hit."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = 0
    for k, s, d in zip(keys, sizes, demand, strict=True):
        if k in cache:
            hits += d
            used -= cache.pop(k)
        if s > capacity:
            continue
        while used + s > capacity:
            used -= cache.popitem(last=False)[1]
        cache[k] = s
        used += s
    return hits / max(1, sum(demand))


def random_refs(rng: np.random.Generator, n: int, keys: int) -> References:
    ids = rng.integers(0, keys, n)
    sizes = np.array([(1 + i % 3) * 100 for i in ids], dtype=np.int64)  # a block keeps its size
    demand = rng.random(n) < 0.8
    return References(ids.astype(np.uint64) * np.uint64(2654435761), sizes, demand, float(demand.sum()))


@pytest.mark.parametrize("seed", range(12))
def test_stack_distance_curve_equals_brute_force_lru(seed: int) -> None:
    rng = np.random.default_rng(seed)
    refs = random_refs(rng, int(rng.integers(20, 400)), int(rng.integers(3, 60)))
    curve = lru_curve(refs)
    args = (refs.keys.tolist(), refs.sizes.tolist(), refs.demand.tolist())
    for capacity in (0, 99, 100, 250, 300, 301, 1000, 2500, 10_000, 100_000):
        expected = brute_lru(*args, capacity)
        assert float(chain_hits(refs, [capacity]).sum()) == pytest.approx(expected, abs=1e-12), capacity
        if capacity >= refs.sizes.max():  # a smaller tier never holds the largest blocks (see mrc.py)
            assert float(curve.hit_ratio(capacity)) == pytest.approx(expected, abs=1e-12), capacity


def test_capacity_for_is_the_smallest_size_reaching_the_target() -> None:
    refs = random_refs(np.random.default_rng(7), 500, 40)
    curve = lru_curve(refs)
    for target in (0.1, 0.3, 0.5, curve.max_hit_ratio):
        c = curve.capacity_for(target)
        assert c is not None and float(curve.hit_ratio(c)) >= target - 1e-12
        assert float(curve.hit_ratio(c - 1)) < target
    assert curve.capacity_for(min(1.0, curve.max_hit_ratio + 0.01)) is None  # beyond the compulsory misses


def test_stack_distances_by_hand() -> None:
    # a(100) b(200) a c(300) b: a's distance = b + a; b's = a + c + b
    refs = References(np.array([1, 2, 1, 3, 2], dtype=np.uint64), np.array([100, 200, 100, 300, 200]),
                      np.ones(5, dtype=bool), 5.0)  # fmt: skip
    assert stack_distances(refs).tolist() == [np.inf, np.inf, 300, np.inf, 600]


def _trace(rows: list[tuple[int, int, int, int]]) -> Trace:
    recs = np.zeros(len(rows), dtype=RECORD_DTYPE)
    for i, (key, size, op, tier) in enumerate(rows):
        recs[i] = (key, size, op, tier, 0, float(i))
    return Trace((TraceTier("cpu", 1000),), True, recs)


def test_demands_are_reads_and_fresh_puts_not_their_echo() -> None:
    refs = references(_trace([
        (1, 0, OP_LOOKUP, MISS),   # lookups move nothing: not a reference
        (1, 100, OP_PUT, MISS),    # the lookup said absent, the client recomputed it: a demand
        (2, 0, OP_GET, MISS),      # a read that missed: a demand
        (2, 50, OP_PUT, MISS),     # ... and its put is the same demand, not a second one
        (1, 100, OP_GET, 0),       # a hit: a demand
        (1, 100, OP_PUT, 0),       # a put of a block already held: not a demand
    ]))  # fmt: skip
    assert refs.demand.tolist() == [True, True, False, True, False]
    assert refs.sizes.tolist() == [100, 0, 50, 100, 100]  # a get-miss's size is learnt at its put


def _zipf_refs(n: int, keys: int, seed: int) -> References:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, keys + 1) ** 0.8
    ids = rng.choice(keys, size=n, p=p / p.sum())
    hashes = rng.integers(0, 2**62, size=keys, dtype=np.uint64)
    sizes = np.where(ids % 3 == 0, 8192, 4096).astype(np.int64)
    return References(hashes[ids], sizes, np.ones(n, dtype=bool), float(n))


def test_sampled_curve_is_within_its_stated_error() -> None:
    refs = _zipf_refs(60_000, 15_000, seed=5)
    exact = lru_curve(refs)
    grid = np.linspace(0, 1.2 * exact.distances[np.isfinite(exact.distances)].max(), 40)
    sampled = lru_curve(refs, rate=0.2)
    kept = refs.sample(0.2)
    assert 0.15 * len(refs) < len(kept) < 0.25 * len(refs)  # the rate is the share of references kept
    assert kept.weights.min() == 1.0 and kept.weights.max() <= 2 / 0.2  # hot blocks sure, weights bounded
    gap = float(np.abs(sampled.hit_ratio(grid) - exact.hit_ratio(grid)).max())
    assert sampled.rate == 0.2 and 0 < sampled.error < 0.2
    assert gap <= sampled.error, (gap, sampled.error)
