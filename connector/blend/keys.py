"""Chunk keys: blake2b over model fingerprint, tenant salt, chunk kind and token ids (uint32 LE).

Identical in every process and after every restart (never Python ``hash()``, which is salted
per process). Kept free of torch so any process can compute keys cheaply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_PERSON = b"tierkv-chunk-v1"


def chunk_key(fingerprint: str, ids: Sequence[int], kind: str = "doc", tenant_salt: str = "") -> bytes:
    """16-byte key of a chunk's KV: model fingerprint + tenant salt + kind + token ids."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (fingerprint, tenant_salt or "", kind):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    h.update(np.asarray(list(ids), dtype="<u4").tobytes())
    return h.digest()
