"""How the daemon's statistics look: ``kvstore stats``'s table and JSON, and the daemon's log line.

The JSON keys are a stable interface (scripts and alerting read them): add keys, never rename.
``hit_ratio`` is a tier's hits / (hits + misses) since start, ``null`` before its first lookup.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvstore.config.sizes import format_size
from kvstore.store.results import StoreStats, TierStats

JSON_VERSION = 1
TIER_KEYS = ("name", "used_bytes", "capacity_bytes", "blocks", "hits", "misses", "hit_ratio", "evictions",
             "spills", "promotions", "dropped", "errors", "read_bytes", "write_bytes", "available", "last_error",
             "refused", "detaches", "attaches", "skipped_writes", "quota_spills", "replayed", "replay_dropped",
             "replay_skipped", "replay_parked")
TENANT_KEYS = ("tier", "tenant", "used_bytes", "blocks", "quota_spills")
TABLE_TENANTS = 10  # tenants the table shows per tier (the JSON has every one the daemon sent)


def hit_ratio(t: TierStats) -> float | None:
    lookups = t.hits + t.misses
    return t.hits / lookups if lookups else None


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def table(st: StoreStats) -> str:
    cols = ("tier", "used", "capacity", "blocks", "hits", "misses", "hit%", "evict", "spills", "promo", "dropped",
            "errors", "refused", "state", "detach", "attach", "skipped", "replayed")
    rows = [
        (t.name, format_size(t.used_bytes), format_size(t.capacity_bytes), t.blocks, t.hits, t.misses,
         _pct(hit_ratio(t)), t.evictions, t.spills, t.promotions, t.dropped, t.errors, t.refused,
         "attached" if t.available else "DETACHED", t.detaches, t.attaches, t.skipped_writes,
         t.replayed)
        for t in st.tiers
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)) for row in (cols, *rows)]
    lines.append(f"spill queue: {st.pending_blocks} blocks, {format_size(st.pending_bytes)}")
    if st.parked_blocks:
        lines.append(f"parked for a replay: {st.parked_blocks} blocks, {format_size(st.parked_bytes)}")
    lines += [f"{t.name} last error: {t.last_error}" for t in st.tiers if t.last_error]
    lines += tenant_table(st)
    return "\n".join(lines)


def tenant_table(st: StoreStats) -> list[str]:
    """Per tier, its largest tenants (kvstore/store/tenants.py names them); nothing when no tier holds any."""
    if not st.tenants:
        return []
    cols = ("tier", "tenant", "used", "blocks", "quota spills")
    rows: list[tuple[object, ...]] = []
    for tier in dict.fromkeys(t.tier for t in st.tenants):
        mine = [t for t in st.tenants if t.tier == tier]
        rows += [(t.tier, t.tenant, format_size(t.used_bytes), t.blocks, t.quota_spills) for t in mine[:TABLE_TENANTS]]
        if len(mine) > TABLE_TENANTS:
            rest = mine[TABLE_TENANTS:]
            rows.append((tier, f"({len(rest)} more)", format_size(sum(t.used_bytes for t in rest)),
                         sum(t.blocks for t in rest), sum(t.quota_spills for t in rest)))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    return ["tenants:"] + ["  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)) for row in (cols, *rows)]


def as_dict(st: StoreStats, address: str) -> dict[str, Any]:
    tiers = [{k: hit_ratio(t) if k == "hit_ratio" else getattr(t, k) for k in TIER_KEYS} for t in st.tiers]
    tenants = [{k: getattr(t, k) for k in TENANT_KEYS} for t in st.tenants]
    return {"version": JSON_VERSION, "address": address, "time": round(time.time(), 3), "tiers": tiers,
            "pending_blocks": st.pending_blocks, "pending_bytes": st.pending_bytes,
            "parked_blocks": st.parked_blocks, "parked_bytes": st.parked_bytes, "tenants": tenants}


def as_json(st: StoreStats, address: str) -> str:
    return json.dumps(as_dict(st, address), sort_keys=True)


def summary_line(st: StoreStats) -> str:
    """One line for the daemon's log: per tier used/capacity, hit ratio, spills, errors; the spill queue."""
    parts = [f"{t.name} {format_size(t.used_bytes)}/{format_size(t.capacity_bytes)} hit {_pct(hit_ratio(t))} "
             f"spills {t.spills} errors {t.errors}{'' if t.available else ' DETACHED'}" for t in st.tiers]
    return f"stats: {' | '.join(parts)} | queue {st.pending_blocks} blocks"
