"""Load: daemon blocks straight into fresh KV pool pages, under a deadline.

Every block is checked before it may feed attention: key, dtype and shape from a private copy of
its header, then the checksum of the payload *as copied*; the first bad or missing block ends
the usable prefix (the rest is recomputed). Copy first, verify the copy: on the shared-memory
path the source is memory other processes can reach, so bytes verified there could differ from
the bytes then copied. A block is copied once, checksummed in the same pass
(``connector.native_batch.unpack_verify_many``: source -> pool page, every block of a Get answer
in one native call on several threads; on an accelerator: -> pinned host staging, then uploaded).

Blocks the lookup located in the daemon's cpu arena (``in_place``, when this client maps it)
need no Get: they are copied straight from the mapping and verified like any other; the bytes
are not pinned, so one that fails its checks (reused since the lookup) is asked for again with a
Get, with everything after it.

How many blocks one Get asks for: when the daemon answers in place from its cpu arena (the
client mapped it, kvstore/client/shm.py) the answer is only handles, so one Get asks for the whole
load; otherwise one Get per ``chunk_bytes`` (what the daemon copies into the segment at once).
Either way a deadline keeps the contiguous prefix that arrived: the copy itself runs within
the time left, and blocks it did not reach are not counted.

Thread safety: ``load`` may be called from a worker thread; one load runs at a time per Loader
(they share the staging buffer), and ``lookup`` never waits for a load (each call carries its
own deadline to the client, which is shared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from connector import native, native_batch
from engine.kv_pool import KVPool
from kvstore.block import BlockHeader, read_header
from kvstore.client.client import KVStoreClient
from kvstore.errors import BlockFormatError, KVStoreError, KVStoreTimeout
from kvstore.keys import BlockKey
from kvstore.store.results import InPlace, LookupResult

log = logging.getLogger(__name__)
STAGE_PAGES = 32  # pages staged on the host at once for an accelerator pool


class LoadResult(NamedTuple):
    pages_ok: int  # contiguous leading pages whose KV is now in the pool
    seconds: float
    failure: str  # "" | deadline | unavailable | checksum | missing | error


def _expected_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return np.dtype("V2").str
    return np.dtype(str(dtype).removeprefix("torch.")).str


def _leading_ok(good: Sequence[bool | None]) -> int:
    """How many leading blocks arrived verified (``good[i]`` True)."""
    return next((i for i, g in enumerate(good) if g is not True), len(good))


class _PageCopier:
    """Copies blocks' payloads into pool pages and verifies what was copied (one pass)."""

    def __init__(self, pool: KVPool, in_place: bool | None = None, threads: int | None = None) -> None:
        """``in_place``: copy straight into the pool (default: when the pool is in host memory);
        otherwise into host staging pages (pinned under CUDA), then upload the verified ones."""
        self.pool = pool
        self.threads = threads
        self._stage: torch.Tensor | None = None
        if in_place is None:
            in_place = pool.device.type == "cpu"
        if in_place:
            self._pages = native.page_bytes(pool.kv)
        else:  # [pages, layers, 2, ...]: a run of staged pages is one contiguous (pinned) upload
            self._stage = torch.empty((STAGE_PAGES, *pool.block_shape()), dtype=pool.dtype,
                                      pin_memory=torch.cuda.is_available())
            self._pages = native.page_bytes(self._stage.permute(1, 2, 0, 3, 4, 5))

    def copy_many(self, pages: Sequence[int], headers: Sequence[BlockHeader], payloads: Sequence[memoryview],
                  budget_s: float) -> list[bool | None]:
        """Per block: True (its page now holds the verified block), False (checksum mismatch:
        the page holds garbage, never counted) or None (not reached within ``budget_s``)."""
        if self._stage is None:
            return native_batch.unpack_verify_many(headers, payloads, self._pages, pages, threads=self.threads,
                                                   budget_s=max(budget_s, 1e-9))
        out: list[bool | None] = []
        end = time.perf_counter() + budget_s
        for s in range(0, len(pages), STAGE_PAGES):
            left = end - time.perf_counter()
            n = min(STAGE_PAGES, len(pages) - s)
            if left <= 0:
                out += [None] * n
                continue
            res = native_batch.unpack_verify_many(headers[s : s + n], payloads[s : s + n], self._pages, range(n),
                                                  threads=self.threads, budget_s=left)
            good = [j for j, r in enumerate(res) if r]
            if good:  # a leading run uploads straight from the pinned buffer
                staged = self._stage[: len(good)] if good[-1] == len(good) - 1 else self._stage[good]
                self.pool.write_pages([pages[s + j] for j in good], staged)
            out += res
        return out


