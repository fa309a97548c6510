"""CPU tier: a byte-capacity arena in host memory (pinned when CUDA is present).

Why an arena: one up-front allocation bounds the tier's memory at its configured bytes, avoids
malloc churn for multi-MB blocks, and (with torch) gives page-locked memory the GPU can DMA from.

Zero-copy reads: ``get`` returns a read-only memoryview into the arena. It stays valid and
unchanged for as long as it, or anything derived from it (slices, ``np.frombuffer``), is alive:
deleting or overwriting the key only *defers* reuse of those arena bytes until the last view is
dropped. Each block has one read-only numpy view of its bytes, made at put, and every memoryview
``get`` hands out is exported from it, so holds a reference to it: a retired block whose view is
referenced from anywhere but its own record still has readers. Its bytes are reclaimed at the
next put that finds it unreferenced. (An earlier version gave each get its own view and a weakref
with a callback; that cost 5 us more per get when the caches are cold, as they are between
multi-MB copies.)
While bytes are held like that, a put that finds no free arena run falls back to a heap copy
(counted against the capacity like any other block), so callers never see a spurious "full";
the tier still refuses to hold more than its capacity in blocks.

Shared arena (Linux, unless pinned): the arena is a memfd (tiers/memfd.py: every page reserved at
start, sealed), so a client process on this host can map it read-only (``share()``: a read-only
fd the daemon passes over its unix socket, the size and a random token at its start;
kvstore/client/shm.py ArenaMap maps it) and copy a block straight out of it: a Get then costs the
daemon no copy at all. ``arena_offset(view)`` says where a view handed out by ``get`` lies in
that file; keeping the view is what pins those bytes for the reader (the daemon's lease,
kvstore/server/shm_sessions.py). Only this tier's own mapping can write there: the memfd is sealed
against every later writable mapping, write or resize, and its mode is 0.

Page size: a copy out of 4 KiB pages runs 15-20% slower than out of 2 MiB ones (TLB misses; measured
by bench.tiers on a 2-core VM). A private arena gets transparent huge pages like any large numpy
array; a memfd gets them only where the kernel's shmem THP setting allows (``madvise``d here; off
by default on most kernels). ``huge_pages=True`` backs the shared arena with reserved hugetlb pages
(``vm.nr_hugepages``, or a pod's ``hugepages-2Mi``): allocated up front with fallocate, so a
shortage shows at start-up, never as a SIGBUS later; if they cannot be had the arena falls back to
ordinary pages and says so. ``page_kind`` names what the arena got.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tiers.base import Buffer, Tier
from tiers.errors import BlockTooLarge, TierError
from tiers.memfd import ARENA_HEADER, HUGE_PAGE, TOKEN_BYTES, ArenaShare, page_kind, shared_arena

__all__ = ["ARENA_HEADER", "HUGE_PAGE", "TOKEN_BYTES", "ArenaShare", "CpuTier", "shared_arena"]

log = logging.getLogger(__name__)


@dataclass
class _Block:
    """Where one value lives: an arena run (``offset``), else a heap array (``view`` owns it)."""

    size: int
    offset: int = -1
    view: np.ndarray | None = None  # read-only view of its bytes: every get exports from it


def _want_pinned() -> bool:
    """Pin only when CUDA can use it; avoid importing torch on machines with no GPU driver."""
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


_OWN_REFS = 2  # sys.getrefcount of a block's view held only by its record (+1: the call's argument)
def _allocate_arena(nbytes: int, pinned: bool) -> np.ndarray:
    if pinned:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)


class _Allocator:
    """Best-fit allocator over free runs of the arena, coalescing neighbours on free.

    Runs are kept in two dicts (start -> size, end -> start) so freeing and merging are O(1);
    allocation scans the free runs, which stay few because blocks are large (0.5-2 MB).
    """

    ALIGN = 64

    def __init__(self, size: int) -> None:
        self._by_start: dict[int, int] = {0: size} if size else {}
        self._by_end: dict[int, int] = {size: 0} if size else {}

    def _span(self, n: int) -> int:
        return (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN

    def alloc(self, n: int) -> int:
        """Offset of a run of ``n`` bytes, or -1 when no free run is large enough."""
        need = self._span(n)
        best, best_size = -1, 0
        for start, size in self._by_start.items():
            if size >= need and (best < 0 or size < best_size):
                best, best_size = start, size
                if size == need:
                    break
        if best < 0:
            return -1
        del self._by_start[best]
        del self._by_end[best + best_size]
        if best_size > need:
            self._add(best + need, best_size - need)
        return best

    def free(self, offset: int, n: int) -> None:
        start, size = offset, self._span(n)
        prev = self._by_end.pop(start, None)
        if prev is not None:
            size += self._by_start.pop(prev)
            start = prev
        nxt = self._by_start.pop(start + size, None)
        if nxt is not None:
            del self._by_end[start + size + nxt]
            size += nxt
        self._add(start, size)

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start


class CpuTier(Tier):
    name = "cpu"
    persistent = False
    in_process = True

    def __init__(self, capacity_bytes: int, *, pinned: bool | None = None, shared: bool | None = None,
                 huge_pages: bool = False) -> None:
        """``shared``: arena in a memfd other processes may map (None: when not pinned and possible).
        ``huge_pages``: back a shared arena with reserved hugetlb pages when there are enough."""
        super().__init__(capacity_bytes)
        self.pinned = _want_pinned() if pinned is None else pinned
        made = None if self.pinned or shared is False else shared_arena(self.capacity_bytes, huge_pages)
        if shared and made is None:
            raise TierError(self.name, "cannot make a shared arena (no memfd_create, or it failed)")
        self._share: ArenaShare | None = made[1] if made else None
        #: the arena's pages: "hugetlb", "thp" (transparent huge pages), "4KiB" or "pinned"
        self.page_kind = made[2] if made else page_kind(shared=False, pinned=self.pinned)
        if huge_pages and made is None:
            log.warning("cpu tier: huge_pages applies to the shared arena only; this one is private (%s pages)",
                        self.page_kind)
        # the memfd's pages live as long as its mapping and the clients' fd: closed by close(), or when
        # the tier is collected
        self._close_fd = weakref.finalize(self, os.close, made[1].fd) if made else None
        self._arena: np.ndarray | None = made[0] if made else _allocate_arena(self.capacity_bytes, self.pinned)
        self._base = self._arena.ctypes.data
        self._alloc = _Allocator(self.capacity_bytes)
        self._blocks: dict[bytes, _Block] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._retired: list[_Block] = []  # out of the index, bytes still referenced by a reader

    # -- helpers --------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._arena is None:
            raise TierError(self.name, "tier is closed")
        return self._arena

    @staticmethod
    def _has_readers(blk: _Block) -> bool:
        """Whether anything but ``blk`` itself references its view (a memoryview from get, or
        anything derived from one). Under the lock, for a block out of the index: no new reader
        can appear, so the answer can only go from True to False."""
        return blk.view is not None and sys.getrefcount(blk.view) > _OWN_REFS

    def _reclaim(self) -> None:
        """Free the retired blocks nobody reads any more."""
        if self._retired:
            still = []
            for blk in self._retired:
                (still.append if self._has_readers(blk) else self._free_storage)(blk)
            self._retired = still

    def _free_storage(self, blk: _Block) -> None:
        if blk.offset >= 0:
            self._alloc.free(blk.offset, blk.size)
            blk.offset = -1
        blk.view = None

    def _retire(self, blk: _Block) -> None:
        """Drop a block from the index; free its bytes now, or once its last reader is gone."""
        self._used -= blk.size
        if self._has_readers(blk):
            self._retired.append(blk)
        else:
            self._free_storage(blk)

    # -- Tier interface -------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> None:
        """Reserve space under the lock, copy without it, then publish under it again.

        The copy (the only slow part) runs unlocked so concurrent gets are never held up behind
        a multi-MB memcpy. Reserved bytes count against the capacity from the start; a put that
        would take the tier past its capacity fails before touching the current value.
        """
        src = memoryview(value).cast("B") if not isinstance(value, bytes) else value
        n, key = len(src), bytes(key)
        if n > self.capacity_bytes:
            raise BlockTooLarge(f"[cpu] block of {n} bytes exceeds capacity {self.capacity_bytes}")
        with self._lock:
            arena = self._check_open()
            self._reclaim()
            old = self._blocks.get(key)
            if self._used - (old.size if old else 0) + n > self.capacity_bytes:
                raise TierError(self.name, f"full ({self._used}+{n} > {self.capacity_bytes}); evict first")
            blk = _Block(size=n, offset=self._alloc.alloc(n) if n else -1)
            self._used += n
        if blk.offset >= 0:
            arena[blk.offset : blk.offset + n] = np.frombuffer(src, dtype=np.uint8)
            blk.view = arena[blk.offset : blk.offset + n]
        elif n:  # no free run (fragmented, or runs held by live views): keep a heap copy
            blk.view = np.frombuffer(src, dtype=np.uint8).copy()
        if blk.view is not None:
            blk.view.flags.writeable = False  # what get hands out derives from it: read-only too
        with self._lock:
            if self._arena is not arena:  # closed while we copied
                raise TierError(self.name, "tier is closed")
            old = self._blocks.pop(key, None)
            if old is not None:
                self._retire(old)
            self._blocks[key] = blk

    def get(self, key: bytes) -> memoryview | None:
        # Lean on purpose: a get follows a multi-MB copy (the previous block's), which leaves the
        # interpreter's caches cold, so every object made here costs several times what it costs
        # in a loop (bench.tiers cpu measures the get against a plain copy).
        with self._lock:
            self._check_open()
            blk = self._blocks.get(bytes(key))
            if blk is None:
                return None
            # exported under the lock: the reference it holds is what defers reuse of the bytes
            return memoryview(blk.view) if blk.view is not None else memoryview(b"")

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [bytes(k) in self._blocks for k in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            self._check_open()
            blk = self._blocks.pop(bytes(key), None)
            if blk is None:
                return False
            self._retire(blk)
            return True

    def scan(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            self._check_open()
            items = [(k, b.size) for k, b in self._blocks.items()]
        yield from items

    # -- shared arena ---------------------------------------------------------
    def arena(self) -> CpuTier:
        """This tier is its own arena (share, locate, arena_offset, page_kind)."""
        return self

    def share(self) -> ArenaShare | None:
        """How to map the arena from another process on this host (None: not shared, or closed)."""
        return self._share

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(offset in the shared arena's file, length) of ``key``'s bytes, or None (absent, a heap
        copy, empty, no shared arena). Not a pin: once the key goes its bytes may be reused, so a
        reader that copies them without a lease must verify what it copied (kvstore/block.py)."""
        if self._share is None:
            return None
        with self._lock:
            self._check_open()
            blk = self._blocks.get(bytes(key))  # published only once its bytes are all there
            if blk is None or blk.offset < 0 or not blk.size:
                return None
            return ARENA_HEADER + blk.offset, blk.size

    def arena_offset(self, view: memoryview) -> int | None:
        """Offset in the shared arena's file of the bytes ``view`` (from ``get``) shows, or None
        when they are not in it (a heap copy, an empty block, no shared arena)."""
        if self._share is None or not view.nbytes:
            return None
        obj = view.obj  # the numpy view ``get`` made (same bytes: read its address, not a new array's)
        arr = obj if isinstance(obj, np.ndarray) and obj.nbytes == view.nbytes else np.frombuffer(view, np.uint8)
        off = arr.ctypes.data - self._base
        return ARENA_HEADER + off if 0 <= off and off + view.nbytes <= self.capacity_bytes else None

    def close(self) -> None:
        """Forget every block. Views handed out earlier keep the arena memory alive and valid
        (so do clients' mappings of a shared arena: closing its fd only stops new ones)."""
        with self._lock:
            self._arena = None
            self._blocks.clear()
            self._used = 0
            self._share = None
        if self._close_fd is not None:
            self._close_fd()  # once: a second close() does nothing
