"""Load: daemon blocks straight into fresh KV pool pages, under a deadline.

Blocks are fetched in chunks (one Get per ``chunk_bytes``) so that a deadline or a failure
keeps the contiguous prefix that already arrived. Every block is checked before it may feed
attention: checksum, key, dtype and shape; the first bad or missing block ends the usable prefix
(the rest is recomputed). On the shared-memory path a block is copied once, from the segment the
daemon wrote into its pool page.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.kv_pool import KVPool
from kvstore.block import decode_block
from kvstore.client import KVStoreClient
from kvstore.errors import BlockFormatError, KVStoreError
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    pages_ok: int  # contiguous leading pages whose KV is now in the pool
    seconds: float
    failure: str  # "" | deadline | unavailable | checksum | missing | error


def _expected_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return np.dtype("V2").str
    return np.dtype(str(dtype).removeprefix("torch.")).str


class Loader:
    def __init__(self, client: KVStoreClient, pool: KVPool, chunk_bytes: int) -> None:
        self.client = client
        self.pool = pool
        self.chunk_pages = max(1, chunk_bytes // pool.bytes_per_page)
        self._shape = pool.block_shape()
        self._dtype = _expected_dtype(pool.dtype)
        self.throttle_bps = 0.0  # > 0: a bandwidth test double, every chunk also waits bytes / this

    def _throttle(self, n_blocks: int, left: float) -> None:
        if self.throttle_bps > 0:
            time.sleep(min(left, n_blocks * self.pool.bytes_per_page / self.throttle_bps))

    def lookup(self, keys: Sequence[BlockKey], deadline_s: float) -> list[str | None]:
        """Tier of each leading key the daemon holds, up to the first miss (raises KVStoreError)."""
        self.client.deadline_s = deadline_s
        res = self.client.lookup(list(keys))
        return list(res.tiers[: res.prefix_len])

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
                    blk = decode_block(mv, verify=True)
                except BlockFormatError as e:  # ChecksumError included
                    bad.append(f"checksum: {e}")
                    return
                if blk.key != chunk[i] or blk.shape != self._shape or blk.dtype.str != self._dtype:
                    bad.append(f"mismatch: key/shape {blk.shape}/dtype {blk.dtype.str}")
                    return
                payload = bytearray(blk.payload) if blk.payload.readonly else blk.payload
                src = torch.frombuffer(payload, dtype=self.pool.dtype).view(1, *self._shape)
                self.pool.write_pages([pages[start + i]], src)
                good[i] = True

            self.client.deadline_s = left
            try:
                self.client.read_many(chunk, sink)
            except KVStoreError as e:
                failure = "deadline" if "DEADLINE" in str(e) else "unavailable"
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
