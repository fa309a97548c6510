"""Load: daemon blocks straight into fresh KV pool pages, under a deadline.

Blocks are fetched in chunks (one Get per ``chunk_bytes``) so that a deadline or a failure
keeps the contiguous prefix that already arrived. Every block is checked before it may feed
attention: key, dtype and shape from a private copy of its header, then the checksum of the
payload *as copied*; the first bad or missing block ends the usable prefix (the rest is
recomputed). Copy first, verify the copy: on the shared-memory path the source is a segment that
other writers can reach, so bytes verified there could differ from the bytes then copied. A block
is copied once, checksummed in the same pass (``connector.native.unpack_verify``: segment -> pool
page; on an accelerator: segment -> pinned host staging, then uploaded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from connector import native
from engine.kv_pool import KVPool
from kvstore.block import BlockHeader, read_header
from kvstore.client import KVStoreClient
from kvstore.errors import BlockFormatError, KVStoreError, KVStoreTimeout
from kvstore.keys import BlockKey
from kvstore.store_types import LookupResult

log = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    pages_ok: int  # contiguous leading pages whose KV is now in the pool
    seconds: float
    failure: str  # "" | deadline | unavailable | checksum | missing | error


def _expected_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return np.dtype("V2").str
    return np.dtype(str(dtype).removeprefix("torch.")).str


class _PageCopier:
    """Copies a block's payload into a pool page and verifies what was copied (one pass)."""

    def __init__(self, pool: KVPool, in_place: bool | None = None) -> None:
        """``in_place``: copy straight into the pool (default: when the pool is in host memory);
        otherwise into a one-page host staging buffer (pinned under CUDA), then upload."""
        self.pool = pool
        self._stage: torch.Tensor | None = None
        if in_place is None:
            in_place = pool.device.type == "cpu"
        if in_place:
            self._pages = native.page_bytes(pool.kv)
        else:
            layers, kv, *page = pool.block_shape()
            self._stage = torch.empty((layers, kv, 1, *page), dtype=pool.dtype, pin_memory=torch.cuda.is_available())
            self._pages = native.page_bytes(self._stage)

    def copy(self, page: int, header: BlockHeader, payload: memoryview) -> None:
        """Raises ChecksumError if the copy does not match (the page then holds garbage: the
        caller does not count it, and the pages from the first bad one on are recomputed)."""
        if self._stage is None:
            native.unpack_verify(header, payload, self._pages, [page])
            return
        native.unpack_verify(header, payload, self._pages, [0])
        self.pool.write_pages([page], self._stage.permute(2, 0, 1, 3, 4, 5))


class Loader:
    def __init__(self, client: KVStoreClient, pool: KVPool, chunk_bytes: int) -> None:
        self.client = client
        self.pool = pool
        self.chunk_pages = max(1, chunk_bytes // pool.bytes_per_page)
        self._shape = pool.block_shape()
        self._dtype = _expected_dtype(pool.dtype)
        self._copier = _PageCopier(pool)
        native.log_status()
        self.throttle_bps = 0.0  # > 0: a bandwidth test double, every chunk also waits bytes / this

    def _throttle(self, n_blocks: int, left: float) -> None:
        if self.throttle_bps > 0:
            time.sleep(min(left, n_blocks * self.pool.bytes_per_page / self.throttle_bps))

    def lookup(self, keys: Sequence[BlockKey], deadline_s: float) -> list[str | None]:
        """Tier of each leading key the daemon holds, up to the first miss (raises KVStoreError)."""
        res = self.lookup_all(keys, deadline_s)
        return list(res.tiers[: res.prefix_len])

    def lookup_all(self, keys: Sequence[BlockKey], deadline_s: float) -> LookupResult:
        """The daemon's whole answer: every key's tier, and the tier that evicted an absent one lately."""
        self.client.deadline_s = deadline_s
        return self.client.lookup(list(keys))

    def load(self, keys: Sequence[BlockKey], pages: Sequence[int], deadline_s: float) -> LoadResult:
        t0 = time.perf_counter()
        end = t0 + deadline_s
        ok = 0
        failure = ""
        for start in range(0, len(keys), self.chunk_pages):
            left = end - time.perf_counter()
            if left <= 0:
                failure = "deadline"
                break
            chunk = list(keys[start : start + self.chunk_pages])
            self._throttle(len(chunk), left)
            left = end - time.perf_counter()
            if left <= 0:
                failure = "deadline"
                break
            good = [False] * len(chunk)
            bad: list[str] = []

            def sink(i: int, mv: memoryview, start: int = start, chunk: list = chunk, good: list = good,
                     bad: list = bad) -> None:
                try:
                    hdr = read_header(mv)
                    if hdr.key != chunk[i] or hdr.shape != self._shape or hdr.dtype != self._dtype \
                            or hdr.payload_len != self.pool.bytes_per_page:
                        bad.append(f"mismatch: key/shape {hdr.shape}/dtype {hdr.dtype}")
                        return
                    self._copier.copy(pages[start + i], hdr, mv[hdr.size :])
                except BlockFormatError as e:  # ChecksumError included
                    bad.append(f"checksum: {e}")
                    return
                good[i] = True

            self.client.deadline_s = left
            try:
                self.client.read_many(chunk, sink)
            except KVStoreError as e:
                failure = "deadline" if isinstance(e, KVStoreTimeout) else "unavailable"
                log.info("load chunk at page %d failed (%s): %s", start, failure, e)
                break
            n = next((i for i, g in enumerate(good) if not g), len(good))
            ok += n
            if n < len(chunk):
                failure = "checksum" if bad else "missing"
                if bad:
                    log.warning("dropping a bad block from the daemon (%s); recomputing from page %d", bad[0], ok)
                break
        return LoadResult(ok, time.perf_counter() - t0, failure)