class Loader:
    def __init__(self, client: KVStoreClient, pool: KVPool, chunk_bytes: int, threads: int | None = None,
                 in_place_chunk_bytes: int | None = None) -> None:  # fmt: skip
        """``threads``: copy threads per batch (None: ``native.default_threads()`` for large ones).
        ``in_place_chunk_bytes``: bytes per Get when the daemon answers in place (None: all)."""
        self.client = client
        self.pool = pool
        self._page_len = pool.bytes_per_page  # (a torch computation each time it is asked)
        self.chunk_pages = max(1, chunk_bytes // self._page_len)
        self.in_place_chunk_pages = None if in_place_chunk_bytes is None else \
            max(1, in_place_chunk_bytes // self._page_len)
        self._shape = pool.block_shape()
        self._dtype = _expected_dtype(pool.dtype)
        self._copier = _PageCopier(pool, threads=threads)
        self._lock = threading.Lock()
        native.log_status()
        self.throttle_bps = 0.0  # > 0: a bandwidth test double, every chunk also waits bytes / this

    def _throttle(self, n_blocks: int, left: float) -> None:
        if self.throttle_bps > 0:
            time.sleep(min(left, n_blocks * self._page_len / self.throttle_bps))

    def lookup(self, keys: Sequence[BlockKey], deadline_s: float) -> list[str | None]:
        """Tier of each leading key the daemon holds, up to the first miss (raises KVStoreError)."""
        res = self.lookup_all(keys, deadline_s)
        return list(res.tiers[: res.prefix_len])

    def lookup_all(self, keys: Sequence[BlockKey], deadline_s: float, in_place: bool = False) -> LookupResult:
        """The daemon's whole answer: every key's tier, and the tier that evicted an absent one lately
        (``in_place``: and where the leading ones lie in its cpu arena, for ``load``)."""
        return self.client.lookup(list(keys), deadline_s=deadline_s, in_place=in_place)

    def load(self, keys: Sequence[BlockKey], pages: Sequence[int], deadline_s: float,
             in_place: InPlace | None = None) -> LoadResult:  # fmt: skip
        """``in_place``: where the lookup found the leading blocks in the daemon's cpu arena; those
        are copied from this client's mapping of it with no Get, and the first that fails its
        checks (its bytes were reused since) is asked for again with a Get, like the rest."""
        with self._lock:
            return self._load(keys, pages, deadline_s, in_place)

    def _check(self, key: BlockKey, mv: memoryview) -> tuple[BlockHeader, memoryview] | str:
        """The block's header (a private copy) and payload view, or why it cannot be this page."""
        try:
            hdr = read_header(mv)
        except BlockFormatError as e:
            return f"format: {e}"
        if hdr.key != key or hdr.shape != self._shape or hdr.dtype != self._dtype \
                or hdr.payload_len != self._page_len:
            return f"mismatch: key/shape {hdr.shape}/dtype {hdr.dtype}"
        return hdr, mv[hdr.size :]

    def _copy(self, chunk: Sequence[BlockKey], chunk_pages: Sequence[int], items: list[tuple[int, memoryview]],
              end: float, good: list[bool | None], bad: dict[int, str]) -> None:
        """Check, copy and verify ``items`` (index in ``chunk``, block bytes) into ``chunk_pages``:
        ``good[i]`` True (verified in its page), False (refused: ``bad[i]`` says why) or None (the
        deadline came first)."""
        idx, headers, payloads = [], [], []
        for i, mv in items:
            checked = self._check(chunk[i], mv)
            if isinstance(checked, str):
                good[i] = False
                bad[i] = checked
                continue
            idx.append(i)
            headers.append(checked[0])
            payloads.append(checked[1])
        if not idx:
            return
        res = self._copier.copy_many([chunk_pages[i] for i in idx], headers, payloads, end - time.perf_counter())
        for i, r in zip(idx, res, strict=True):
            good[i] = r
            if r is False:
                bad[i] = f"checksum mismatch for block {chunk[i].hex()[:16]} (as copied)"

    def _load_in_place(self, keys: Sequence[BlockKey], pages: Sequence[int], in_place: InPlace,
                       end: float) -> tuple[int, bool]:  # fmt: skip
        """Copy the leading blocks ``in_place`` locates straight from the arena: (how many arrived
        intact, whether the deadline stopped it)."""
        views = self.client.in_place_views(in_place)[: len(keys)]
        if not views:
            return 0, False
        self._throttle(len(views), end - time.perf_counter())
        good: list[bool | None] = [None] * len(views)
        bad: dict[int, str] = {}
        self._copy(keys, pages, list(enumerate(views)), end, good, bad)
        del views  # this client's mapping outlives them; nothing of the daemon's is held
        n = _leading_ok(good)
        if n < len(good) and good[n] is False:  # reused since the lookup: a Get answers for it
            log.debug("in-place read of block %s refused (%s): asking the daemon", keys[n].hex()[:16], bad[n])
        return n, n < len(good) and good[n] is None

    def _load(self, keys: Sequence[BlockKey], pages: Sequence[int], deadline_s: float,
              in_place: InPlace | None = None) -> LoadResult:  # fmt: skip
        t0 = time.perf_counter()
        end = t0 + deadline_s
        ok, start, failure = 0, 0, ""
        if in_place is not None:
            ok, late = self._load_in_place(keys, pages, in_place, end)
            start = ok
            if late:
                return LoadResult(ok, time.perf_counter() - t0, "deadline")
        while start < len(keys):
            left = end - time.perf_counter()
            if left <= 0:
                failure = "deadline"
                break
            step = (self.in_place_chunk_pages or len(keys)) if self.client.arena_active else self.chunk_pages
            chunk = list(keys[start : start + step])
            self._throttle(len(chunk), left)
            left = end - time.perf_counter()
            if left <= 0:
                failure = "deadline"
                break
            good: list[bool | None] = [None] * len(chunk)
            bad: dict[int, str] = {}  # why a block was refused

            def consume(items: list[tuple[int, memoryview]], chunk: list = chunk, good: list = good, bad: dict = bad,
                        chunk_pages: Sequence[int] = pages[start : start + len(chunk)]) -> None:
                self._copy(chunk, chunk_pages, items, end, good, bad)

            try:
                found = self.client.read_batches(chunk, consume, deadline_s=left)
            except KVStoreError as e:
                failure = "deadline" if isinstance(e, KVStoreTimeout) else "unavailable"
                log.info("load chunk at page %d failed (%s): %s", start, failure, e)
                break
            n = _leading_ok(good)
            ok += n
            if n < len(chunk):
                if good[n] is None and found[n]:
                    failure = "deadline"  # it arrived, but the copy ran out of time before it
                else:
                    failure = "checksum" if good[n] is False else "missing"
                if good[n] is False:
                    log.warning("dropping a bad block from the daemon (%s); recomputing from page %d", bad[n], ok)
                break
            start += len(chunk)
        return LoadResult(ok, time.perf_counter() - t0, failure)
