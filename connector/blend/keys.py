"""Chunk keys: blake2b over model fingerprint, tenant salt, chunk kind and token ids (uint32 LE),
tagged with the tenant like the page keys (kvstore/keys.py): a request of a tenant (its scope,
engine/tenancy.py) is tagged with the tenant's name and its salt enters only the hash; a legacy
salt is the tenant, tag and hash alike.

Identical in every process and after every restart (never Python ``hash()``, which is salted
per process). Kept free of torch so any process can compute keys cheaply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from engine.tenancy import split_salt
from kvstore.keys import key_prefix

_PERSON = b"tierkv-chunk-v1"
_PERSON_TENANT = b"tierkv-chunk-t1"  # a tenant's chunks: a hash no legacy salt can produce


def chunk_key(fingerprint: str, ids: Sequence[int], kind: str = "doc", tenant_salt: str = "") -> bytes:
    """Key of a chunk's KV: a 16-byte hash of model fingerprint + tenant salt + kind + token ids,
    after the tenant's tag when salted (kvstore/keys.py's tagged format: the daemon charges the
    chunk to that tenant; the hash is what isolates it)."""
    tenant, salt = split_salt(tenant_salt)
    h = hashlib.blake2b(digest_size=16, person=_PERSON_TENANT if tenant else _PERSON)
    for part in (fingerprint, *((tenant,) if tenant else ()), salt, kind):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    h.update(np.asarray(list(ids), dtype="<u4").tobytes())
    return key_prefix(tenant, salt) + h.digest()
