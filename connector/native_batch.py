"""Many one-page blocks <-> pool pages in one native call, on several threads.

Why: a 2k-token hit is ~128 blocks of ~0.7 MB. One call for all of them crosses into C once
instead of 128 times, and lets every core copy and hash: the blocks are independent (each has
its own checksum), so using all cores needs no change to the block format. The threads take
blocks in order from a shared counter, so a time budget (the load's deadline) stops at (nearly)
a leading run of blocks; blocks not reached are reported as such, never half-counted.

Same results as the single-block ops in connector/native.py, bit for bit, with the same numpy
fallback (tests/connector/native/test_batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from connector import native_lib
from connector.native import (
    THREAD_MIN_BYTES,
    Buffer,
    _flags,
    _flat,
    _native,
    _page_list,
    _pool_view,
    default_threads,
    hashed_header,
    pack_checksum,
    unpack_verify,
)
from kvstore.block import BlockHeader
from kvstore.errors import ChecksumError

UNPACK, PACK = 0, 1


def _threads(threads: int | None, nbytes: int) -> int:
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if nbytes < THREAD_MIN_BYTES:
        return 1
    return default_threads() if threads is None else threads


def _run(lib, direction: int, prefixes: list[bytes], blocks: list[np.ndarray], pool: np.ndarray, ids: list[int],
         threads: int, budget_s: float) -> tuple[np.ndarray, np.ndarray]:
    """tkv_batch over the blocks: (digests, status) with status 1 done, -3 too short, 0 not reached."""
    layers, _, _, seg = pool.shape
    n = len(ids)
    joined = np.frombuffer(b"".join(prefixes), np.uint8)
    lens = np.fromiter(map(len, prefixes), np.int64, n)
    ptrs = np.zeros(n, np.uint64)
    ptrs[1:] = np.cumsum(lens[:-1], dtype=np.uint64)
    ptrs += np.uint64(joined.ctypes.data)
    addrs = np.fromiter((b.ctypes.data for b in blocks), np.uint64, n)
    pages = np.asarray(ids, np.int64)
    digests, status = np.zeros(n, np.uint64), np.zeros(n, np.int8)
    lib.tkv_batch(direction, n, ptrs.ctypes.data, lens.ctypes.data, addrs.ctypes.data, pool.ctypes.data,
                  native_lib.I64x3(*pool.strides[:3]), pages.ctypes.data, layers, seg, threads,
                  _flags(n * layers * 2 * seg), budget_s, digests.ctypes.data, status.ctypes.data)
    return digests, status


def _one_page_each(pool: np.ndarray, pages: Sequence[int], bufs: Sequence[Buffer], what: str,
                   writable: bool) -> tuple[list[int], list[np.ndarray], int]:
    """The checked page list, each buffer as one page of flat bytes, and a page's byte count."""
    layers, _, num_pages, seg = pool.shape
    ids = _page_list(pages, num_pages)
    page_len = layers * 2 * seg
    return ids, [_flat(b, page_len, f"{what} {i}", writable=writable) for i, b in enumerate(bufs)], page_len


def unpack_verify_many(headers: Sequence[BlockHeader], payloads: Sequence[Buffer], pool: np.ndarray,
                       pages: Sequence[int], threads: int | None = None, budget_s: float = 0.0,
                       use_native: bool | None = None) -> list[bool | None]:
    """Copy each one-page block ``payloads[i]`` into pool page ``pages[i]`` and check what was
    copied against ``headers[i]``: per block True (verified), False (checksum mismatch: that page
    holds bad bytes) or None (not reached within ``budget_s`` seconds, when > 0).

    ``threads``: None uses ``default_threads()`` for batches of ``THREAD_MIN_BYTES`` or more.
    Raises ValueError on bad arguments, before any byte moves.
    """
    pool = _pool_view(pool, writable=True)
    n = len(headers)
    if len(payloads) != n or len(pages) != n:
        raise ValueError(f"{n} headers, {len(payloads)} payloads and {len(pages)} pages")
    if n == 0:
        return []
    ids, srcs, page_len = _one_page_each(pool, pages, payloads, "payload", writable=False)
    for i, h in enumerate(headers):
        if h.payload_len != page_len:
            raise ValueError(f"header {i} says {h.payload_len} payload bytes, a page has {page_len}")
    nthreads = _threads(threads, n * page_len)
    lib = _native(pool, use_native)
    out: list[bool | None] = [None] * n
    status = np.zeros(n, np.int8)
    if lib is not None:
        digests, status = _run(lib, UNPACK, [hashed_header(h.raw) for h in headers], srcs, pool, ids, nthreads,
                               budget_s)
        for k in np.flatnonzero(status == 1):
            out[k] = int(digests[k]) == headers[k].checksum
    end = time.monotonic() + budget_s
    for k in np.flatnonzero(status == native_lib.TOO_SHORT) if lib is not None else range(n):
        if budget_s > 0 and time.monotonic() >= end:
            break
        try:
            unpack_verify(headers[k], srcs[k], pool, [ids[k]], use_native=False)
            out[k] = True
        except ChecksumError:
            out[k] = False
    return out


def pack_checksum_many(prefixes: Sequence[bytes], pool: np.ndarray, pages: Sequence[int], outs: Sequence[Buffer],
                       threads: int | None = None, use_native: bool | None = None) -> list[int]:
    """Gather pool page ``pages[i]`` into ``outs[i]`` (one page of bytes, writable, contiguous)
    and return xxh3_64 of ``prefixes[i]`` followed by what was written, for every i."""
    pool = _pool_view(pool, writable=False)
    n = len(prefixes)
    if len(outs) != n or len(pages) != n:
        raise ValueError(f"{n} prefixes, {len(outs)} outputs and {len(pages)} pages")
    if n == 0:
        return []
    ids, dsts, page_len = _one_page_each(pool, pages, outs, "output", writable=True)
    prefixes = [bytes(p) for p in prefixes]
    lib = _native(pool, use_native)
    if lib is None:
        return [pack_checksum(p, pool, [i], d, use_native=False) for p, i, d in zip(prefixes, ids, dsts, strict=True)]
    digests, status = _run(lib, PACK, prefixes, dsts, pool, ids, _threads(threads, n * page_len), 0.0)
    return [int(digests[k]) if status[k] == 1 else pack_checksum(prefixes[k], pool, [ids[k]], dsts[k], use_native=False)
            for k in range(n)]
