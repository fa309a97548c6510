"""Deterministic block keys for prefix caching.

A key names the KV of one full page of tokens *given everything before it*: it chains the
parent page's key, so two prompts share keys exactly as long as they share a prefix. Keys must
be identical in every process and after every restart, so they are built from blake2b over a
canonical byte encoding (token ids as fixed-width little-endian uint32) and never from Python's
``hash()``, which is salted per process (PYTHONHASHSEED) — the bug that makes other caches
report zero hits.

The namespace folds in everything that changes the KV for the same tokens (model architecture
config, weights digest, KV dtype, page size) plus a tenant salt, so tenants and models never
share blocks by accident.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np

#: a 16-byte (128-bit) block key
BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16
_PERSON_NS = b"tierkv-ns-v1"
_PERSON_KEY = b"tierkv-blk-v1"
_ROOT = bytes(KEY_BYTES)  # parent of the first page


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


@dataclass(frozen=True)
class Namespace:
    """Model fingerprint + tenant salt. ``digest`` is what enters every key."""

    arch: str  # canonical architecture config (see ``from_model``)
    weights_digest: str
    kv_dtype: str
    page_size: int
    tenant_salt: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        payload = _canonical_json(
            [self.arch, self.weights_digest, self.kv_dtype, int(self.page_size), self.tenant_salt]
        )
        d = hashlib.blake2b(payload, digest_size=KEY_BYTES, person=_PERSON_NS).digest()
        object.__setattr__(self, "digest", d)

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


def _tokens_le_u32(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def block_key(namespace: Namespace, parent: bytes | None, token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    """Key of one page: H(namespace digest || parent key || len || tokens as LE uint32)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_KEY)
    h.update(namespace.digest)
    h.update(parent if parent is not None else _ROOT)
    tok = _tokens_le_u32(token_ids)
    h.update(len(tok).to_bytes(4, "little"))
    h.update(tok)
    return BlockKey(h.digest())


def chain_keys(
    namespace: Namespace, token_ids: Sequence[int] | np.ndarray, page_size: int | None = None
) -> list[BlockKey]:
    """Chained keys of every *full* page of ``token_ids`` (a trailing partial page has no key)."""
    ps = namespace.page_size if page_size is None else page_size
    if ps != namespace.page_size:  # the namespace promises its page size to every reader
        raise ValueError(f"page_size {ps} differs from the namespace's {namespace.page_size}")
    arr = np.asarray(token_ids)
    keys: list[BlockKey] = []
    parent: bytes | None = None
    for start in range(0, len(arr) - ps + 1, ps):
        parent = block_key(namespace, parent, arr[start : start + ps])
        keys.append(parent)
    return keys
