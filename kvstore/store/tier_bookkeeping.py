"""One level of the TieredStore chain: a tier plus the store's bookkeeping for it.

The tier is a dumb byte store; the level owns what the store knows about it: the index
(key -> size), the bytes it counts as used, the eviction policy, counters, and its circuit
breaker (kvstore/store/breaker.py): after a few consecutive errors, or too many of its recent
calls failing, the tier is detached and skipped until a background probe finds it answering, so
a dead Redis costs a few timeouts, not one per request. A shared or write-through level remembers
the keys whose writes it skipped meanwhile (its ``backlog``, kvstore/store/replay.py), replayed
once it is attached again. Not thread-safe: the store holds its lock.

Ownership: a private level (cpu, disk, or a remote tier with ``shared=False``) belongs to this
store alone: its index is rebuilt from ``scan()`` at start and trimmed to the capacity, and
eviction deletes. A shared level (Redis, S3 used by several nodes) is never scanned or trimmed:
its index, used bytes and capacity cover only the blocks this store wrote since it started, and
evicting one of them only stops tracking it. The shared server enforces the real budget (Redis
``maxmemory`` + an eviction policy, a key TTL, an S3 lifecycle rule), so one node restarting
with a small capacity never deletes blocks other nodes wrote.

Tenants (kvstore/store/tenants.py): the level counts bytes and blocks per tenant tag as keys come and go.
With a ``quota`` (the top level only) a tenant holds at most that many bytes here: a put of a
tenant at its quota marks that tenant's own least recently used blocks as victims
(``quota_victims``), so one tenant's flood spills its own blocks, never another tenant's.

Fair share (``LevelOptions.fair_share``, opt-in; the daemon sets it on the top level with
``tenant_fair_share``): without a quota, when the level is full the victim comes first from the
tenant holding the most bytes here above its fair share (capacity / tenants holding blocks here),
its own least recently used block; only when no tenant is above its share does the eviction
policy choose. So one heavy tenant's flood evicts its own blocks once it holds more than its
share, and a light tenant's working set (under its share) stays. The share adapts as tenants come
and go; an idle tenant's blocks count until they leave, and the policy still evicts them when
every tenant is within its share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.store.breaker import Breaker
from kvstore.store.eviction import EvictionPolicy, make_eviction_policy
from kvstore.store.replay import MAX_KEYS, Backlog
from kvstore.store.results import TierCounters
from kvstore.store.tenants import TenantUsage, tenant_of
from tiers.base import Tier
from tiers.errors import TierFull, TierUnavailable

log = logging.getLogger(__name__)

KEEP_TURNS = 256  # unreplicated candidates passed over per pick_victims call, at most (then evicted anyway)


@dataclass(frozen=True)
class LevelOptions:
    eviction: str = "lru"  # name of the eviction policy (kvstore/store/eviction.py)
    write_through: bool = False  # copy every put here at once (shared remote tiers)
    admit_min_hits: int = 0  # spill here only blocks hit >= N times; others are dropped
    shared: bool = False  # other nodes use this tier: consult it on index misses; never scan/trim it
    fair_share: bool = False  # full: evict first from a tenant above capacity / tenants here (module notes)


@dataclass
class Level:
    tier: Tier
    options: LevelOptions
    breaker: Breaker = field(default_factory=Breaker)
    quota: int = 0  # bytes each tenant may hold here (0 = no quota; the top level only)
    backlog: Backlog = field(default_factory=lambda: Backlog(MAX_KEYS))  # skipped writes, replayed at attach
    index: dict[bytes, int] = field(default_factory=dict)
    used: int = 0
    counters: TierCounters = field(default_factory=TierCounters)
    leaving: set[bytes] = field(default_factory=set)  # victims being moved out
    leaving_bytes: int = 0
    last_error: str = ""
    eviction: EvictionPolicy = field(init=False)
    tenants: TenantUsage = field(init=False)
    # whether a block here is waiting in a lower level's replay backlog (its copy there was
    # skipped): evicted after every other candidate (``pick_victims``); set by the store
    unreplicated: Callable[[bytes], bool] | None = None

    def __post_init__(self) -> None:
        if self.quota < 0:
            raise ValueError(f"quota must be >= 0, got {self.quota}")
        self.eviction = make_eviction_policy(self.options.eviction, self.tier.capacity_bytes)
        self.tenants = TenantUsage(ordered=self.quota > 0 or self.options.fair_share)

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def capacity(self) -> int:
        return self.tier.capacity_bytes

    def available(self) -> bool:
        """Attached: the store uses the tier. Detached: skipped until a probe finds it answering."""
        return self.breaker.attached

    def has(self, key: bytes) -> bool:
        return key in self.index and self.available()

    @property
    def replays(self) -> bool:
        """Whether writes skipped while detached are replayed: a tier other nodes read, or one
        meant to hold every put."""
        return self.options.shared or self.options.write_through

    def skipped(self, key: bytes) -> None:
        """A write of ``key`` meant for this detached tier was skipped: counted, and remembered."""
        self.counters.skipped_writes += 1
        self.remember(key)

    def remember(self, key: bytes) -> None:
        """Put ``key`` in the replay backlog (a tier that replays); the oldest dropped when full."""
        if self.replays:
            self.counters.replay_dropped += self.backlog.add(key)

    def fail(self, exc: BaseException) -> bool:
        """Count an error; True when it detached the tier. A TierFull is a refusal, not a failure."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TierFull):
            self.counters.refused += 1
            return False
        self.counters.errors += 1
        if not self.breaker.failed():
            return False
        self.counters.detaches += 1
        log.warning("tier %s detached after %s; probing it in the background: %s",
                    self.name, self.breaker.why, self.last_error)  # fmt: skip
        return True

    def succeeded(self) -> None:
        self.breaker.succeeded()

    def detach(self, exc: BaseException) -> None:
        """Detach at once (the tier could not be reached at start)."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.counters.errors += 1
        self.counters.detaches += 1
        self.breaker.detach()
        log.warning("tier %s unreachable at start: detached, probing it in the background: %s", self.name,
                    self.last_error)  # fmt: skip

    def probe_failed(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.breaker.probe_failed()

    def attach(self) -> None:
        self.breaker.attach()
        self.counters.attaches += 1
        log.warning("tier %s answers again: attached", self.name)

    def add(self, key: bytes, size: int) -> None:
        if key in self.index:
            self.remove(key)
        self.index[key] = size
        self.used += size
        self.eviction.on_insert(key, size)
        self.tenants.add(key, size)

    def remove(self, key: bytes) -> int | None:
        size = self.index.pop(key, None)
        if size is None:
            return None
        self.used -= size
        self.eviction.on_remove(key)
        self.tenants.remove(key, size)
        if key in self.leaving:
            self.leaving.discard(key)
            self.leaving_bytes -= size
        return size

    def touch(self, key: bytes) -> None:
        self.eviction.on_access(key)
        self.tenants.touch(key)

    def _mark_leaving(self, key: bytes, vsize: int) -> None:
        self.eviction.on_remove(key)
        self.leaving.add(key)
        self.leaving_bytes += vsize

    def pick_victims(self, size: int) -> list[tuple[bytes, int]]:
        """Mark victims as leaving until ``size`` more bytes fit. They stay readable meanwhile.

        A candidate the policy names that is ``unreplicated`` (a shared tier below skipped its
        copy while detached: evicted now, with that tier still detached, it may have nowhere to
        go, and the replay at the reattach would find nothing) is given another turn (an access)
        while other candidates remain, up to ``KEEP_TURNS`` per call: bench.cluster's partitioned
        node evicted every block it put while cut off before its link came back."""
        out: list[tuple[bytes, int]] = []
        fair = _FairShare(self) if self.options.fair_share else None
        turns = min(KEEP_TURNS, len(self.index)) if self.unreplicated is not None else 0
        while self.used - self.leaving_bytes + size > self.capacity:
            if fair is not None and (pick := fair.victim()) is not None:
                self._mark_leaving(*pick)
                fair.leaves(*pick)
                out.append(pick)
                continue
            key = self.eviction.victim()
            if key is None:
                break
            if turns > 0 and key in self.index and key not in self.leaving and self.unreplicated(key):  # type: ignore[misc]
                turns -= 1
                self.eviction.on_access(key)
                continue
            self.eviction.on_remove(key)
            vsize = self.index.get(key)
            if vsize is None or key in self.leaving:
                continue
            self._mark_leaving(key, vsize)
            out.append((key, vsize))
        return out

    def over_quota(self, key: bytes, size: int) -> bool:
        """Whether a block of ``size`` bytes under ``key`` is larger than its tenant's whole quota."""
        return 0 < self.quota < size

    def quota_victims(self, key: bytes, size: int) -> list[tuple[bytes, int]]:
        """Mark ``key``'s tenant's least recently used blocks as leaving until ``size`` more of its
        bytes fit in its quota (none without a quota). Other tenants' blocks are never picked."""
        if not self.quota:
            return []
        tenant = tenant_of(key)
        leaving = sum(self.index[k] for k in self.leaving if tenant_of(k) == tenant)
        excess = self.tenants.used(tenant) - leaving + size - self.quota
        out: list[tuple[bytes, int]] = []
        if excess <= 0:
            return out
        for vkey, vsize in self.tenants.oldest(tenant):  # marking leaving does not reorder it
            if vkey in self.leaving or vkey == key:
                continue
            self._mark_leaving(vkey, vsize)
            out.append((vkey, vsize))
            excess -= vsize
            if excess <= 0:
                break
        return out

    def start(self) -> None:
        """Probe the tier, then index what it holds. Unreachable: start detached (probed later);
        any other error (refused credentials, a missing bucket) raises: a misconfigured tier stops
        the daemon instead of being silently skipped."""
        try:
            self.tier.probe()
        except TierUnavailable as e:
            self.detach(e)
            return
        self.rebuild()

    def make_room(self, nbytes: int) -> list[tuple[bytes, int]]:
        """Mark victims worth ``nbytes`` as leaving, whatever the accounting says: the tier itself
        said it is full (e.g. a fragmented lmdb map)."""
        return self.pick_victims(self.capacity - self.used + self.leaving_bytes + nbytes)

    def rebuild(self) -> None:
        """Index a persistent private tier's contents from ``scan()`` (after a restart, even a SIGKILL)."""
        if not self.tier.persistent or self.options.shared:
            return
        try:
            for key, size in self.tier.scan():
                self.add(key, size)
            for key, _ in self.pick_victims(0):  # the configured size shrank since the last run
                self.remove(key)
                self.tier.delete(key)
                self.counters.evictions += 1
        except Exception as e:  # noqa: BLE001 - a tier that cannot start is skipped, and counted
            self.fail(e)
            return
        if self.index:
            log.info("tier %s: found %d blocks (%d bytes) from a previous run", self.name, len(self.index), self.used)


class _FairShare:
    """One ``pick_victims`` call's view of who holds more than a fair share of a level: each
    tenant's bytes not already leaving, against capacity / tenants holding blocks here."""

    def __init__(self, level: Level) -> None:
        self._lv = level
        rows = level.tenants.rows(max(len(level.tenants), 1))
        self._held = {r.tenant: r.used_bytes for r in rows if r.blocks > 0}
        for k in level.leaving:
            t = tenant_of(k)
            if t in self._held:
                self._held[t] -= level.index.get(k, 0)
        self._share = level.capacity // max(len(self._held), 1)

    def victim(self) -> tuple[bytes, int] | None:
        """The least recently used block (not leaving) of the tenant most above its share; None
        when no tenant is above it."""
        over = [(held, t) for t, held in self._held.items() if held > self._share]
        for _, tenant in sorted(over, reverse=True):
            for key, size in self._lv.tenants.oldest(tenant):
                if key not in self._lv.leaving:
                    return key, size
        return None

    def leaves(self, key: bytes, size: int) -> None:
        self._held[tenant_of(key)] -= size
