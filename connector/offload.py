"""Offload: staged copies of KV pages sent to the daemon in batches by a background thread.

The scheduler thread only copies pages out (``KVPool.read_pages``, one memcpy) and queues the
copy, so the pages can be freed at once; encoding, the "does the daemon already hold these?"
lookup and the Put happen here, off the critical path. When the staging budget is full new work
is dropped (and counted) instead of blocking the engine. Failures are counted and dropped too:
an offload is an optimisation, never a reason to fail a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from connector.dtypes import to_block_array
from connector.metrics import ConnectorMetrics
from kvstore.block import encode_block
from kvstore.client import KVStoreClient
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)
LAYOUT = "L2PHD"  # layers, k/v, page tokens, kv heads, head dim


class KnownKeys:
    """A bounded LRU set of keys known to be in the daemon (sent, found, or loaded)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._d[k] = None
                self._d.move_to_end(k)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._d

    def discard(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._d.pop(k, None)


class Offloader:
    def __init__(self, client: KVStoreClient, metrics: ConnectorMetrics, known: KnownKeys,
                 queue_bytes: int, batch_bytes: int) -> None:
        self.client = client
        self.metrics = metrics
        self.known = known
        self.queue_bytes = queue_bytes
        self.batch_bytes = batch_bytes
        self._q: deque[tuple[list[BlockKey], torch.Tensor]] = deque()
        self._queued = 0
        self._busy = False
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    def submit(self, keys: list[BlockKey], blocks: torch.Tensor) -> bool:
        """Queue ``blocks`` ([n, L, 2, P, H, D], already a private copy) under ``keys``."""
        nbytes = blocks.numel() * blocks.element_size()
        with self._cv:
            if self._stop or self._queued + nbytes > self.queue_bytes:
                self.metrics.offload_blocks.labels("dropped").inc(len(keys))
                return False
            self._q.append((keys, blocks))
            self._queued += nbytes
            self.metrics.offload_queue_bytes.set(self._queued)
            self._cv.notify()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far was sent (or dropped). False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # -- background ------------------------------------------------------------------------
    def _take(self) -> list[tuple[list[BlockKey], torch.Tensor]] | None:
        with self._cv:
            while not self._q and not self._stop:
                self._cv.wait()
            if not self._q:
                return None
            batch, size = [], 0
            while self._q and (not batch or size < self.batch_bytes):
                keys, blocks = self._q.popleft()
                nbytes = blocks.numel() * blocks.element_size()
                self._queued -= nbytes
                size += nbytes
                batch.append((keys, blocks))
            self._busy = True
            self.metrics.offload_queue_bytes.set(self._queued)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._send(batch)
            except Exception as e:  # noqa: BLE001 - offload failures are counted, never raised
                n = sum(len(k) for k, _ in batch)
                self.metrics.offload_blocks.labels("failed").inc(n)
                log.warning("offload of %d blocks failed: %s", n, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _send(self, batch: list[tuple[list[BlockKey], torch.Tensor]]) -> None:
        keys = [k for ks, _ in batch for k in ks]
        rows = [b[i] for ks, b in batch for i in range(len(ks))]
        held = self.client.lookup(keys).tiers  # do not send bytes the daemon already has
        todo = [i for i, t in enumerate(held) if t is None]
        if len(todo) < len(keys):
            self.metrics.offload_blocks.labels("skipped_held").inc(len(keys) - len(todo))
            self.known.add([keys[i] for i, t in enumerate(held) if t is not None])
        if not todo:
            return
        items, dtype = [], ""
        for i in todo:
            arr, dtype = to_block_array(rows[i])
            items.append((keys[i], encode_block(keys[i], arr, dtype=dtype, shape=arr.shape, layout=LAYOUT)))
        self.client.put_many(items)
        nbytes = sum(len(v) for _, v in items)
        self.known.add([keys[i] for i in todo])
        self.metrics.offload_blocks.labels("sent").inc(len(todo))
        self.metrics.offload_bytes.inc(nbytes)
