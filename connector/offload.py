"""Offload: staged copies of KV pages sent to the daemon in batches by a background thread.

The scheduler thread only copies pages out (``StagedPages``: one pass, straight into encoded
blocks for a host pool; one device->host copy for an accelerator pool) and queues them, so the
pages can be freed at once; the "does the daemon already hold these?" lookup, the encoding still
left (accelerator pools) and the Put happen here, off the critical path. When the staging budget is full new work
is dropped (and counted) instead of blocking the engine. Failures are counted and dropped too:
an offload is an optimisation, never a reason to fail a request.

The shared namespace (declared shared prefixes) is written by admin credentials only
(kvstore/server/credentials.py). When the daemon refuses a batch that holds shared pages, the
offloader stops sending shared pages (counted ``refused``, logged once) and sends the rest again,
so a tenant's credential still offloads its own pages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from connector.metrics import ConnectorMetrics
from connector.staging import LAYOUT, StagedPages
from kvstore.client.client import KVStoreClient
from kvstore.errors import PermissionDenied
from kvstore.store.tenants import SHARED, tenant_of

log = logging.getLogger(__name__)
__all__ = ["LAYOUT", "KnownKeys", "Offloader"]


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
        self._q: deque[StagedPages] = deque()
        self._queued = 0
        self._busy = False
        self._cv = threading.Condition()
        self._stop = False
        self._shared_refused = False  # the daemon refused our shared pages once: send none any more
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    def submit(self, staged: StagedPages) -> bool:
        """Queue pages already copied out of the pool (a private copy)."""
        nbytes = staged.nbytes
        with self._cv:
            if self._stop or self._queued + nbytes > self.queue_bytes:
                self.metrics.offload_blocks.labels("dropped").inc(len(staged))
                return False
            self._q.append(staged)
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
    def _take(self) -> list[StagedPages] | None:
        with self._cv:
            while not self._q and not self._stop:
                self._cv.wait()
            if not self._q:
                return None
            batch, size = [], 0
            while self._q and (not batch or size < self.batch_bytes):
                staged = self._q.popleft()
                self._queued -= staged.nbytes
                size += staged.nbytes
                batch.append(staged)
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
                n = sum(len(s) for s in batch)
                self.metrics.offload_blocks.labels("failed").inc(n)
                log.warning("offload of %d blocks failed: %s", n, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _own(self, keys: list[bytes], todo: list[int]) -> list[int]:
        """``todo`` without the shared namespace's keys (counted refused)."""
        own = [i for i in todo if tenant_of(keys[i]) != SHARED]
        if len(own) < len(todo):
            self.metrics.offload_blocks.labels("refused").inc(len(todo) - len(own))
        return own

    def _send(self, batch: list[StagedPages]) -> None:
        keys = [k for s in batch for k in s.keys]
        held = self.client.lookup(keys, read=False).tiers  # do not send bytes the daemon already has
        todo = [i for i, t in enumerate(held) if t is None]
        if len(todo) < len(keys):
            self.metrics.offload_blocks.labels("skipped_held").inc(len(keys) - len(todo))
            self.known.add([keys[i] for i, t in enumerate(held) if t is not None])
        if self._shared_refused:
            todo = self._own(keys, todo)
        if not todo:
            return
        items, first = [], 0
        for s in batch:
            items += s.encoded([i - first for i in todo if first <= i < first + len(s)])
            first += len(s)
        try:
            self.client.put_many(items)
        except PermissionDenied as e:
            if self._shared_refused or len(own := self._own(keys, todo)) == len(todo):
                raise
            self._shared_refused = True
            log.warning("the daemon refused shared-prefix pages (%s): only an admin credential writes the shared "
                        "namespace; this engine offloads its tenants' pages only from now on", e)
            keep = {keys[i] for i in own}
            todo, items = own, [(k, v) for k, v in items if k in keep]
            if items:
                self.client.put_many(items)
        nbytes = sum(len(v) for _, v in items)
        self.known.add([keys[i] for i in todo])
        self.metrics.offload_blocks.labels("sent").inc(len(todo))
        self.metrics.offload_bytes.inc(nbytes)
