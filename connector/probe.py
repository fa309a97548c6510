"""The start-up probe of the daemon's first tier: per-call latency and bandwidth of a load, as the
cost model's seed.

What it measures must be what a load pays, so (issue 23):
- distinct blocks, more bytes of them than the last-level cache holds (``llc_bytes``, from sysfs),
  each read once, oldest first: under LRU a block put earlier has been evicted by the ones put
  after it and by the reads before it, so no timed read finds its source in the cache. (The old
  probe timed 1 and 16 blocks of 720 KiB three times each: 11 MiB re-read, cache-hot.)
- one thread policy: every timed batch at least ``THREAD_MIN_BYTES``, so each runs on the copy
  threads a real multi-page load runs on (``native.default_threads()``), not 1 thread for one
  block against 2 for sixteen.
- several batch sizes and a least-squares line through the fastest run of each (``fit_line``):
  slope = seconds per byte, intercept = per-call overhead.
The set is bounded by ``max_bytes`` and by half the first tier's free room (the probe must not
push what the daemon holds down a tier); a set that cannot exceed the cache says so
(``ProbeResult.exceeds_llc``) and in the log. A daemon whose first tier is not in memory (disk,
S3) gets a small set (~20 MiB): its reads do not go through the CPU cache, and hundreds of MiB
written to lmdb or S3 at every start would cost seconds.
Cost: on the 2-core dev box (sysfs says a 480 MiB L3) ~600 MiB are put and read, several
seconds at start-up, most of it the puts (encoding and the daemon's first touch of its arena).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from connector.dtypes import to_block_array
from connector.loader import Loader
from connector.native import THREAD_MIN_BYTES
from connector.offload import LAYOUT
from engine.hooks import EngineView
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.keys import key_prefix

log = logging.getLogger(__name__)

SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
LLC_FALLBACK_BYTES = 32 * 2**20
LLC_MARGIN = 1.25  # the set is this many times the cache (oldest-first reads need only > 1)
MAX_PROBE_BYTES = 1 << 30
MAX_PROBE_BLOCKS = 4096  # small pages (a test model's): thousands of tiny loads would not be start-up
STEPS = 4  # batch sizes u, 2u, 3u, 4u
REPEATS = 2  # runs per size, each on blocks of its own
PUT_CHUNK_BYTES = 32 * 2**20


class ProbeError(RuntimeError):
    """No line can be fitted through the probe's timings."""


class ProbeResult(NamedTuple):
    tier: str
    latency_s: float  # the fit's intercept: per-call overhead
    bandwidth: float  # bytes/s: 1 / the fit's slope
    set_bytes: int  # distinct bytes put and read once each
    llc_bytes: int
    exceeds_llc: bool
    threads_policy: str
    points: tuple[tuple[int, float], ...]  # (bytes, fastest seconds) per batch size
    seconds: float  # what the probe cost at start-up, puts and deletes included


def parse_cache_size(text: str) -> int:
    """sysfs cache sizes: "48K", "2048K", "32M", "1G" or bare bytes."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit():
        raise ValueError(f"not a cache size: {text!r}")
    return int(digits) * mult


def llc_bytes(root: Path = SYSFS_CACHE, fallback: int = LLC_FALLBACK_BYTES) -> int:
    """Size of the highest-level data/unified cache of cpu0 (sysfs); ``fallback`` if none is readable."""
    best: tuple[int, int] | None = None
    for idx in sorted(root.glob("index*")):
        try:
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((idx / "level").read_text()), parse_cache_size((idx / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best and best[1] > 0 else fallback


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line seconds = intercept + slope * bytes, with the
    intercept held >= 0 (a negative per-call cost is noise: refit through the origin)."""
    if len({x for x, _ in points}) < 2:
        raise ProbeError(f"a line needs >= 2 distinct batch sizes, got {sorted({x for x, _ in points})}")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if (y <= 0).any():
        raise ProbeError("a timing is <= 0")
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:
        intercept, slope = 0.0, float((x @ y) / (x @ x))
    return float(intercept), float(slope)


