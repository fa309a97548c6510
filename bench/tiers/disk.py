"""The disk tier in bench.tiers, warm and cold, against raw lmdb and O_DIRECT.

Warm (page cache holds both files): ``DiskTier.get`` vs ``txn.get`` on a second lmdb environment
opened with the tier's flags and map size and written with the same blocks, block by block
interleaved (bench.tiers.passes). Figures: ``ratio``, ``paired_ratio``.

Cold: on a fresh tier and a fresh raw environment, each written once with the same blocks in the
same order (the warm part rewrites the tier's blocks many times, which scatters its pages; the
cold ratio must price our code, not a different layout). Before each timed pass every mapping
of the file is closed (the tier or the raw environment is reopened) and its pages are dropped
with ``posix_fadvise(DONTNEED)``; the share still cached is measured with ``mincore``
(``resident_after_drop_max``). Six sides per repetition, in rotating order:
  tier          reopened DiskTier, ``get`` of every block (py-lmdb touches every page of the value
                inside ``get``, so the kernel faults it in with its readahead, then it is copied
                into a ``bytes`` the caller owns)
  lmdb          reopened raw environment, ``txn.get`` of every block (the same, without our code)
  direct1       O_DIRECT reads of exactly the byte ranges lmdb holds the values in, page-aligned,
                into one mmap-allocated buffer reused by every read, one request per block
  direct4       the same as 256 KiB pieces, 4 requests in flight
  direct1_owned direct1, then the bytes copied out of the reused buffer (``bytes``)
  direct_fresh  one O_DIRECT request per block into a fresh mmap of its own (no copy)
A ``get`` must hand back memory its caller owns (the next read cannot overwrite it), so the
baselines that do the same job are lmdb, direct1_owned and direct_fresh: ``cold_ratio`` = tier /
the fastest of those (ratio of medians). Until 2026-12-02 ``cold_ratio`` was against the fastest
of lmdb, direct1 and direct4, whose O_DIRECT reads end in a buffer the next read overwrites; that
figure is kept, under its own name, as ``cold_view_ratio``. ``cold_direct_ratio`` = tier / the
faster of direct1 and direct4 (views), ``cold_direct_owned_ratio`` = tier / the faster of
direct1_owned and direct_fresh, ``cold_lmdb_ratio`` = tier / raw lmdb.
``cold_verified``: every drop left <= 5% of pages cached and the cold tier pass was slower than
the warm one. A VM's host may still cache the disk image below us; the residency figure only
speaks for this kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.tiers import figures as fig
from bench.tiers.baselines import lmdb_get, lmdb_open_like
from bench.tiers.page_cache import DirectReader, drop_pages, lmdb_value_span, resident_fraction
from bench.tiers.passes import Block, measure, timed

COLD_SIDES = ("tier", "lmdb", "direct1", "direct4", "direct1_owned", "direct_fresh")
OWNED_BASELINES = ("lmdb", "direct1_owned", "direct_fresh")  # hand back memory the caller owns, as get does
DIRECT_WORKERS = 4


def _write_raw(path: Path, map_size: int, blocks: list[Block]) -> dict[bytes, tuple[int, int]]:
    """Write the blocks (one txn each, as the tier does) and return where each value lies in data.mdb."""
    env = lmdb_open_like(path, map_size)
    try:
        for k, a in blocks:
            with env.begin(write=True) as txn:
                txn.put(k, a.data)
        with env.begin(buffers=True) as txn:
            return {k: lmdb_value_span(path / "data.mdb", txn.get(k)) for k, _ in blocks}
    finally:
        env.close()


def _cold_pass(side: str, tier_dir: Path, raw_dir: Path, blocks: list[Block], capacity: int,
               map_size: int, spans: dict[bytes, tuple[int, int]]) -> tuple[float, float]:
    """(seconds, resident fraction after the drop) of one cold pass of ``side``."""
    from tiers.disk import DiskTier

    data = (tier_dir if side == "tier" else raw_dir) / "data.mdb"
    if side == "tier":
        with DiskTier(tier_dir, capacity) as tier:
            drop_pages(data)
            resident = resident_fraction(data)
            return timed(lambda: [tier.get(k) for k, _ in blocks]), resident
    if side == "lmdb":
        env = lmdb_open_like(raw_dir, map_size)
        try:
            drop_pages(data)
            resident = resident_fraction(data)
            return timed(lambda: [lmdb_get(env, k) for k, _ in blocks]), resident
        finally:
            env.close()
    workers = DIRECT_WORKERS if side == "direct4" else 1
    read = {"direct1_owned": lambda r, span: bytes(r.read(*span)),
            "direct_fresh": lambda r, span: r.read_fresh(*span)}.get(side, lambda r, span: r.read(*span))
    with DirectReader(data, max(a.nbytes for _, a in blocks), workers=workers) as reader:
        drop_pages(data)
        resident = resident_fraction(data)
        return timed(lambda: [read(reader, spans[k]) for k, _ in blocks]), resident


def bench_disk(blocks: list[Block], reps: int, tmp: Path, cold_reps: int) -> dict[str, Any]:
    from tiers.disk import DiskTier

    capacity = 4 * sum(a.nbytes for _, a in blocks)
    tier_dir, raw_dir = tmp / "tier-lmdb", tmp / "raw-lmdb"
    with DiskTier(tier_dir, capacity) as tier:
        map_size = tier.map_size
        spans = _write_raw(raw_dir, map_size, blocks)
        env = lmdb_open_like(raw_dir, map_size)
        try:
            warm = measure(tier, blocks, lambda k, _a: lmdb_get(env, k), reps)
        finally:
            env.close()
    cold_tier_dir = tmp / "cold-tier-lmdb"
    with DiskTier(cold_tier_dir, capacity) as tier:  # written once, in order, like the raw environment
        for k, a in blocks:
            tier.put(k, a.data)
    for workers in (1, DIRECT_WORKERS):  # both direct sides read exactly the stored bytes
        with DirectReader(raw_dir / "data.mdb", max(a.nbytes for _, a in blocks), workers=workers) as reader:
            for k, a in blocks:
                assert bytes(reader.read(*spans[k])) == a.tobytes(), "O_DIRECT baseline read the wrong bytes"
                assert bytes(reader.read_fresh(*spans[k])) == a.tobytes(), "O_DIRECT baseline read the wrong bytes"
    cold: dict[str, list[float]] = {s: [] for s in COLD_SIDES}
    resident: list[float] = []
    for rep in range(cold_reps):
        for j in range(len(COLD_SIDES)):
            side = COLD_SIDES[(rep + j) % len(COLD_SIDES)]
            secs, res = _cold_pass(side, cold_tier_dir, raw_dir, blocks, capacity, map_size, spans)
            cold[side].append(secs)
            resident.append(res)
    n = warm.nbytes
    _, direct = fig.best_baseline({"direct1": cold["direct1"], "direct4": cold["direct4"]})
    _, direct_owned = fig.best_baseline({s: cold[s] for s in ("direct1_owned", "direct_fresh")})
    best, base = fig.best_baseline({s: cold[s] for s in OWNED_BASELINES})
    _, view_base = fig.best_baseline({s: cold[s] for s in ("lmdb", "direct1", "direct4")})
    out = warm.figures()
    out.update({
        "cold_gbps": round(fig.gbps(n, cold["tier"]), 3),
        "cold_baseline_gbps": round(fig.gbps(n, base), 3),
        "cold_baseline_best": best,
        "cold_direct_gbps": round(fig.gbps(n, direct), 3),
        "cold_direct1_gbps": round(fig.gbps(n, cold["direct1"]), 3),
        "cold_direct4_gbps": round(fig.gbps(n, cold["direct4"]), 3),
        "cold_direct1_owned_gbps": round(fig.gbps(n, cold["direct1_owned"]), 3),
        "cold_direct_fresh_gbps": round(fig.gbps(n, cold["direct_fresh"]), 3),
        "cold_lmdb_gbps": round(fig.gbps(n, cold["lmdb"]), 3),
        "cold_ratio": round(fig.ratio_of_medians(cold["tier"], base), 3),
        "cold_paired_ratio": round(fig.paired_ratio(cold["tier"], base), 3),
        "cold_view_ratio": round(fig.ratio_of_medians(cold["tier"], view_base), 3),
        "cold_direct_ratio": round(fig.ratio_of_medians(cold["tier"], direct), 3),
        "cold_direct_owned_ratio": round(fig.ratio_of_medians(cold["tier"], direct_owned), 3),
        "cold_lmdb_ratio": round(fig.ratio_of_medians(cold["tier"], cold["lmdb"]), 3),
        "cold_reps": cold_reps,
        "resident_after_drop_max": round(max(resident), 4),
        "cold_verified": fig.cold_verified(cold["tier"], warm.get_s, resident),
        "baseline": "raw lmdb txn.get on an environment opened with DiskTier's flags, same blocks (warm)",
        "cold_baseline": "fastest of the reads that hand back memory the caller owns, as get does: raw lmdb "
                         "txn.get (buffered), O_DIRECT reads of the same value ranges of data.mdb into a reused "
                         "buffer then copied out, and O_DIRECT reads into a fresh buffer per block; tier and "
                         "baseline files written once, in the same order (cold_view_ratio: against reads left in "
                         "a reused buffer, 1 request per block or 256 KiB pieces 4 in flight)",
        "page_cache": "warm: both files cached; cold: pages dropped (posix_fadvise DONTNEED) before each pass",
    })
    return out
