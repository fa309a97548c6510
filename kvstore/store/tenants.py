"""Which tenant a block belongs to, and how many bytes each tenant holds in one level.

The tenant of a key is the tag it carries (kvstore/keys.py). With a credentials file the daemon
checks every key of every call against the caller's credential (kvstore/server/credentials.py,
which classifies keys with ``tenant_of`` here, so access and accounting agree by construction): a
tenant's credential touches only keys tagged with its tenants' names, so its bytes are charged to
its own tenants and the optional per-tenant quota of the top tier holds per tenant whatever salts
its requests use. Without one (a single admin token, the legacy mode) the tag comes from the
request's salt and is for accounting only: tenants are then isolated by the hash alone (the salt
is in every key's digest), and a new salt is a new tenant to the quota.

Because the tag is part of the key, it is known wherever the key is: after a restart (the disk
tier's index is rebuilt from its keys), and in the shared tiers (Redis keys and S3 object names
start with it, so an operator can find or delete one tenant's blocks by prefix).

Names: ``default`` (16-byte keys: no salt, or an opaque key), ``shared`` (the operator-declared
shared namespace), else the tag as 12 hex digits (``tenant_name(tenant_tag(name or salt))``; the
Stats RPC and /metrics show a configured tenant's name instead, through the daemon's credentials:
``Access.display``). Not thread-safe: the store holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import NamedTuple

from kvstore.keys import SHARED_MAGIC, TAG_BYTES, TAGGED_KEY_BYTES, TENANT_MAGIC, tenant_tag

DEFAULT = "default"
SHARED = "shared"
OTHER = "_other"  # the rows past a listing's limit, summed (bounded label cardinality)
SPILL_COUNTS = 1024  # tenants whose quota spills are remembered (the most recently counted)


def tenant_name(tag: bytes) -> str:
    return tag.hex()


def name_of_salt(tenant_salt: str) -> str:
    """The name the daemon shows for a request's ``cache_salt`` ("" = the default namespace), legacy mode."""
    return tenant_name(tenant_tag(tenant_salt)) if tenant_salt else DEFAULT


def name_of_tenant(tenant: str) -> str:
    """The name ``tenant_of`` gives the keys of a credential's tenant (``default``: untagged keys)."""
    return DEFAULT if tenant == DEFAULT else tenant_name(tenant_tag(tenant))


def tenant_of(key: bytes) -> str:
    """The tenant a key is charged to (see the module notes)."""
    if len(key) == TAGGED_KEY_BYTES:
        magic = key[:2]
        if magic == TENANT_MAGIC:
            return tenant_name(key[2 : 2 + TAG_BYTES])
        if magic == SHARED_MAGIC:
            return SHARED
    return DEFAULT


class TenantRow(NamedTuple):
    tenant: str
    used_bytes: int
    blocks: int
    quota_spills: int  # blocks of this tenant moved below the top tier at its quota (top tier only)


class TenantUsage:
    """Bytes and blocks per tenant in one level; with ``ordered``, each tenant's keys oldest first
    (least recently used), which the top tier's quota needs to spill a tenant's own oldest blocks."""

    def __init__(self, ordered: bool = False) -> None:
        self._rows: dict[str, list[int]] = {}  # tenant -> [bytes, blocks]
        self._order: dict[str, OrderedDict[bytes, int]] | None = {} if ordered else None
        self._spills: OrderedDict[str, int] = OrderedDict()  # bounded: SPILL_COUNTS tenants

    def add(self, key: bytes, size: int) -> None:
        t = tenant_of(key)
        row = self._rows.setdefault(t, [0, 0])
        row[0] += size
        row[1] += 1
        if self._order is not None:
            self._order.setdefault(t, OrderedDict())[key] = size

    def remove(self, key: bytes, size: int) -> None:
        t = tenant_of(key)
        row = self._rows.get(t)
        if row is None:
            return
        row[0] -= size
        row[1] -= 1
        if row[1] <= 0:  # a tenant with nothing here is forgotten: memory bounded by the blocks held
            del self._rows[t]
        if self._order is not None and (keys := self._order.get(t)) is not None:
            keys.pop(key, None)
            if not keys:
                del self._order[t]

    def touch(self, key: bytes) -> None:
        if self._order is not None and (keys := self._order.get(tenant_of(key))) is not None and key in keys:
            keys.move_to_end(key)

    def used(self, tenant: str) -> int:
        row = self._rows.get(tenant)
        return row[0] if row else 0

    def oldest(self, tenant: str) -> Iterator[tuple[bytes, int]]:
        """The tenant's keys, least recently used first (an ``ordered`` usage only). Lazy, no copy:
        take what you need, and add, remove or touch nothing while iterating."""
        if self._order is None:
            raise RuntimeError("this level does not order its tenants' keys")
        return iter(self._order.get(tenant, {}).items())

    def quota_spilled(self, tenant: str) -> None:
        self._spills[tenant] = self._spills.pop(tenant, 0) + 1
        if len(self._spills) > SPILL_COUNTS:
            self._spills.popitem(last=False)

    def rows(self, limit: int) -> list[TenantRow]:
        """Tenants by bytes held, largest first (then tenants that only have quota spills); past
        ``limit`` rows the rest are summed as ``_other``."""
        names = list(self._rows) + [t for t in self._spills if t not in self._rows]
        rows = sorted((TenantRow(t, *self._rows.get(t, (0, 0)), self._spills.get(t, 0)) for t in names),
                      key=lambda r: (-r.used_bytes, -r.quota_spills, r.tenant))
        if len(rows) <= limit:
            return rows
        head, tail = rows[: max(limit - 1, 0)], rows[max(limit - 1, 0):]
        return head + [TenantRow(OTHER, sum(r.used_bytes for r in tail), sum(r.blocks for r in tail),
                                 sum(r.quota_spills for r in tail))]

    def rows_of(self, tenants: Collection[str]) -> list[TenantRow]:
        """The rows of ``tenants`` only (``tenant_of`` names), largest first, never summed with
        anyone else's: what one tenant's credential may see of this level."""
        names = [t for t in tenants if t in self._rows or t in self._spills]
        return sorted((TenantRow(t, *self._rows.get(t, (0, 0)), self._spills.get(t, 0)) for t in names),
                      key=lambda r: (-r.used_bytes, -r.quota_spills, r.tenant))

    def __len__(self) -> int:
        """Tenants holding blocks here."""
        return len(self._rows)
