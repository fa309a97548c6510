"""SignedTier: a shared tier (Redis, S3) whose every value carries the cluster's keyed MAC.

Why a wrapper: the store reads a tier in several places (a Get, the shared-tier fallback, a
victim moved down by the spiller, the top tier when a shared tier is the only one); checking the
MAC inside ``get`` covers every one of them, for both tiers, in one place. The store above sees
a plain tier whose values are blocks and whose refused values are misses.

- ``put`` stores the block followed by its trailer (tiers/mac.py: HMAC-SHA256 over the key and
  the block, under the current secret).
- ``get`` returns the block only when its trailer verifies under the current or a previous
  secret. Otherwise the value is a miss, is deleted from the tier (it is no use to any node, and
  left there it would keep answering lookups, so the block would never be written again) and is
  reported to ``on_reject(tier, reason)`` (the daemon's ``tierkv_tier_corrupt_blocks_total``):
  ``checksum``/``format``/``key`` when the block itself is damaged (kvstore.block.block_fault:
  corrupted at rest or in flight), else ``unsigned`` (no trailer: written by something that is
  not a daemon, or by one from before signing), ``unknown_secret`` (signed with a secret this
  daemon does not hold) or ``mac`` (a forged or damaged tag).
- The MAC is the one verification of a value read here: it covers the key and every byte of the
  block, and a daemon signs only blocks it verified (validated on their way in, or checked with
  ``block_fault`` when read from another tier before they move down), so ``verifies_reads`` tells
  the store not to run ``block_fault`` over the same bytes again (kvstore/store/shared_state.py
  ``StoreState.intact``). A refused value is a miss the store handles as a lost one: it drops the
  key from its index, so a re-put of it is stored (not ALREADY_PRESENT), Redis or S3 on top too.
- A value longer than the largest block plus its trailer is refused without being read whole (the
  tier's ``max_value_bytes``: StoredValueTooLarge), reported as ``size`` and left in place: its
  writer may be a daemon allowed larger blocks, and a re-put of the key overwrites it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from kvstore.block import block_fault
from tiers.base import Buffer, Tier
from tiers.errors import StoredValueTooLarge
from tiers.mac import TRAILER_BYTES, BlockMac

log = logging.getLogger(__name__)
OVERSIZED = "size"
Reject = Callable[[str, str], None]  # (tier name, reason)


class SignedTier(Tier):
    verifies_reads = True  # the MAC: the store does not check these reads again

    def __init__(self, inner: Tier, mac: BlockMac, on_reject: Reject | None = None) -> None:
        super().__init__(inner.capacity_bytes - TRAILER_BYTES)  # a block and its trailer fit the inner tier
        self.inner, self.mac = inner, mac
        self.name, self.persistent = inner.name, inner.persistent
        self._on_reject = on_reject or (lambda tier, reason: None)

    def __repr__(self) -> str:
        return f"SignedTier({self.inner!r}, {self.mac!r})"

    def put(self, key: bytes, value: Buffer) -> None:
        body = value if isinstance(value, bytes | bytearray) else memoryview(value).cast("B")
        self.inner.put(key, self.mac.seal(key, body))

    def get(self, key: bytes) -> bytes | memoryview | None:
        try:
            stored = self.inner.get(key)
        except StoredValueTooLarge as e:
            log.warning("tier %s: %s", self.name, e)
            self._on_reject(self.name, OVERSIZED)
            return None
        if stored is None:
            return None
        body, fault = self.mac.open(key, stored)
        if fault is None:
            return body
        reason = block_fault(body, key) or fault  # damaged, or well formed and not ours
        log.warning("tier %s: block %s refused (%s): deleted", self.name, key.hex()[:16], reason)
        self._on_reject(self.name, reason)
        self.inner.delete(key)
        return None

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains_many(keys)

    def scan(self) -> Iterator[tuple[bytes, int]]:
        for key, size in self.inner.scan():
            yield key, max(0, size - TRAILER_BYTES)

    def probe(self) -> None:
        self.inner.probe()

    def close(self) -> None:
        self.inner.close()
