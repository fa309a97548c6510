"""A keyed MAC on every value kept in a shared tier (Redis, S3): proof that a daemon of this cluster
wrote it.

Why: a block's own checksum (kvstore/block.py) is unkeyed, so anyone who can write to Redis or S3
can store a well-formed block under any key, and engines would load that KV. Values a daemon
writes to a shared tier therefore end in a trailer carrying a keyed MAC under a secret that only
the daemons of one cluster hold; a value whose trailer does not verify is refused.

Trailer (``TRAILER_BYTES`` = 44, after the stored block)::

    magic "TKM1" | secret id (8 bytes) | tag (32 bytes)

- ``tag`` = HMAC-SHA256 over ``secret id | len(key) as u16 | key | block``: the key is covered,
  so a valid value moved under another key fails; the whole stored block is covered. HMAC-SHA256
  rather than keyed BLAKE2b because it measured faster here (OpenSSL's SHA-256 uses the CPU's SHA
  instructions; hashlib's BLAKE2b is portable C): ``python -m bench.tier_guards`` times both on
  4 MiB and 720 KiB blocks.
- ``secret id`` = an 8-byte BLAKE2b digest of the secret (one-way, and under another
  personalisation than the MAC key's derivation, so it says nothing about that key): it names the secret that signed, so a value signed with a
  previous secret costs one MAC, and a value signed with a secret this daemon does not hold
  (``unknown_secret``: a daemon of another cluster, or a rotation not finished everywhere) is told
  apart from a forged tag (``mac``).

Rotation: ``BlockMac(current, previous)`` signs with ``current`` and accepts any of them, so an
operator adds the new secret as a previous one on every daemon, then makes it current, then
drops the old one, without a moment where two daemons refuse each other's blocks
(docs/operations.md, "Shared tiers: signed blocks").
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

from tiers.base import Buffer

MAGIC = b"TKM1"
_TRAILER = struct.Struct("<4s8s32s")
TRAILER_BYTES = _TRAILER.size
#: shortest secret accepted (characters of the secret file, after stripping whitespace)
MIN_SECRET_CHARS = 32
#: the labels ``BlockMac.open`` gives a value it refuses
UNSIGNED, UNKNOWN_SECRET, BAD_TAG = "unsigned", "unknown_secret", "mac"


def _derive(secret: bytes, person: bytes, size: int) -> bytes:
    return hashlib.blake2b(secret, digest_size=size, person=person).digest()


class _Secret:
    __slots__ = ("ident", "key")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"a MAC secret needs at least {MIN_SECRET_CHARS} bytes, got {len(secret)}")
        self.key = _derive(secret, b"tierkv-mac-key", 32)
        self.ident = _derive(secret, b"tierkv-mac-id", 8)

    def tag(self, key: bytes, body: Buffer) -> bytes:
        h = hmac.new(self.key, digestmod=hashlib.sha256)  # OpenSSL's HMAC: releases the GIL on large updates
        h.update(self.ident)
        h.update(len(key).to_bytes(2, "little"))
        h.update(key)
        h.update(body)
        return h.digest()


class BlockMac:
    """Signs values with the current secret; verifies with the current or any previous one."""

    def __init__(self, current: bytes, previous: Sequence[bytes] = ()) -> None:
        self._current = _Secret(current)
        self._by_id = {s.ident: s for s in (_Secret(p) for p in previous)}
        self._by_id[self._current.ident] = self._current

    def __repr__(self) -> str:  # ids only: they are one-way, and tell an operator which secret is which
        return f"BlockMac(current={self._current.ident.hex()}, accepted={sorted(i.hex() for i in self._by_id)})"

    @property
    def current_id(self) -> str:
        return self._current.ident.hex()

    def trailer(self, key: bytes, body: Buffer) -> bytes:
        """What to append to ``body`` before storing it under ``key``."""
        return _TRAILER.pack(MAGIC, self._current.ident, self._current.tag(bytes(key), body))

    def seal(self, key: bytes, body: Buffer) -> bytes:
        """``body`` followed by its trailer: the value to store (one copy of ``body``)."""
        return b"".join((body, self.trailer(key, body)))

    def open(self, key: bytes, stored: Buffer) -> tuple[memoryview, str | None]:
        """(the block without its trailer, None) when the trailer verifies; otherwise (what the
        block would be, the reason: ``unsigned``, ``unknown_secret`` or ``mac``)."""
        mv = memoryview(stored).cast("B")
        end = mv.nbytes - TRAILER_BYTES
        if end < 0 or mv[end : end + len(MAGIC)] != MAGIC:
            return mv, UNSIGNED
        _, ident, tag = _TRAILER.unpack_from(mv, end)
        body = mv[:end]
        secret = self._by_id.get(ident)
        if secret is None:
            return body, UNKNOWN_SECRET
        if not hmac.compare_digest(tag, secret.tag(bytes(key), body)):
            return body, BAD_TAG
        return body, None