def plan_batches(n_blocks: int, max_batch: int, min_batch: int, steps: int = STEPS,
                 repeats: int = REPEATS) -> list[tuple[int, int]]:
    """(first block, count) of each timed load: rounds of sizes u..steps*u (at least ``repeats``
    whole rounds, then until ``n_blocks`` are covered), the order reversed every other round;
    consecutive ranges, so no block is read twice. ``u`` is as large as ``n_blocks`` and
    ``max_batch`` allow, at least ``min_batch`` when they allow that. The plan may read up to one
    batch more than ``n_blocks``: put as many as it reads."""
    per_round = steps * (steps + 1) // 2  # blocks one round takes per unit of batch size
    unit = max(1, min(n_blocks // (repeats * per_round), max_batch // steps))
    if unit < min_batch:
        log.info("probe batches of %d..%d blocks: under the %d that run on the copy threads of a large load",
                 unit, unit * steps, min_batch)
    out, cursor, r = [], 0, 0
    while r < repeats or cursor < n_blocks:  # the last round may stop part way
        for k in (range(1, steps + 1) if r % 2 == 0 else range(steps, 0, -1)):
            if r >= repeats and cursor >= n_blocks:
                break
            out.append((cursor, unit * k))
            cursor += unit * k
        r += 1
    return out


def probe_set_bytes(llc: int, max_bytes: int, tier_free: int | None) -> int:
    """Bytes of distinct blocks to put: ``LLC_MARGIN`` x the cache, within ``max_bytes`` and half
    the first tier's free room."""
    want = int(llc * LLC_MARGIN)
    cap = max_bytes if tier_free is None else min(max_bytes, tier_free // 2)
    return max(1, min(want, cap))


def _first_tier(client: KVStoreClient) -> tuple[str, int | None]:
    """(name, free bytes) of the daemon's first tier; ("", None) where Stats is not answered."""
    try:
        tiers = client.stats().tiers
    except Exception:  # noqa: BLE001 - an older daemon or a credential without Stats: no bound
        return "", None
    return (tiers[0].name, max(0, tiers[0].capacity_bytes - tiers[0].used_bytes)) if tiers else ("", None)


def _alloc_scratch(view: EngineView, want: int) -> list[int]:
    n = want
    while n >= 1:
        pages = view.pages.alloc(n)
        if pages is not None:
            return pages
        n //= 2
    return []


def probe_daemon(client: KVStoreClient, loader: Loader, view: EngineView, n_blocks: int | None = None,
                 deadline_s: float = 5.0, tenant: str = "", llc: int | None = None,
                 max_bytes: int = MAX_PROBE_BYTES, clock: Callable[[], float] = time.perf_counter,
                 ) -> ProbeResult | None:  # fmt: skip
    """Latency and bandwidth of a load from the daemon's first tier (None: too few pages to time).
    ``n_blocks``: the set's size (None: from ``llc`` and the bounds above). ``tenant``: write the
    scratch blocks in that tenant's namespace (one the engine's credential lists; "" = untagged
    keys, which a tenant's credential may not write)."""
    t_start = clock()
    pool = view.pool
    page = pool.bytes_per_page
    llc = llc_bytes() if llc is None else llc
    if n_blocks is None:
        first, free = _first_tier(client)
        # a tier off the host's memory (disk, S3) is not read through the CPU's cache: a small set
        target = llc if first in ("", "cpu") else min(llc, LLC_FALLBACK_BYTES) // 2
        n_blocks = min(MAX_PROBE_BLOCKS, max(1, -(-probe_set_bytes(target, max_bytes, free) // page)))
    per_unit = REPEATS * STEPS * (STEPS + 1) // 2  # blocks the fewest rounds read per unit of batch size
    n_blocks = max(n_blocks, per_unit)
    rng = np.random.default_rng()
    prefix = key_prefix(tenant) if tenant else b"tierkv-probe-"
    salt = rng.bytes(12 if tenant else 4)  # a tenant's key is its prefix + 16 bytes

    def key(i: int) -> bytes:
        return prefix + salt + i.to_bytes(4, "little")

    arr, dtype = to_block_array(torch.zeros(pool.block_shape(), dtype=pool.dtype))
    raw = arr.view(np.uint8).reshape(-1)
    raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
    client.deadline_s = deadline_s
    per_put = max(1, PUT_CHUNK_BYTES // page)
    scratch = _alloc_scratch(view, max(2, n_blocks * STEPS // per_unit))  # the largest batch's pages
    if len(scratch) < 2:
        if scratch:
            view.pages.free(scratch)
        return None
    plan = plan_batches(n_blocks, len(scratch), -(-THREAD_MIN_BYTES // page))
    n_blocks = plan[-1][0] + plan[-1][1]  # whole rounds: every block put is read, once
    keys = [key(i) for i in range(n_blocks)]
    try:
        for s in range(0, n_blocks, per_put):
            batch = []
            for i in range(s, min(s + per_put, n_blocks)):
                raw[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # every block's bytes differ
                batch.append((keys[i], encode_block(keys[i], arr, dtype=dtype, shape=arr.shape, layout=LAYOUT)))
            client.put_many(batch)
        tier, best = "cpu", {}
        for first, count in plan:
            batch_keys = keys[first : first + count]
            found = loader.lookup_all(batch_keys, deadline_s, in_place=True)  # as the connector's loads go
            tiers = found.tiers[: found.prefix_len]
            tier = tiers[0] if tiers and tiers[0] else tier
            res = loader.load(batch_keys, scratch[:count], deadline_s, in_place=found.in_place)
            if res.pages_ok != count:
                log.warning("daemon probe: %d of %d blocks loaded (%s)", res.pages_ok, count, res.failure)
                return None
            nbytes = count * page
            best[nbytes] = min(best.get(nbytes, math.inf), res.seconds)
        points = tuple(sorted(best.items()))
        lat, slope = fit_line(points)
    finally:
        view.pages.free(scratch)
        try:
            client.delete(keys)
        except Exception:  # noqa: BLE001 - best effort
            pass
    set_bytes = n_blocks * page
    policy = "native.default_threads()" if plan[0][1] * page >= THREAD_MIN_BYTES else "mixed (batches under 4 MiB)"
    out = ProbeResult(tier, lat, 1.0 / slope, set_bytes, llc, set_bytes > llc, policy, points, clock() - t_start)
    log.info("daemon probe: tier %s latency %.2f ms bandwidth %.2f GB/s over %d MiB of distinct blocks "
             "(last-level cache %d MiB%s) in %.2fs", tier, lat * 1e3, out.bandwidth / 1e9, set_bytes >> 20,
             llc >> 20, "" if out.exceeds_llc else ": NOT exceeded, reads may hit the cache", out.seconds)
    return out
