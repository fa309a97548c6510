"""Page allocator with reference counts for the paged KV pool.

Every page in use has a ref count >= 1. A running request holds one ref on each page of
its context; the radix cache holds one ref on each page it owns. A page returns to the
free list when its count drops to zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, dtype=np.int32)
        # pop() from the end: hand out low page ids first (keeps tests readable)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages (ref 1 each), or None (and take nothing) if too few are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref on free page {p}")
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        for p in pages:
            r = self._refs[p]
            if r <= 0:
                raise RuntimeError(f"decref on free page {p}")
            self._refs[p] = r - 1
            if r == 1:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p in range(self.num_pages):
            if (p in free) != (self._refs[p] == 0):
                raise AssertionError(f"page {p}: ref {self._refs[p]} but free={p in free}")
