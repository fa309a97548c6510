"""Deterministic block keys for prefix caching, and the tenant tag some of them carry.

A key names the KV of one full page of tokens *given everything before it*: it chains the
parent page's key, so two prompts share keys exactly as long as they share a prefix. Keys must
be identical in every process and after every restart, so they are built from blake2b over a
canonical byte encoding (token ids as fixed-width little-endian uint32) and never from Python's
``hash()``, which is salted per process (PYTHONHASHSEED) — the bug that makes other caches
report zero hits.

The namespace folds in everything that changes the KV for the same tokens (model architecture
config, weights digest, KV dtype, page size) plus the tenant and a salt, so tenants and models
never share blocks by accident.

Two ways to name a tenant:

- a *tenant* (``Namespace(..., tenant="acme", tenant_salt=salt)``, ``in_tenant``): the name of a
  tenant of the daemon's credentials (kvstore/server/credentials.py). The tag comes from the name,
  and the request's salt (``cache_salt``) enters only the digest: a sub-namespace inside the
  tenant. The daemon lets a credential touch only keys tagged with its own tenants, so a client
  cannot reach another tenant, and rotating salts cannot escape a tenant's quota. The tenant
  ``default`` keys untagged (16-byte) keys.
- legacy, no tenant (single-token deployments): the salt is the tenant; the tag comes from the
  salt, as before, so existing keys keep their meaning.

Key format (what the daemon sees: it reads the tag to check each key against the caller's
credential and to account per tenant, kvstore/store/tenants.py):

- 16 bytes: ``hash`` — the default namespace (no salt, or tenant ``default``), and any opaque key
  a client picks;
- 24 bytes: ``b"t\\x01" + tag + hash`` — a tenant's key: ``tag`` is 6 bytes of blake2b of the
  tenant's name (legacy: of its salt; a pseudonym either way: the tag alone does not reveal it), so
  the daemon can check and charge keys per tenant and an operator can find a tenant's blocks by
  prefix in Redis or S3;
- 24 bytes: ``b"s\\x01" + 6 zero bytes + hash`` — the operator-declared shared namespace
  (``Namespace.shared``): pages every tenant may reuse (a common system prompt). Its digest is
  built from a payload no tenant salt can produce, so no request reaches it by picking a salt.
"""

from __future__ import annotations

import hashlib
import json
import re
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
DEFAULT_TENANT = "default"  # the tenant of untagged (16-byte) keys
RESERVED_TENANTS = frozenset({"shared", "_other"})  # names the daemon's Stats use for other rows
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def tenant_tag(tenant: str) -> bytes:
    """The 6-byte pseudonym of a tenant's name (legacy: of a tenant salt) that its keys carry
    (``kvstore.store.tenants.tenant_name`` prints it as 12 hex digits)."""
    return hashlib.blake2b(tenant.encode(), digest_size=TAG_BYTES, person=_PERSON_TAG).digest()


def check_tenant_name(name: str, where: str = "tenant") -> str:
    """``name`` if it is a valid tenant name (1-64 of letters, digits, ``.``, ``_``, ``-``, starting
    with a letter or digit; not ``shared`` or ``_other``), else ValueError naming ``where``."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}: {name!r} is not a tenant name (1-64 letters, digits, '.', '_', '-', "
                         "starting with a letter or digit)")
    if name in RESERVED_TENANTS:
        raise ValueError(f"{where}: {name!r} is reserved (the daemon's Stats use it for other rows)")
    return name


@dataclass(frozen=True)
class Namespace:
    """Model fingerprint + tenant and salt (or the shared namespace). ``digest`` enters every key,
    ``key_prefix`` starts every key (empty for the default namespace)."""

    arch: str  # canonical architecture config (see ``from_model``)
    weights_digest: str
    kv_dtype: str
    page_size: int
    tenant_salt: str = ""  # the request's salt: digest only with a tenant; legacy (no tenant): also the tag
    shared: bool = False  # the operator-declared namespace of prefixes shared by every tenant
    tenant: str = ""  # a credential's tenant: the tag source ("" = legacy, see the module notes)
    digest: bytes = field(init=False, repr=False, compare=False)
    key_prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.shared and (self.tenant_salt or self.tenant):
            raise ValueError("the shared namespace has no tenant or salt")
        if self.tenant:
            check_tenant_name(self.tenant)
        # a legacy payload ends in its salt (a string); a tenant's and the shared one in an object,
        # which no salt can spell: neither is in reach of a request that picks a salt
        scope: Any = {"shared": True} if self.shared else (
            {"tenant": self.tenant, "salt": self.tenant_salt} if self.tenant else self.tenant_salt)
        payload = _canonical_json([self.arch, self.weights_digest, self.kv_dtype, int(self.page_size), scope])
        d = hashlib.blake2b(payload, digest_size=KEY_BYTES, person=_PERSON_NS).digest()
        object.__setattr__(self, "digest", d)
        object.__setattr__(self, "key_prefix", key_prefix(self.tenant, self.tenant_salt, self.shared))

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
        """Legacy (no tenant): the salt is the tenant, tag and digest alike."""
        return Namespace(self.arch, self.weights_digest, self.kv_dtype, self.page_size, tenant_salt)

    def in_tenant(self, tenant: str, salt: str = "") -> Namespace:
        """The namespace of ``tenant`` (tagged with its name), sub-divided by ``salt`` (digest only)."""
        return Namespace(self.arch, self.weights_digest, self.kv_dtype, self.page_size, salt, tenant=tenant)

    def as_shared(self) -> Namespace:
        """The shared namespace of the same model (for operator-declared shared prefixes only)."""
        return Namespace(self.arch, self.weights_digest, self.kv_dtype, self.page_size, shared=True)


def key_prefix(tenant: str, salt: str = "", shared: bool = False) -> bytes:
    """What every key of that namespace starts with (module notes): the shared tag, a tenant's tag
    (legacy: its salt's), or nothing (the default namespace)."""
    if shared:
        return SHARED_MAGIC + SHARED_TAG
    if tenant:
        return b"" if tenant == DEFAULT_TENANT else TENANT_MAGIC + tenant_tag(tenant)
    return TENANT_MAGIC + tenant_tag(salt) if salt else b""


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
