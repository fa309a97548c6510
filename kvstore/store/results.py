"""Plain result types of the TieredStore: lookups, and the stats of its tiers and tenants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class InPlace(NamedTuple):
    """Where a lookup's leading keys lie in the daemon's cpu arena (``arena_token`` names it):
    per key (offset, length) in the arena's file, None where the key is not in it. Not pinned:
    a reader that copies from there verifies what it copied, and asks with a Get where that fails."""

    arena_token: bytes
    spans: list[tuple[int, int] | None]


class LookupResult(NamedTuple):
    prefix_len: int  # how many leading keys are present, contiguously
    tiers: list[str | None]  # tier name holding each key (fastest first), None = absent
    evicted_from: Sequence[str | None] = ()  # per key: an absent key's tier that evicted it lately, else None
    in_place: InPlace | None = None  # asked for (lookup in_place=True) and the daemon has a shared arena


class TierStats(NamedTuple):
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    available: bool  # attached (False: detached by its circuit breaker, probed in the background)
    last_error: str
    hits: int
    misses: int
    evictions: int
    spills: int
    promotions: int
    dropped: int
    errors: int
    read_bytes: int
    write_bytes: int
    detaches: int  # times the circuit breaker detached the tier (kvstore/store/breaker.py)
    attaches: int  # times a probe attached it again
    skipped_writes: int  # blocks not written to it while detached
    refused: int  # writes it refused for lack of room (TierFull)
    quota_spills: int = 0  # blocks moved below the top tier because their tenant was at its quota


class TenantStats(NamedTuple):
    """One tenant's share of one tier (kvstore/store/tenants.py names tenants)."""

    tier: str
    tenant: str  # "default", "shared", a 12-hex-digit tag, or "_other" (the rest, summed)
    used_bytes: int
    blocks: int
    quota_spills: int  # its blocks moved below the top tier at its quota


class StoreStats(NamedTuple):
    tiers: list[TierStats]
    pending_blocks: int  # spills / write-through copies queued or landing (0 = flushed)
    pending_bytes: int
    tenants: Sequence[TenantStats] = ()  # per tier, the largest tenants first
