"""Plain result types of the TieredStore: lookups, and the stats of its tiers and tenants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


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


def _counter(doc: str) -> Any:
    return field(default=0, metadata={"doc": doc})


@dataclass
class TierCounters:
    """What the store counts per tier since start: the one declaration of these counters. A level
    keeps them (kvstore/store/tier_bookkeeping.py), TierStats carries them, /metrics exports each as
    ``tierkv_tier_<name>`` with its ``doc`` (kvstore/server/metrics.py); the Stats RPC's TierStats
    message (kvstore/proto/kvstore.proto) has a field of the same name for each."""

    hits: int = _counter("Reads served by this tier")
    misses: int = _counter("Reads that looked in this tier and did not find the block")
    evictions: int = _counter("Blocks pushed out of this tier")
    spills: int = _counter("Blocks written into this tier from the tier above")
    promotions: int = _counter("Blocks copied from this tier to the top tier on a hit")
    dropped: int = _counter("Blocks refused by admission or falling off the last tier")
    errors: int = _counter("Errors raised by this tier (consecutive ones detach it)")
    read_bytes: int = _counter("Bytes read from this tier")
    write_bytes: int = _counter("Bytes written to this tier")
    detaches: int = _counter("Times the circuit breaker detached this tier after consecutive errors")
    attaches: int = _counter("Times a background probe found this tier answering and attached it again")
    skipped_writes: int = _counter("Blocks not written to this tier because it was detached")
    refused: int = _counter("Writes this tier refused for lack of room (lmdb map full): victims evicted, or the "
                            "block went below")
    quota_spills: int = _counter("Blocks moved below the top tier (or kept out of it) because their tenant was at "
                                 "its quota")
    replayed: int = _counter("Blocks whose write to this tier was skipped while it was detached, written to it "
                             "after it was attached again (its replay backlog)")
    replay_dropped: int = _counter("Keys dropped from this tier's replay backlog, the oldest first, because it was "
                                   "full (replay_backlog_keys): those blocks are not replayed")
    replay_skipped: int = _counter("Keys of this tier's replay backlog not replayed: no level held the block any "
                                   "more (deleted or evicted meanwhile), or it failed verification")
    replay_parked: int = _counter("Blocks pushed out of the tier above while this tier was detached, with nowhere "
                                  "to land, kept in the daemon's memory for this tier's replay (replay_park_bytes)")


@dataclass(kw_only=True)
class TierStats(TierCounters):
    """One tier at one moment: its counters, and what it is and holds."""

    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    available: bool  # attached (False: detached by its circuit breaker, probed in the background)
    last_error: str


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
    spill_timeouts: int = 0  # blocks a call could not queue to spill in time (kvstore/store/spiller.py): not stored below
    parked_blocks: int = 0  # blocks kept in memory for a shared tier's replay (kvstore/store/parked.py)
    parked_bytes: int = 0
