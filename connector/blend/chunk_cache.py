"""Position-independent chunk KV: keys, a byte-bounded store, and compute-once caching.

A document chunk's KV is computed standalone (BOS at position 0, the BOS entry dropped), so
it holds the document's tokens at positions 1..n whatever precedes it in a request; the
leading prefix (BOS + system prompt) is computed at positions 0..n-1 and is exact. Keys are
blake2b over the model fingerprint, the tenant salt, the chunk kind and the token ids as
little-endian uint32 — identical in every process, never Python ``hash()``.

``ChunkStore`` is the narrow storage interface (get/put of [L, 2, n, H, D] tensors).
``InProcessChunkStore`` is an LRU bounded in bytes; ``DaemonChunkStore`` (daemon_store.py) puts
the kvstore daemon behind the same interface, with an InProcessChunkStore in front.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from connector.blend.keys import chunk_key
from connector.blend.metrics import BlendMetrics

DOC = "doc"  # BOS at 0, then the document; BOS entry dropped (positions 1..n)
PREFIX = "prefix"  # a leading segment computed at positions 0..n-1 (exact as a prefix)


class ChunkStore(Protocol):
    def get(self, key: bytes) -> torch.Tensor | None: ...

    def put(self, key: bytes, kv: torch.Tensor) -> None: ...


class InProcessChunkStore:
    """Thread-safe LRU of chunk tensors bounded by total bytes (a chunk above capacity is not kept)."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity = capacity_bytes
        self._d: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            kv = self._d.get(key)
            if kv is not None:
                self._d.move_to_end(key)
            return kv

    def put(self, key: bytes, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            if size > self.capacity:
                return
            while self._bytes + size > self.capacity and self._d:
                _, ev = self._d.popitem(last=False)
                self._bytes -= ev.numel() * ev.element_size()
            self._d[key] = kv
            self._bytes += size


class ChunkCache:
    """Fetch a chunk's KV from the store, or compute it once with ``compute`` and store it."""

    def __init__(self, store: ChunkStore, fingerprint: str, compute, metrics: BlendMetrics | None = None) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.compute = compute  # (ids, kind) -> [L, 2, n, H, D]
        self.metrics = metrics or BlendMetrics()

    def get(self, ids: Sequence[int], kind: str = DOC, tenant_salt: str = "") -> torch.Tensor:
        key = chunk_key(self.fingerprint, ids, kind, tenant_salt)
        kv = self.store.get(key)
        if kv is not None and kv.shape[2] == len(ids):
            self.metrics.chunk_hits += 1
            return kv
        self.metrics.chunk_misses += 1
        kv = self.compute(list(ids), kind)
        self.store.put(key, kv)
        return kv
