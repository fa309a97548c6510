"""Chunk keys: blake2b over model fingerprint, tenant salt, chunk kind and token ids (uint32 LE),
tagged with the tenant like the page keys (kvstore/keys.py).

Identical in every process and after every restart (never Python ``hash()``, which is salted
per process). Kept free of torch so any process can compute keys cheaply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.keys import TENANT_MAGIC, tenant_tag

_PERSON = b"tierkv-chunk-v1"


def chunk_key(fingerprint: str, ids: Sequence[int], kind: str = "doc", tenant_salt: str = "") -> bytes:
    """Key of a chunk's KV: a 16-byte hash of model fingerprint + tenant salt + kind + token ids,
    after the tenant's tag when salted (kvstore/keys.py's tagged format: the daemon charges the
    chunk to that tenant; the hash is what isolates it)."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (fingerprint, tenant_salt or "", kind):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    h.update(np.asarray(list(ids), dtype="<u4").tobytes())
    return (TENANT_MAGIC + tenant_tag(tenant_salt) if tenant_salt else b"") + h.digest()
