"""Deterministic block keys for prefix caching, and the tenant tag some of them carry.

A key names the KV of one full page of tokens *given everything before it*: it chains the
parent page's key, so two prompts share keys exactly as long as they share a prefix. Keys must
be identical in every process and after every restart, so they are built from blake2b over a
canonical byte encoding (token ids as fixed-width little-endian uint32) and never from Python's
``hash()``, which is salted per process (PYTHONHASHSEED) — the bug that makes other caches
report zero hits.

The namespace folds in everything that changes the KV for the same tokens (model architecture
config, weights digest, KV dtype, page size) plus a tenant salt, so tenants and models never
share blocks by accident. The hash is what isolates tenants: a tenant's salt enters every key's
digest, in every tier.

Key format (what the daemon sees; it parses the tag for accounting only, kvstore/store/tenants.py):

- 16 bytes: ``hash`` — the default namespace (no salt), and any opaque key a client picks;
- 24 bytes: ``b"t\\x01" + tag + hash`` — a tenant's key: ``tag`` is 6 bytes of blake2b of the
  salt (a pseudonym: the salt itself never leaves the engine, and the tag alone does not reveal
  it), so the daemon can charge bytes to a tenant and an operator can find a tenant's blocks by
  prefix in Redis or S3;
- 24 bytes: ``b"s\\x01" + 6 zero bytes + hash`` — the operator-declared shared namespace
  (``Namespace.shared``): pages every tenant may reuse (a common system prompt). Its digest is
  built from a payload no tenant salt can produce, so no request reaches it by picking a salt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np

#: a block key: 16 bytes (default namespace) or 24 bytes (tagged, see the module notes)
BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16  # the hash part of every key (128 bits)
TAG_BYTES = 6
TAGGED_KEY_BYTES = 2 + TAG_BYTES + KEY_BYTES
TENANT_MAGIC = b"t\x01"  # version 1 of the tagged key format
SHARED_MAGIC = b"s\x01"
SHARED_TAG = bytes(TAG_BYTES)
_PERSON_NS = b"tierkv-ns-v1"
_PERSON_KEY = b"tierkv-blk-v1"
_PERSON_TAG = b"tierkv-tenant-v1"
_ROOT = bytes(KEY_BYTES)  # parent of the first page


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def tenant_tag(tenant_salt: str) -> bytes:
    """The 6-byte pseudonym of a tenant salt that its keys carry (``kvstore.store.tenants.tenant_name``
    prints it as 12 hex digits)."""
    return hashlib.blake2b(tenant_salt.encode(), digest_size=TAG_BYTES, person=_PERSON_TAG).digest()


@dataclass(frozen=True)
class Namespace:
    """Model fingerprint + tenant salt (or the shared namespace). ``digest`` enters every key,
    ``key_prefix`` starts every key (empty for the default namespace)."""

    arch: str  # canonical architecture config (see ``from_model``)
    weights_digest: str
    kv_dtype: str
    page_size: int
    tenant_salt: str = ""
    shared: bool = False  # the operator-declared namespace of prefixes shared by every tenant
    digest: bytes = field(init=False, repr=False, compare=False)
    key_prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.shared and self.tenant_salt:
            raise ValueError("the shared namespace has no tenant salt")
        # a tenant's payload ends in its salt (a string); the shared one in an object, which no
        # salt can spell: the shared digest is out of every request's reach
        scope: Any = {"shared": True} if self.shared else self.tenant_salt
        payload = _canonical_json([self.arch, self.weights_digest, self.kv_dtype, int(self.page_size), scope])
        d = hashlib.blake2b(payload, digest_size=KEY_BYTES, person=_PERSON_NS).digest()
        object.__setattr__(self, "digest", d)
        prefix = SHARED_MAGIC + SHARED_TAG if self.shared else (
            TENANT_MAGIC + tenant_tag(self.tenant_salt) if self.tenant_salt else b"")
        object.__setattr__(self, "key_prefix", prefix)

    @classmethod
    def from_model(
        cls,
        arch_config: Mapping[str, Any],
        weights_digest: str,
        kv_dtype: str,
        page_size: int,
        tenant_salt: str = "",
    ) -> Namespace:
        """Build from a model's config dict (e.g. HF ``config.to_dict()``), canonicalised."""
        return cls(_canonical_json(dict(arch_config)).decode(), weights_digest, kv_dtype, page_size, tenant_salt)

    def with_tenant(self, tenant_salt: str) -> Namespace:
        return Namespace(self.arch, self.weights_digest, self.kv_dtype, self.page_size, tenant_salt)

    def as_shared(self) -> Namespace:
        """The shared namespace of the same model (for operator-declared shared prefixes only)."""
        return Namespace(self.arch, self.weights_digest, self.kv_dtype, self.page_size, shared=True)


def _tokens_le_u32(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def block_key(namespace: Namespace, parent: bytes | None, token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    """Key of one page: prefix || H(namespace digest || parent key || len || tokens as LE uint32)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_KEY)
    h.update(namespace.digest)
    h.update(parent if parent is not None else _ROOT)
    tok = _tokens_le_u32(token_ids)
    h.update(len(tok).to_bytes(4, "little"))
    h.update(tok)
    return BlockKey(namespace.key_prefix + h.digest())


def chain_keys(
    namespace: Namespace, token_ids: Sequence[int] | np.ndarray, page_size: int | None = None,
    shared_pages: int = 0,
) -> list[BlockKey]:  # fmt: skip
    """Chained keys of every *full* page of ``token_ids`` (a trailing partial page has no key).

    ``shared_pages``: the first N pages lie inside an operator-declared shared prefix and are keyed
    in the shared namespace; the rest chain on under ``namespace`` (the tenant's)."""
    ps = namespace.page_size if page_size is None else page_size
    if ps != namespace.page_size:  # the namespace promises its page size to every reader
        raise ValueError(f"page_size {ps} differs from the namespace's {namespace.page_size}")
    if shared_pages < 0:
        raise ValueError(f"shared_pages must be >= 0, got {shared_pages}")
    shared = namespace.as_shared() if shared_pages else namespace
    arr = np.asarray(token_ids)
    keys: list[BlockKey] = []
    parent: bytes | None = None
    for i, start in enumerate(range(0, len(arr) - ps + 1, ps)):
        parent = block_key(shared if i < shared_pages else namespace, parent, arr[start : start + ps])
        keys.append(parent)
    return keys
